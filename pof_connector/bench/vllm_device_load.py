"""The vLLM worker's GPU path alone: ``python -m pof_connector.bench.vllm_load --device cuda --json``.

No server (vLLM cannot be installed where this runs): a real
:class:`~pof_connector.adapters.vllm_worker.PoFWorker` with a CPU DRAM tier (page-locked, as on a
GPU host) on KV views laid out as vLLM 0.32 lays them out (``engine_views``: one allocation, the
``KVCacheLayout`` given, 32 layers of 8 KV heads of 128 in bf16 by default, 16-token blocks and
pages), driven as vLLM drives it, with the forward on a stream of its own. Per page count:

* **save**: the step's pages gathered from the blocks and copied device-to-host into page-locked
  staging (``save_s``: from the step's first hook until those copies are done), against one raw
  device-to-page-locked copy of the same bytes in the same run (``save_ratio = raw / save``); then
  the pool's store thread writes them into tier slots (``store_s``, host work, reported apart);
* **load**: every layer of every page copied into the blocks, gathered back and summed on the
  device, checked once (``load_s``: ``start`` to the end of the step), against one raw
  page-locked-to-device copy of the same bytes (``load_ratio = raw / load``); every landed byte is
  compared with the saved blocks (``landed_equal``);
* **the engine's wait**: the same load under a forward that computes ``--layer-us`` per layer
  (``torch.cuda._sleep``), minus that forward alone, on the engine's stream (``engine_wait_s``);
* **a corrupted page** (one bit of its last layer flipped in the tier): reported for recompute,
  the other pages byte-exact (``corrupt_refused``), and its corrupted layer never written into
  its block (``corrupt_blocks_untouched``).

``--tier peer_hbm`` loads from a peer-HBM region on the engine's own GPU instead of page-locked
DRAM: device to device, so ``load_ratio`` is then against a raw device-to-device copy
(``raw_d2d_s``); saves still go to the engine's page-locked staging, then the store thread copies
them into the region.

``--device cpu`` runs the same steps on CPU tensors (no stream: the figures are not the point;
CI checks that the steps run and the bytes are right).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any

GOALS = {"load_ratio": 0.8, "save_ratio": 0.7}


def run(*, device: str = "cuda", pages: tuple[int, ...] = (32, 128, 512), layers: int = 32, kv_heads: int = 8,
        head_dim: int = 128, block_tokens: int = 16, dtype: str = "bfloat16", layout: str = "LBNHC",
        repeat: int = 3, layer_us: float = 100.0, tier: str = "cpu_dram") -> dict[str, Any]:
    import torch

    from pof_connector.adapters.vllm_geometry import VllmGeometry
    from pof_connector.adapters.vllm_views import engine_views
    from pof_connector.adapters.vllm_worker import PoFWorker
    from pof_connector.config import PofConfig
    from pof_connector.pages import page_sum
    from pof_connector.pages.layout import PageSpec

    dev = torch.device(device)
    dt = getattr(torch, dtype)
    most = max(pages)
    views = engine_views(layout, layers=layers, blocks=2 * most + 2, heads=kv_heads, tokens=block_tokens,
                         content=2 * head_dim, dtype=dt, device=dev)
    kv = {f"model.layers.{i}.self_attn.attn": v for i, v in enumerate(views)}
    geo = VllmGeometry(model="bench", kv_dtype=dtype, kv_heads=kv_heads, head_dim=head_dim, num_layers=layers,
                       is_mla=False, block_size=block_tokens, page_tokens=block_tokens, tp_size=1)
    spec: PageSpec = geo.spec
    slots = 2 * most + 8
    with tempfile.TemporaryDirectory(prefix="pof-bench-vllm-device-") as rt:
        size = str(slots * (spec.page_bytes + 4096))
        tiers: dict[str, Any] = ({"peer_hbm": {"size": size, "device": str(dev), "partitions": 1}}
                                 if tier == "peer_hbm" else {"cpu_dram": {"size": size}})
        cfg = PofConfig.from_mapping({"node_id": "bench", "index_url": "local", "runtime_dir": rt, "tiers": tiers})
        worker = PoFWorker(cfg, geo, tp_rank=0, cpu_attention=False)
        worker.register(kv, layout=layout)
        try:
            bench = _Bench(worker, views, dev, layer_us, tier)
            rows = [bench.row(n, repeat) for n in pages]
        finally:
            worker.close()
    assert worker.layout is not None
    return {
        "bench": "vllm_load_device", "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "tier": tier, "layout": layout, "dtype": dtype, "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
        "page_tokens": block_tokens, "page_bytes": spec.page_bytes, "kv_bytes_per_page": layers * spec.segment_bytes,
        "checksum": f"triton ({page_sum._triton_state})" if dev.type == "cuda" else "native",
        "overlap_thread": worker.overlap, "rows": rows, "goals": GOALS,
        "baseline": "raw_h2d_s: one page-locked->device copy of the pages' KV bytes, raw_d2h_s: one "
                    "device->page-locked copy, raw_d2d_s: one device->device copy, same run; load_ratio = "
                    "raw_h2d_s / load_s (peer_hbm tier: raw_d2d_s / load_s), save_ratio = raw_d2h_s / save_s "
                    "(best of repeats each); engine_wait_s: "
                    "the engine stream's time for a load under a forward of layer_us per layer, minus that "
                    "forward alone",
        "not_measured": ["save straight into a page-locked tier slot: saves land in page-locked staging, "
                         "the store thread copies them into the tier (store_s)"],
    }


class _Bench:
    def __init__(self, worker: Any, views: list[Any], device: Any, layer_us: float, tier: str) -> None:
        import torch

        self.baseline = "d2d" if tier == "peer_hbm" else "h2d"
        self.torch, self.worker, self.views, self.device = torch, worker, views, device
        self.names = list(worker.layer_index)
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.raw = torch.tensor([], dtype=torch.int8, device=device).set_(views[0].untyped_storage())
        self.kv_page = worker.pool.spec.num_layers * worker.pool.spec.segment_bytes
        self.offset = 0
        self.cycles = self._calibrate(layer_us) if self.cuda else 0

    def _calibrate(self, layer_us: float) -> int:
        """GPU cycles ``torch.cuda._sleep`` needs for ``layer_us`` microseconds here."""
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record()
            torch.cuda._sleep(10_000_000)
            end.record()
        end.synchronize()
        return max(1, int(10_000_000 * layer_us / (start.elapsed_time(end) * 1000)))

    def _sync(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def _forward(self) -> Any:
        return self.torch.cuda.stream(self.stream) if self.stream is not None else _Nothing()

    def _keys(self, n: int) -> list[Any]:
        tokens = list(range(self.offset, self.offset + n * self.worker.geo.page_tokens))
        self.offset += len(tokens)
        keys: list[Any] = self.worker.pool.keys_for(tokens)
        return keys

    def row(self, n: int, repeat: int) -> dict[str, Any]:
        from pof_connector.adapters.vllm_metadata import LoadJob, PoFConnectorMetadata, SaveJob

        torch, w = self.torch, self.worker
        save_s, store_s, load_s = [], [], []
        equal = True
        keys: list[Any] = []
        for _ in range(repeat):
            with self._forward():
                self.raw.copy_(torch.randint(-128, 128, self.raw.shape, dtype=torch.int8, device=self.device))
            self._sync()
            keys = self._keys(n)
            t0 = time.perf_counter()
            with self._forward():
                w.prepare_saves(PoFConnectorMetadata(saves=[SaveJob("s", keys, [[1 + i] for i in range(n)])]))
                w.start(PoFConnectorMetadata())
                for name in self.names:
                    w.save_layer(name)
                w.end_step()
            w._save_lane.drain()              # the device-to-host copies are done
            save_s.append(time.perf_counter() - t0)
            t1 = time.perf_counter()
            w.pool.flush()
            store_s.append(time.perf_counter() - t1)
            sources = w.pool.lookup(keys, count=False).sources
            if len(sources) != n:
                raise RuntimeError(f"bench: {len(sources)} of {n} pages stored")
            load_s.append(self._load(LoadJob("l", keys, sources, [[n + 1 + i] for i in range(n)]), n))
            equal = equal and self._landed(n)
        wait, forward = self._engine_wait(LoadJob("l", keys, w.pool.lookup(keys, count=False).sources,
                                                  [[n + 1 + i] for i in range(n)]), n)
        refused = self._corrupt(keys, n)
        raw = self._raw(n, repeat)
        nbytes = n * self.kv_page
        best = {"save": min(save_s), "store": min(store_s), "load": min(load_s)}
        return {
            "pages": n, "bytes": nbytes,
            "load_s": round(best["load"], 6), "load_gbps": round(nbytes / best["load"] / 1e9, 2),
            "raw_h2d_s": round(raw["h2d"], 6), "raw_h2d_gbps": round(nbytes / raw["h2d"] / 1e9, 2),
            "load_ratio": round(raw[self.baseline] / best["load"], 3), "load_baseline": f"raw_{self.baseline}_s",
            "save_s": round(best["save"], 6), "save_gbps": round(nbytes / best["save"] / 1e9, 2),
            "raw_d2h_s": round(raw["d2h"], 6), "raw_d2h_gbps": round(nbytes / raw["d2h"] / 1e9, 2),
            "save_ratio": round(raw["d2h"] / best["save"], 3),
            "raw_d2d_s": round(raw["d2d"], 6), "store_s": round(best["store"], 6),
            "engine_wait_s": None if wait is None else round(wait, 6),
            "forward_s": None if forward is None else round(forward, 6),
            "landed_equal": equal, "corrupt_refused": refused[0], "corrupt_blocks_untouched": refused[1],
        }

    def _load(self, job: Any, n: int, attend: Any = None, forward_queued: Any = None, zero: bool = True) -> float:
        """Seconds for one step that loads ``job`` (``zero``: its blocks zeroed first);
        ``attend(layer)``: the forward's work per layer; ``forward_queued()``: called once the
        forward is queued, before the step's end."""
        from pof_connector.adapters.vllm_metadata import PoFConnectorMetadata

        if zero:
            self._zero(n)
        w = self.worker
        t0 = time.perf_counter()
        with self._forward():
            w.prepare_saves(PoFConnectorMetadata())
            w.start(PoFConnectorMetadata(loads=[job]))
            for layer, name in enumerate(self.names):
                w.wait_layer(name)
                if attend is not None:
                    attend(layer)
                w.save_layer(name)
            if forward_queued is not None:
                forward_queued()
            w.end_step()
        self._sync()
        elapsed = time.perf_counter() - t0
        errors = w.take_load_errors()
        if errors:
            raise RuntimeError(f"bench: a load failed ({len(errors)} blocks)")
        return elapsed

    def _zero(self, n: int) -> None:
        with self._forward():
            for v in self.views:
                v[n + 1:2 * n + 1].zero_()
        self._sync()

    def _landed(self, n: int) -> bool:
        torch = self.torch
        return all(torch.equal(v[n + 1:2 * n + 1].contiguous().view(torch.uint8),
                               v[1:n + 1].contiguous().view(torch.uint8)) for v in self.views)

    def _engine_wait(self, job: Any, n: int) -> tuple[float | None, float | None]:
        """The engine stream's time for the load under a forward of ``cycles`` per layer, minus
        that forward alone (seconds; ``None`` without a GPU)."""
        if not self.cuda:
            return None, None
        torch = self.torch

        def timed(load: bool) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._zero(n)
            with self._forward():
                start.record()
                if load:      # the load's step starts on the host right after: the stream sees no gap
                    self._load(job, n, attend=lambda layer: torch.cuda._sleep(self.cycles), zero=False,
                               forward_queued=end.record)
                else:
                    for _ in self.names:
                        torch.cuda._sleep(self.cycles)
                    end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1000

        forward = min(timed(False) for _ in range(2))
        with_load = min(timed(True) for _ in range(2))
        return max(0.0, with_load - forward), forward

    def _corrupt(self, keys: list[Any], n: int) -> tuple[bool, bool]:
        """One bit of the first page's last layer flipped in its slot: whether it was refused (and
        the rest landed byte-exact), and whether its block of that layer kept its zeros."""
        from pof_connector.adapters.vllm_metadata import LoadJob, PoFConnectorMetadata

        torch, w = self.torch, self.worker
        tier = w.pool.tiers[0]
        ref = tier.find(keys[0])
        if ref is None:
            return False, False
        last = w.pool.spec.num_layers - 1
        view = tier.device_view(ref, last, self.device) if tier.medium == "peer_hbm" else tier.segment_view(ref, last)
        view[11] ^= 1
        try:
            job = LoadJob("c", keys, w.pool.lookup(keys, count=False).sources, [[n + 1 + i] for i in range(n)])
            with self._forward():
                for v in self.views:
                    v[n + 1:2 * n + 1].zero_()
                w.prepare_saves(PoFConnectorMetadata())
                w.start(PoFConnectorMetadata(loads=[job]))
                for name in self.names:
                    w.wait_layer(name)
                    w.save_layer(name)
                w.end_step()
            self._sync()
            errors = w.take_load_errors()
            rest = all(torch.equal(v[n + 2:2 * n + 1].contiguous().view(torch.uint8),
                                   v[2:n + 1].contiguous().view(torch.uint8)) for v in self.views)
            untouched = not bool(self.views[-1][n + 1].view(torch.uint8).any())
            return errors == {n + 1} and rest, untouched
        finally:
            view[11] ^= 1

    def _raw(self, n: int, repeat: int) -> dict[str, float]:
        """Best-of-``repeat`` seconds of one raw copy of ``n`` pages' KV bytes each way."""
        torch = self.torch
        nbytes = n * self.kv_page
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dev2 = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        out: dict[str, float] = {}
        for name, dst, src in (("h2d", dev, host), ("d2h", host, dev), ("d2d", dev2, dev)):
            times = []
            for _ in range(repeat):
                self._sync()
                t0 = time.perf_counter()
                with self._forward():
                    dst.copy_(src, non_blocking=True)
                self._sync()
                times.append(time.perf_counter() - t0)
            out[name] = min(times)
        return out


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pof_connector.bench.vllm_load --device DEVICE",
                                description=__doc__.split("\n")[0])
    p.add_argument("--device", required=True, help="cuda, cuda:N, or cpu (the same steps on CPU tensors)")
    p.add_argument("--pages", type=int, nargs="+", default=[32, 128, 512])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--layout", default="LBNHC", help="the KVCacheLayout of the views (default LBNHC, vLLM's first)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--tier", choices=["cpu_dram", "peer_hbm"], default="cpu_dram",
                   help="where the pages load from: page-locked DRAM, or a peer-HBM region on the same GPU")
    p.add_argument("--layer-us", type=float, default=100.0, help="the simulated forward's time per layer")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    result = run(device=a.device, pages=tuple(a.pages), layers=a.layers, kv_heads=a.kv_heads, head_dim=a.head_dim,
                 block_tokens=a.block_tokens, dtype=a.dtype, layout=a.layout, repeat=a.repeat, layer_us=a.layer_us,
                 tier=a.tier)
    if a.json:
        print(json.dumps(result))
        return 0
    for r in result["rows"]:
        print(f"{r['pages']} pages ({r['bytes'] / 1e6:.0f} MB) on {result['device']} from {result['tier']}: load "
              f"{r['load_gbps']} GB/s = {r['load_ratio']} x {r['load_baseline']} (raw h2d {r['raw_h2d_gbps']} GB/s); "
              f"save {r['save_gbps']} GB/s = "
              f"{r['save_ratio']} x raw d2h ({r['raw_d2h_gbps']} GB/s); engine waited {r['engine_wait_s']} s; "
              f"landed equal {r['landed_equal']}, corrupt page refused {r['corrupt_refused']} "
              f"(its block untouched {r['corrupt_blocks_untouched']})")
    return 0
