"""CUDA graphs: a full-graph replay skips the per-layer hooks (``wait_for_layer_load``,
``save_kv_layer``), so pof asks vLLM for piecewise graphs, and vLLM's own config code takes the
answer; a step whose hooks were skipped anyway stores nothing from staging the forward never
filled and recomputes its loads. Runs on CPU tensors; the GPU harness
(test_vllm_gpu_harness.py) replays the skipped hook on ``cuda:0``."""

from __future__ import annotations

from collections.abc import Iterator
from unittest import mock

import pytest
import torch

from pof_connector.adapters.vllm import PoFConnector
from pof_connector.adapters.vllm_geometry import VllmGeometry
from pof_connector.adapters.vllm_metadata import LoadJob, PoFConnectorMetadata, SaveJob
from pof_connector.adapters.vllm_worker import PoFWorker
from pof_connector.config import PofConfig

pytestmark = pytest.mark.vllm

H, N, D, LAYERS = 2, 32, 32, 3
GEO = VllmGeometry(model="m", kv_dtype="float32", kv_heads=H, head_dim=D, num_layers=LAYERS, is_mla=False,
                   block_size=N, page_tokens=N, tp_size=1)


@pytest.mark.parametrize("extra", [{}, {"node_id": "a", "tiers": {"cpu_dram": {"size": "1GiB"}}}])
def test_pof_asks_for_piecewise_cuda_graphs(extra: dict[str, object]) -> None:
    assert PoFConnector.requires_piecewise_for_cudagraph(extra) is True


def test_vllms_config_leaves_no_full_graph_with_pof() -> None:
    """vLLM's own ``VllmConfig`` (``config/vllm.py``) consults the connector class when graphs
    are possible (a CUDA platform: patched in here) and its mode has full graphs; with pof
    none remains."""
    from vllm.config import CompilationConfig, KVTransferConfig, VllmConfig
    from vllm.config.compilation import CUDAGraphMode
    from vllm.platforms import current_platform

    transfer = KVTransferConfig(kv_connector="PoFConnector", kv_connector_module_path="pof_connector.adapters.vllm",
                                kv_role="kv_both", kv_connector_extra_config={"node_id": "a"})
    with mock.patch.object(type(current_platform), "support_static_graph_mode", return_value=True):
        config = VllmConfig(kv_transfer_config=transfer,
                            compilation_config=CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE))
    assert not config.compilation_config.cudagraph_mode.has_full_cudagraphs()


@pytest.fixture
def worker(runtime_dir: str) -> Iterator[tuple[PoFWorker, dict[str, torch.Tensor]]]:
    cfg = PofConfig.from_mapping({"node_id": "w", "index_url": "local", "runtime_dir": runtime_dir,
                                  "tiers": {"cpu_dram": {"size": "16MiB"}}})
    w = PoFWorker(cfg, GEO, tp_rank=0, overlap=False)
    kv = {f"model.layers.{i}.self_attn.attn": torch.randn(8, H, N, 2 * D) for i in range(LAYERS)}
    w.register(kv)
    yield w, kv
    w.close()


def test_a_step_whose_save_hooks_a_full_graph_skipped_stores_nothing(worker: tuple[PoFWorker, dict[str, torch.Tensor]]
                                                                      ) -> None:
    """The staging of a save is filled layer by layer in ``save_kv_layer``: skipped (all layers,
    or one), the pages would be stored from whatever the buffer held, under right keys."""
    w, kv = worker
    keys = w.pool.keys_for(list(range(2 * N)))
    names = list(kv)
    for skipped in (names, names[1:2]):
        w.prepare_saves(PoFConnectorMetadata(saves=[SaveJob("r", keys, [[1], [2]])]))
        w.start(PoFConnectorMetadata())
        for name in names:
            if name not in skipped:
                w.save_layer(name)
        w.end_step()
        w.pool.flush()
        assert w.pool.lookup(keys).pages == 0
    assert w.pool.stats.get("skipped_hooks", hook="save_kv_layer") == 2
    w.prepare_saves(PoFConnectorMetadata(saves=[SaveJob("r", keys, [[1], [2]])]))     # every hook ran: stored
    for name in names:
        w.save_layer(name)
    w.end_step()
    w.pool.flush()
    assert w.pool.lookup(keys).pages == 2


def test_a_load_whose_wait_hook_a_full_graph_skipped_is_recomputed(worker: tuple[PoFWorker, dict[str, torch.Tensor]]
                                                                    ) -> None:
    """The forward read a layer without waiting for its copy: its blocks may have held anything
    then, so every page of the step is reported for recompute."""
    w, kv = worker
    keys = w.pool.keys_for(list(range(2 * N)))
    names = list(kv)
    w.prepare_saves(PoFConnectorMetadata(saves=[SaveJob("r", keys, [[1], [2]])]))
    for name in names:
        w.save_layer(name)
    w.end_step()
    w.pool.flush()
    sources = w.pool.lookup(keys).sources
    meta = PoFConnectorMetadata(loads=[LoadJob("l", keys, sources, [[5], [6]])])
    w.start(meta)
    for name in names[:-1]:                   # the last layer's wait skipped
        w.wait_layer(name)
    w.end_step()
    assert w.take_load_errors() == {5, 6}
    w.start(meta)
    for name in names:
        w.wait_layer(name)
    w.end_step()
    assert w.take_load_errors() == set()
