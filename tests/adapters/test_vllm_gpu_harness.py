"""The vLLM worker's GPU path, with vLLM stood in for only where it cannot run (vLLM cannot be
installed on the GPU check's host: it has no network).

Real: the :class:`PoFWorker`, its pool and DRAM tier, the KV tensors (one allocation viewed per
layer exactly as ``create_kv_cache_views`` views it for each ``KVCacheLayout``:
:func:`engine_views`, checked against vLLM's own code in test_vllm_views.py), the CUDA streams and
events, the Triton checksum. Stood in for: the engine, a stream of its own that is the thread's
current stream during the forward (as ``vllm.utils.torch_utils.current_stream`` makes it), the
connector's hook order per step, and attention (kernels on that stream that read or write a
layer's blocks). A full CUDA graph replay is a step whose per-layer hooks do not run.

Every test runs on ``cpu`` (CI: layouts, planning, refusal, the graph rule) and on each CUDA
device (``ci/gpu_check.sh``, marked ``gpu``). The ordering tests need a GPU: a
``torch.cuda._sleep`` queued on one stream makes an unordered read observable, and each has a
control that shows the race the ordering prevents."""

from __future__ import annotations

import contextlib
import importlib.util
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pof_connector.adapters.vllm_device import Lane, StepLoads  # noqa: E402
from pof_connector.adapters.vllm_geometry import VllmGeometry  # noqa: E402
from pof_connector.adapters.vllm_layout import LayoutError  # noqa: E402
from pof_connector.adapters.vllm_metadata import LoadJob, PoFConnectorMetadata, SaveJob  # noqa: E402
from pof_connector.adapters.vllm_views import KV_CACHE_LAYOUTS, engine_views  # noqa: E402
from pof_connector.adapters.vllm_worker import PoFWorker  # noqa: E402
from pof_connector.config import PofConfig  # noqa: E402
from pof_connector.pages import page_sum  # noqa: E402

pytestmark = pytest.mark.torch

CUDA = [pytest.param(f"cuda:{i}", marks=pytest.mark.gpu) for i in range(torch.cuda.device_count())]
DEVICES = ["cpu", *CUDA]
LAYERS, BLOCKS, HEADS, TOKENS, DIM, LATENT = 3, 12, 2, 16, 64, 96
SLEEP = 100_000_000         # GPU cycles (~50 ms): long enough that an unordered read sees the old bytes


