"""The worker half of the vLLM connector on real CPU KV tensors (laid out by vLLM's own kernel),
with a real pool — no server: saves, layer-wise loads, and errors turned into recompute."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pof_connector.adapters.vllm import PoFConnector
from pof_connector.adapters.vllm_geometry import VllmGeometry
from pof_connector.adapters.vllm_metadata import LoadJob, PoFConnectorMetadata, SaveJob
from pof_connector.adapters.vllm_worker import PoFWorker
from pof_connector.config import PofConfig
from pof_connector.index import Location
from pof_connector.pages import page_sum

pytestmark = pytest.mark.vllm

H, N, D, LAYERS, BLOCKS = 2, 32, 32, 2, 16
GEO = VllmGeometry(model="m", kv_dtype="float32", kv_heads=H, head_dim=D, num_layers=LAYERS, is_mla=False,
                   block_size=N, page_tokens=2 * N, tp_size=1)


def make_worker(runtime_dir: str, overlap: bool | None = None) -> tuple[PoFWorker, dict[str, torch.Tensor]]:
    cfg = PofConfig.from_mapping({"node_id": "w", "index_url": "local", "runtime_dir": runtime_dir,
                                  "tiers": {"cpu_dram": {"size": "16MiB"}}})
    worker = PoFWorker(cfg, GEO, tp_rank=0, overlap=overlap)
    kv = {f"model.layers.{i}.self_attn.attn": torch.zeros(BLOCKS, H, N, 2 * D) for i in range(LAYERS)}
    worker.register(kv)
    return worker, kv


@pytest.fixture(params=["inline", "inline-threads", "overlapped"])
def worker(runtime_dir: str, request: pytest.FixtureRequest) -> Iterator[tuple[PoFWorker, dict[str, torch.Tensor]]]:
    """A worker that copies loads on the forward's thread (alone, or with the kernel's helper
    threads as in a vLLM CPU worker whose torch computes on two cores), or on a thread of its own."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2 if request.param == "inline-threads" else 1)
    try:
        w, kv = make_worker(runtime_dir, overlap=request.param == "overlapped")
    finally:
        torch.set_num_threads(threads)
    if request.param == "inline-threads" and page_sum.NATIVE is not None:
        assert w.copy_threads == 2          # as many as torch computes with
    else:
        assert w.copy_threads == 1
    yield w, kv
    w.close()


def step(worker: PoFWorker, kv: dict[str, torch.Tensor], meta: PoFConnectorMetadata) -> set[int]:
    """One forward as vLLM drives it; returns the blocks reported as load errors."""
    worker.prepare_saves(meta)
    worker.start(meta)
    for name in kv:
        worker.wait_layer(name)
        worker.save_layer(name)
    worker.end_step()
    return worker.take_load_errors()


def test_save_then_load_moves_blocks_exactly(worker: Any) -> None:
    w, kv = worker
    assert w.layout.name in ("cpu_kt", "cpu_vnni", "cpu_probed")
    for t in kv.values():
        t.copy_(torch.randn_like(t))
    keys = w.pool.keys_for(list(range(4 * N)))              # 2 pages of 2 blocks
    assert step(w, kv, PoFConnectorMetadata(saves=[SaveJob("r1", keys, [[3, 4], [7, 8]])])) == set()
    w.pool.flush()
    original = {name: t.clone() for name, t in kv.items()}
    for t in kv.values():
        t.zero_()
    lookup = w.pool.lookup(keys)
    assert lookup.pages == 2
    load = LoadJob("r2", keys, lookup.sources, [[10, 11], [12, 13]], skip_blocks=1)
    assert w.wait_seconds == []                         # the save's step loaded nothing: no wait recorded
    assert step(w, kv, PoFConnectorMetadata(loads=[load])) == set()
    assert len(w.wait_seconds) == 1 and 0 < w.wait_seconds[0] < 5       # one step loaded
    for name in kv:
        assert torch.count_nonzero(kv[name][10]) == 0                       # the skipped head block
        assert torch.equal(kv[name][11], original[name][4])
        assert torch.equal(kv[name][12:14], original[name][7:9])


