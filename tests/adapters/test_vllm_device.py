"""The GPU path's ordering on CPU tensors: the worker on vLLM's views (a GPU backend's K|V per
token), with pof's streams replaced by lanes that run the work at once but take the GPU branch
(checks after the step, events) and log every ordering call. What a GPU adds (the DMA, the
engine's own stream, the Triton kernel) is test_vllm_gpu_harness.py's, on ``cuda:0``."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")       # the torch stage runs these; the core venv has no torch


from pof_connector.adapters.vllm_device import Lane  # noqa: E402
from pof_connector.adapters.vllm_geometry import VllmGeometry  # noqa: E402
from pof_connector.adapters.vllm_metadata import LoadJob, PoFConnectorMetadata, SaveJob  # noqa: E402
from pof_connector.adapters.vllm_views import engine_views  # noqa: E402
from pof_connector.adapters.vllm_worker import PoFWorker  # noqa: E402
from pof_connector.config import PofConfig  # noqa: E402

pytestmark = pytest.mark.torch

LAYERS, BLOCKS, HEADS, TOKENS, DIM = 3, 12, 2, 16, 8


class Event:
    def __init__(self, log: list[tuple[str, ...]], name: str) -> None:
        self.log, self.name = log, name

    def synchronize(self) -> None:
        self.log.append(("host", "waits", self.name, threading.current_thread().name))


class RecordingLane(Lane):
    """A CUDA stream's stand-in: work runs when queued, the worker takes its GPU branch
    (``stream`` set), and each ordering call is logged."""

    def __init__(self, log: list[tuple[str, ...]], name: str) -> None:
        super().__init__(torch.device("cpu"))
        self.stream = object()
        self.log, self.name, self.marks = log, name, 0

    @contextlib.contextmanager
    def queue(self) -> Iterator[None]:
        yield

    def after_engine(self) -> None:
        self.log.append((self.name, "after_engine"))

    def mark(self) -> Any:
        self.marks += 1
        event = Event(self.log, f"{self.name}{self.marks}")
        self.log.append((self.name, "mark", event.name))
        return event

    def engine_waits(self, event: Any) -> None:
        if event is not None:
            self.log.append(("engine", "waits", event.name))

    def drain(self) -> None:
        self.log.append((self.name, "drain"))


@pytest.fixture
def worker(runtime_dir: str) -> Iterator[tuple[PoFWorker, dict[str, torch.Tensor], list[tuple[str, ...]]]]:
    views = engine_views("LBNHC", layers=LAYERS, blocks=BLOCKS, heads=HEADS, tokens=TOKENS, content=2 * DIM,
                         dtype=torch.bfloat16)
    kv = {f"model.layers.{i}.self_attn.attn": v for i, v in enumerate(views)}
    geo = VllmGeometry(model="m", kv_dtype="bfloat16", kv_heads=HEADS, head_dim=DIM, num_layers=LAYERS, is_mla=False,
                       block_size=TOKENS, page_tokens=2 * TOKENS, tp_size=1)
    cfg = PofConfig.from_mapping({"node_id": "d", "index_url": "local", "runtime_dir": runtime_dir,
                                  "tiers": {"cpu_dram": {"size": "4MiB"}}})
    w = PoFWorker(cfg, geo, tp_rank=0, overlap=False, cpu_attention=False)
    w.register(kv, layout="LBNHC")
    log: list[tuple[str, ...]] = []
    w._load_lane, w._save_lane = RecordingLane(log, "load"), RecordingLane(log, "save")
    for v in views:
        v.copy_(torch.randn(v.shape))
    yield w, kv, log
    w.close()


def store_two_pages(w: PoFWorker, names: list[str]) -> list[Any]:
    """Two pages saved from blocks 1-4 and stored; their keys."""
    keys = w.pool.keys_for(list(range(4 * TOKENS)))
    w.prepare_saves(PoFConnectorMetadata(saves=[SaveJob("s", keys, [[1, 2], [3, 4]])]))
    for name in names:
        w.save_layer(name)
    w.end_step()
    w.pool.flush()
    return keys


def test_saves_wait_for_the_engine_and_the_store_waits_for_the_copies(worker: Any) -> None:
    """Each layer's gather waits for the engine's stream (attention wrote the layer); at the end
    of the step the engine's stream waits for the last gather (the blocks may be reused next step)
    and the pool's store thread, not the forward's, waits for the copies before reading them."""
    w, kv, log = worker
    keys = w.pool.keys_for(list(range(4 * TOKENS)))
    w.prepare_saves(PoFConnectorMetadata(saves=[SaveJob("s", keys, [[1, 2], [3, 4]])]))
    for n, name in enumerate(kv):
        w.save_layer(name)
        assert log[-2:] == [("save", "after_engine"), ("save", "mark", f"save{n + 1}")]
    w.end_step()
    w.pool.flush()
    assert log[LAYERS * 2] == ("engine", "waits", f"save{LAYERS}")         # the last gather
    assert log[LAYERS * 2 + 1] == ("save", "mark", f"save{LAYERS + 1}")     # after the copies
    store_waits = [e for e in log if e[:2] == ("host", "waits")]
    assert store_waits and all(e[2] == f"save{LAYERS + 1}" and e[3] != threading.current_thread().name
                               for e in store_waits)
    assert w.pool.lookup(keys).pages == 2


def test_loads_are_ordered_by_events_and_checked_once_the_stream_drained(worker: Any) -> None:
    """A load waits for the engine's queued work before it writes a block; the engine's stream
    waits for each layer's event before attention reads it (no host wait); the landed sums are
    checked after pof's stream drained, once a step: a page corrupted at its last layer is
    reported then, the other lands byte-exact."""
    w, kv, log = worker
    names = list(kv)
    keys = store_two_pages(w, names)
    original = {name: t.clone() for name, t in kv.items()}
    tier = w.pool.tiers[0]
    ref = tier.find(keys[1])
    assert ref is not None
    tier.segment_view(ref, LAYERS - 1)[7] ^= 4
    log.clear()
    w.start(PoFConnectorMetadata(loads=[LoadJob("l", keys, w.pool.lookup(keys).sources, [[5, 6], [7, 8]])]))
    assert log == [("load", "after_engine")]            # before any copy is queued
    for n, name in enumerate(names):
        w.wait_layer(name)
        assert log[-2:] == [("load", "mark", f"load{n + 1}"), ("engine", "waits", f"load{n + 1}")]
    assert not w._loads[0].reader.failed               # nothing checked yet: the sums are on the device
    w.end_step()
    assert log[-1] == ("load", "drain") and sum(e == ("load", "drain") for e in log) == 1
    assert w.take_load_errors() == {7, 8}
    for name in names:
        assert torch.equal(kv[name][5:7].view(torch.uint8), original[name][1:3].view(torch.uint8))


@pytest.mark.parametrize("group", [1, 2])
def test_layers_copied_in_groups_land_byte_exact(worker: Any, monkeypatch: pytest.MonkeyPatch, group: int) -> None:
    """A page's layers are copied a group at a time (adjacent in its slot: one DMA each); with 3
    layers in groups of 1 or 2, every layer of every page lands where it belongs, and a page
    corrupted in its second group is still caught."""
    from pof_connector.adapters import vllm_device

    w, kv, _ = worker
    names = list(kv)
    keys = store_two_pages(w, names)
    original = {name: t.clone() for name, t in kv.items()}
    monkeypatch.setattr(vllm_device, "COPY_BYTES", group * w.pool.spec.segment_bytes)
    tier = w.pool.tiers[0]
    ref = tier.find(keys[0])
    assert ref is not None
    tier.segment_view(ref, LAYERS - 1)[3] ^= 1
    w.start(PoFConnectorMetadata(loads=[LoadJob("l", keys, w.pool.lookup(keys).sources, [[5, 6], [7, 8]])]))
    assert w._strided is not None and w._strided.group == group
    for name in names:
        w.wait_layer(name)
    w.end_step()
    assert w.take_load_errors() == {5, 6}
    for name in names:
        assert torch.equal(kv[name][7:9].view(torch.uint8), original[name][3:5].view(torch.uint8))