class Engine:
    """vLLM where it cannot run: the KV cache of one layout, the forward's stream, the hook order."""

    def __init__(self, device: str, layout: str = "LBNHC", mla: bool = False, dtype: Any = None,
                 kernel_tokens: int | None = None, layers: int = LAYERS) -> None:
        self.device = torch.device(device)
        self.dtype = dtype or torch.bfloat16
        self.mla = mla
        self.views = engine_views(layout, layers=layers, blocks=BLOCKS, heads=1 if mla else HEADS, tokens=TOKENS,
                                  content=LATENT if mla else 2 * DIM, dtype=self.dtype, device=self.device,
                                  kernel_tokens=kernel_tokens)
        self.kv = {f"model.layers.{i}.self_attn.attn": v for i, v in enumerate(self.views)}
        self.raw = torch.tensor([], dtype=torch.int8, device=self.device).set_(self.views[0].untyped_storage())
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.layout = layout

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """The forward's stream is the thread's current one (CPU: nothing to set)."""
        if self.stream is None:
            yield
        else:
            with torch.cuda.stream(self.stream):
                yield

    def fill(self, seed: int = 0) -> None:
        """Random bytes in the whole cache, written on the forward's stream (as attention writes)."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        with self.forward():
            self.raw.copy_(torch.randint(-128, 128, self.raw.shape, dtype=torch.int8, device=self.device,
                                         generator=g))

    def step(self, worker: PoFWorker, meta: PoFConnectorMetadata, *, graph: bool = False,
             attend: Callable[[int], None] | None = None) -> set[int]:
        """One step as vLLM drives the connector; ``graph``: a full CUDA graph replay (no per-layer
        hook runs); ``attend(layer)``: attention's kernels on the forward's stream."""
        with self.forward():
            worker.prepare_saves(meta)
            worker.start(meta)
            for layer, name in enumerate(self.kv):
                if not graph:
                    worker.wait_layer(name)
                if attend is not None:
                    attend(layer)
                if not graph:
                    worker.save_layer(name)
            worker.end_step()
        if self.stream is not None:
            self.stream.synchronize()
        return worker.take_load_errors()

    def worker(self, runtime_dir: str, size: str = "8MiB", tiers: dict[str, Any] | None = None) -> PoFWorker:
        geo = VllmGeometry(model="m", kv_dtype=str(self.dtype).removeprefix("torch."),
                           kv_heads=1 if self.mla else HEADS, head_dim=LATENT if self.mla else DIM,
                           num_layers=len(self.kv), is_mla=self.mla, block_size=TOKENS, page_tokens=2 * TOKENS,
                           tp_size=1)
        cfg = PofConfig.from_mapping({"node_id": "h", "index_url": "local", "runtime_dir": runtime_dir,
                                      "tiers": tiers or {"cpu_dram": {"size": size}}})
        w = PoFWorker(cfg, geo, tp_rank=0, cpu_attention=False)
        w.register(self.kv, layout=self.layout)
        return w


@pytest.fixture
def workers(runtime_dir: str) -> Iterator[Callable[..., tuple[Engine, PoFWorker]]]:
    made: list[PoFWorker] = []

    def make(device: str, tiers: dict[str, Any] | None = None, **kw: Any) -> tuple[Engine, PoFWorker]:
        engine = Engine(device, **kw)
        w = engine.worker(runtime_dir, tiers=tiers)
        made.append(w)
        return engine, w

    yield make
    for w in made:
        w.close()


def saved(engine: Engine, w: PoFWorker) -> tuple[list[Any], torch.Tensor]:
    """Two pages of two blocks saved from blocks 1-4 (random bytes); their keys and the raw cache."""
    engine.fill()
    keys = w.pool.keys_for(list(range(4 * TOKENS)))
    assert engine.step(w, PoFConnectorMetadata(saves=[SaveJob("s", keys, [[1, 2], [3, 4]])])) == set()
    w.pool.flush()
    assert w.pool.lookup(keys).pages == 2
    return keys, engine.raw.clone()


def expected_after_load(engine: Engine, before: torch.Tensor, kernel_blocks: int) -> torch.Tensor:
    """``before`` with blocks 5-8 of every layer holding blocks 1-4 (torch's own strided copy)."""
    views = engine_views(engine.layout, layers=len(engine.kv), blocks=BLOCKS, heads=1 if engine.mla else HEADS,
                         tokens=TOKENS, content=LATENT if engine.mla else 2 * DIM, dtype=engine.dtype,
                         device=engine.device, kernel_tokens=TOKENS // kernel_blocks if kernel_blocks > 1 else None)
    raw = torch.tensor([], dtype=torch.int8, device=engine.device).set_(views[0].untyped_storage())
    raw.copy_(before)
    for v in views:
        grouped = v.unflatten(0, (-1, kernel_blocks))
        grouped[[5, 6, 7, 8]] = grouped[[1, 2, 3, 4]].clone()
    return raw


def splits(layout: str, mla: bool) -> list[int | None]:
    dense = layout in ("LBHNC", "LBNHC") or (mla and layout == "LHBNC")
    return [None, TOKENS // 2] if dense else [None]


LAYOUT_CASES = [(name, mla, dtype, kt) for name in KV_CACHE_LAYOUTS for mla in (False, True)
                for dtype in ("bfloat16", "float16", "float32") for kt in splits(name, mla)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("layout", "mla", "dtype", "kernel_tokens"), LAYOUT_CASES,
                         ids=[f"{n}-{'mla' if m else 'mha'}-{d}-k{k or TOKENS}" for n, m, d, k in LAYOUT_CASES])
def test_every_layout_round_trips_byte_exact(workers: Any, device: str, layout: str, mla: bool, dtype: str,
                                             kernel_tokens: int | None) -> None:
    """Saved from blocks 1-4, loaded into 5-8: every layer's blocks hold the saved bytes, and not
    a byte of the allocation changed elsewhere (the null block 0, the other blocks and layers)."""
    engine, w = workers(device, layout=layout, mla=mla, dtype=getattr(torch, dtype), kernel_tokens=kernel_tokens)
    keys, before = saved(engine, w)
    assert w.layout is not None
    load = LoadJob("l", keys, w.pool.lookup(keys).sources, [[5, 6], [7, 8]])
    assert engine.step(w, PoFConnectorMetadata(loads=[load])) == set()
    assert torch.equal(engine.raw, expected_after_load(engine, before, w.layout.kernel_blocks))
    if engine.device.type == "cuda" and importlib.util.find_spec("triton"):
        assert page_sum._triton_state == "ok"        # the landed pages were summed on the device by Triton


def tiers_of(medium: str, device: str, runtime_dir: str = "") -> dict[str, Any]:
    """One tier of ``medium``: host DRAM, or a peer GPU region on the engine's own device (a
    ``cpu`` region in CI: the same device-to-device code path, on CPU tensors)."""
    if medium == "peer_hbm":
        return {"peer_hbm": {"size": "8MiB", "device": device}}
    return {"cpu_dram": {"size": "8MiB"}}


@pytest.mark.parametrize("medium", ["cpu_dram", "peer_hbm"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_corrupted_page_is_refused_and_never_reaches_the_blocks(workers: Any, device: str, medium: str) -> None:
    """One bit of one page's last layer flipped in the tier: that page's blocks are reported for
    recompute after the forward, and its corrupted layer never reached them: they hold exactly what
    they held before (its earlier layers, which checked good, landed). The other page lands
    byte-exact. A peer GPU region is read device to device (no host copy in between)."""
    engine, w = workers(device, tiers=tiers_of(medium, device))
    keys, before = saved(engine, w)
    tier = w.pool.tiers[0]
    assert tier.medium == medium
    ref = tier.find(keys[1])
    assert ref is not None
    reader = w.pool.open_read(keys, w.pool.lookup(keys).sources)
    sources = [type(seg) for _, seg in reader.segments(0, engine.device)]
    reader.close()
    assert sources == [torch.Tensor if medium == "peer_hbm" else np.ndarray] * 2
    if medium == "peer_hbm":
        tier.device_view(ref, LAYERS - 1, engine.device)[100] ^= 8
    else:
        tier.segment_view(ref, LAYERS - 1)[100] ^= 8
    load = LoadJob("l", keys, w.pool.lookup(keys).sources, [[5, 6], [7, 8]])
    assert engine.step(w, PoFConnectorMetadata(loads=[load])) == {7, 8}
    loaded = engine_views_like(engine, expected_after_load(engine, before, 1))
    untouched = engine_views_like(engine, before)
    for layer, (view, want, old) in enumerate(zip(engine.views, loaded, untouched, strict=True)):
        assert torch.equal(as_bytes(view[5:7]), as_bytes(want[5:7]))                # the good page
        assert torch.equal(as_bytes(view[7:9]), as_bytes((old if layer == LAYERS - 1 else want)[7:9]))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("device", DEVICES)
def test_tier_memory_is_page_locked_for_a_gpu_engine(workers: Any, device: str, tmp_path: Any) -> None:
    """A GPU engine page-locks the tiers' host memory (a CXL mapping here) so its loads are DMAs;
    a CPU engine locks nothing. Pages load byte-exact from the locked mapping."""
    tiers = {"cxl": {"size": "8MiB", "path": str(tmp_path / "cxl")}}
    engine, w = workers(device, tiers=tiers)
    cxl = w.pool.tiers[0]
    assert cxl.medium == "cxl"
    if engine.device.type == "cuda":
        assert (cxl.region.ctypes.data, cxl.region.nbytes) in w._pins.pinned
        # Registering it again is refused as registered already: the driver holds it page-locked.
        assert int(torch.cuda.cudart().cudaHostRegister(cxl.region.ctypes.data, cxl.region.nbytes, 0)) == 712
    else:
        assert w._pins.pinned == []
    keys, before = saved(engine, w)
    load = LoadJob("l", keys, w.pool.lookup(keys).sources, [[5, 6], [7, 8]])
    assert engine.step(w, PoFConnectorMetadata(loads=[load])) == set()
    assert torch.equal(engine.raw, expected_after_load(engine, before, 1))


def engine_views_like(engine: Engine, raw: torch.Tensor) -> list[torch.Tensor]:
    views = engine_views(engine.layout, layers=len(engine.kv), blocks=BLOCKS, heads=HEADS, tokens=TOKENS,
                         content=2 * DIM, dtype=engine.dtype, device=engine.device)
    torch.tensor([], dtype=torch.int8, device=engine.device).set_(views[0].untyped_storage()).copy_(raw)
    return views


@pytest.mark.parametrize("device", DEVICES)
def test_an_unknown_layout_is_refused_at_registration(runtime_dir: str, device: str) -> None:
    engine = Engine(device)
    bad = {name: v.transpose(1, 2) for name, v in engine.kv.items()}      # [B, N, H, C]: H and N swapped
    engine.kv = bad
    with pytest.raises(LayoutError, match="VLLM_KV_CACHE_LAYOUT"):
        engine.worker(runtime_dir)


@pytest.mark.parametrize("device", DEVICES)
def test_a_full_graph_step_stores_nothing_and_recomputes_its_loads(workers: Any, device: str) -> None:
    """A full CUDA graph replay runs no per-layer hook: the step's saves would come from staging
    the forward never filled, its loads were read unordered. Nothing is stored, every load is
    reported; the next eager step stores and loads."""
    engine, w = workers(device)
    engine.fill()
    keys = w.pool.keys_for(list(range(4 * TOKENS)))
    assert engine.step(w, PoFConnectorMetadata(saves=[SaveJob("s", keys, [[1, 2], [3, 4]])]), graph=True) == set()
    w.pool.flush()
    assert w.pool.lookup(keys).pages == 0
    assert w.pool.stats.get("skipped_hooks", hook="save_kv_layer") == 1
    keys, _ = saved(engine, w)
    load = LoadJob("l", keys, w.pool.lookup(keys).sources, [[5, 6], [7, 8]])
    assert engine.step(w, PoFConnectorMetadata(loads=[load]), graph=True) == {5, 6, 7, 8}
    assert engine.step(w, PoFConnectorMetadata(loads=[load])) == set()


# ---- ordering on a GPU: each with the control that shows the race ------------------------------------


def warm(engine: Engine, w: PoFWorker, keys: list[Any]) -> None:
    """One load before the observed one: Triton's kernel is built and the pages' seed tables are
    on the device (their first use waits for pof's stream), so only the sleep decides the timing."""
    load = LoadJob("warm", keys, w.pool.lookup(keys).sources, [[5, 6], [7, 8]])
    assert engine.step(w, PoFConnectorMetadata(loads=[load])) == set()


@contextlib.contextmanager
def slow_load_lane(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every layer's copies on pof's load stream start only after a long sleep on that stream."""
    original = StepLoads.copy_layer

    def copy_layer(self: StepLoads, layer: int, segments: Any) -> None:
        with self.lane.queue():
            torch.cuda._sleep(SLEEP)
        original(self, layer, segments)

    monkeypatch.setattr(StepLoads, "copy_layer", copy_layer)
    yield


@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "control-unordered"])
@pytest.mark.parametrize("device", CUDA)
def test_attention_reads_a_layer_only_after_its_copy_landed(workers: Any, monkeypatch: pytest.MonkeyPatch,
                                                            device: str, ordered: bool) -> None:
    """pof's copies are slow (a sleep queued before them on pof's stream); attention reads each
    layer's blocks on the engine's stream right after ``wait_for_layer_load``. Ordered by the
    layer's event, it reads the page; the control (no event wait) reads the old bytes, so this test
    sees an unordered read. The engine's thread does not wait for the copy: the first wait returns
    while pof's stream is still asleep."""
    engine, w = workers(device)
    keys, before = saved(engine, w)
    warm(engine, w, keys)
    with engine.forward():
        for v in engine.views:
            v[5:9].zero_()
    if not ordered:
        monkeypatch.setattr(StepLoads, "ready", lambda self, layer: None)
    seen: list[torch.Tensor] = []
    returned_early: list[bool] = []
    load = LoadJob("l", keys, w.pool.lookup(keys).sources, [[5, 6], [7, 8]])
    with slow_load_lane(monkeypatch):
        def attend(layer: int) -> None:
            if layer == 0 and w._strided is not None and w._strided.events[0] is not None:
                returned_early.append(not w._strided.events[0].query())
            seen.append(engine.views[layer][5:9].clone())            # queued on the engine's stream
        assert engine.step(w, PoFConnectorMetadata(loads=[load]), attend=attend) == set()
    want = [v[1:5] for v in engine_views_like(engine, before)]
    same = [torch.equal(a.view(torch.uint8), b.contiguous().view(torch.uint8)) for a, b in zip(seen, want, strict=True)]
    if ordered:
        assert all(same) and returned_early == [True]
    else:
        assert not any(same), "the control read the page: the sleep did not make the race observable"


@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "control-unordered"])
@pytest.mark.parametrize("device", CUDA)
def test_a_load_lands_after_what_the_engine_queued_before_it(workers: Any, monkeypatch: pytest.MonkeyPatch,
                                                             device: str, ordered: bool) -> None:
    """The engine's stream still runs the previous step (a sleep, then a write into the blocks
    being loaded now). The load waits for it: the blocks end up holding the page. The control (pof's
    stream not waiting) lands first and is overwritten."""
    engine, w = workers(device)
    keys, before = saved(engine, w)
    warm(engine, w, keys)
    if not ordered:
        monkeypatch.setattr(Lane, "after_engine", lambda self: None)
    load = LoadJob("l", keys, w.pool.lookup(keys).sources, [[5, 6], [7, 8]])
    with engine.forward():
        torch.cuda._sleep(SLEEP)
        for v in engine.views:
            v[5:9].fill_(3.0)                                      # the previous step, still running
    assert engine.step(w, PoFConnectorMetadata(loads=[load])) == set()
    landed = all(torch.equal(v[5:9].contiguous().view(torch.uint8), want[1:5].contiguous().view(torch.uint8))
                 for v, want in zip(engine.views, engine_views_like(engine, before), strict=True))
    assert landed is ordered


@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "control-unordered"])
@pytest.mark.parametrize("device", CUDA)
def test_a_save_gathers_what_attention_wrote(workers: Any, monkeypatch: pytest.MonkeyPatch, device: str,
                                             ordered: bool) -> None:
    """Attention writes the new pages' KV late (a sleep on the engine's stream first); the save of
    each layer waits for it and stores what attention wrote. The control stores the old bytes."""
    engine, w = workers(device)
    engine.fill()
    if not ordered:
        monkeypatch.setattr(Lane, "after_engine", lambda self: None)
    keys = w.pool.keys_for(list(range(4 * TOKENS)))

    def attend(layer: int) -> None:
        torch.cuda._sleep(SLEEP // 4)
        engine.views[layer][1:5].fill_(float(layer + 2))           # the new tokens' K and V

    t0 = time.perf_counter()
    assert engine.step(w, PoFConnectorMetadata(saves=[SaveJob("s", keys, [[1, 2], [3, 4]])]), attend=attend) == set()
    assert time.perf_counter() - t0 < 30
    w.pool.flush()
    with engine.forward():
        for v in engine.views:
            v.zero_()
    load = LoadJob("l", keys, w.pool.lookup(keys).sources, [[5, 6], [7, 8]])
    assert engine.step(w, PoFConnectorMetadata(loads=[load])) == set()
    stored = all(bool((v[5:9] == float(layer + 2)).all()) for layer, v in enumerate(engine.views))
    assert stored is ordered