def test_unexpected_errors_become_recompute(worker: Any) -> None:
    """A bug (here: block ids past the end of the cache) must not escape into the engine: the
    connector reports every promised block for recompute and counts the error."""
    w, kv = worker
    keys = w.pool.keys_for(list(range(4 * N)))
    w.pool.store([(keys[0], [torch.zeros(2, 2 * N, H, D).numpy().view("uint8").reshape(-1)] * LAYERS)]).result()
    lookup = w.pool.lookup(keys)
    connector = PoFConnector.__new__(PoFConnector)    # the real hooks around a real worker
    connector._worker = w
    connector._scheduler = None
    bad = LoadJob("r", keys[:1], lookup.sources, [[5, BLOCKS + 7]])
    meta = PoFConnectorMetadata(loads=[bad], fail_blocks=[9])
    connector.bind_connector_metadata(meta)
    connector.start_load_kv(None)
    for name in kv:
        connector.wait_for_layer_load(name)
        connector.save_kv_layer(name, kv[name], None)
    connector.wait_for_save()
    assert connector.get_block_ids_with_load_errors() == {5, BLOCKS + 7, 9}
    assert w.pool.stats.get("adapter_errors", hook="wait_for_layer_load") == 1
    lost = Location("w", "cpu_dram", 0, 0)
    gone = LoadJob("r3", keys[1:2], [lost], [[6, 7]])                       # a page the pool does not hold
    assert step(w, kv, PoFConnectorMetadata(loads=[gone])) == {6, 7}


def saved_pages(w: PoFWorker, kv: dict[str, torch.Tensor]) -> tuple[list[Any], dict[str, torch.Tensor]]:
    """Two pages (blocks 3-4 and 7-8) saved to the pool; their keys and the saved caches."""
    for t in kv.values():
        t.copy_(torch.randn_like(t))
    keys = w.pool.keys_for(list(range(4 * N)))
    assert step(w, kv, PoFConnectorMetadata(saves=[SaveJob("r1", keys, [[3, 4], [7, 8]])])) == set()
    w.pool.flush()
    original = {name: t.clone() for name, t in kv.items()}
    for t in kv.values():
        t.zero_()
    return keys, original


def test_later_layers_load_while_the_engine_computes_earlier_ones(runtime_dir: str) -> None:
    """Overlapped, the loader runs ahead of the forward: after ``start`` and the first layer's
    wait, the last layer's blocks fill without the engine asking for them (it is computing layer 0)."""
    w, kv = make_worker(runtime_dir, overlap=True)
    try:
        later_layers_fill(w, kv)
    finally:
        w.close()


def later_layers_fill(w: PoFWorker, kv: dict[str, torch.Tensor]) -> None:
    keys, original = saved_pages(w, kv)
    names = list(kv)
    w.start(PoFConnectorMetadata(loads=[LoadJob("r2", keys, w.pool.lookup(keys).sources, [[10, 11], [12, 13]])]))
    w.wait_layer(names[0])
    assert torch.equal(kv[names[0]][10:14], torch.cat([original[names[0]][3:5], original[names[0]][7:9]]))
    last = kv[names[-1]]
    deadline = time.monotonic() + 10
    while not torch.equal(last[12:14], original[names[-1]][7:9]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert torch.equal(last[12:14], original[names[-1]][7:9])      # copied in the background
    for name in names[1:]:                                          # the forward reaches the later layers
        w.wait_layer(name)
    w.end_step()
    assert w.take_load_errors() == set()


def test_a_page_failing_at_its_last_layer_is_reported_after_the_forward(worker: Any) -> None:
    """The loader checks every layer on its thread; a page whose last layer was corrupted is still
    reported (all its blocks) when vLLM asks after the forward, the other page is loaded."""
    w, kv = worker
    keys, original = saved_pages(w, kv)
    tier = w.pool.tiers[0]
    ref = tier.find(keys[1])
    assert ref is not None
    tier.segment_view(ref, LAYERS - 1)[5] ^= 1                       # one flipped bit, last layer
    load = LoadJob("r2", keys, w.pool.lookup(keys).sources, [[10, 11], [12, 13]])
    assert step(w, kv, PoFConnectorMetadata(loads=[load])) == {12, 13}
    for name in kv:
        assert torch.equal(kv[name][10:12], original[name][3:5])


def test_layers_the_engine_never_waits_for_are_loaded_but_recomputed(worker: Any) -> None:
    """The forward did not wait for the layers (a full CUDA graph replay skips the hook): it may
    have read the blocks before the copy, so the step's loads are reported for recompute; the
    blocks are filled all the same before the step ends (nothing writes into them later)."""
    w, kv = worker
    keys, original = saved_pages(w, kv)
    w.start(PoFConnectorMetadata(loads=[LoadJob("r2", keys, w.pool.lookup(keys).sources, [[10, 11], [12, 13]])]))
    w.end_step()                                                       # no wait_layer at all
    assert w.take_load_errors() == {10, 11, 12, 13}
    assert w.pool.stats.get("skipped_hooks", hook="wait_for_layer_load") == 1
    for name in kv:
        assert torch.equal(kv[name][12:14], original[name][7:9])
