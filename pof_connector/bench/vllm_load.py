"""The vLLM worker's load path alone (``python -m pof_connector.bench.vllm_load [--json]``).

No server: a real :class:`~pof_connector.adapters.vllm_worker.PoFWorker` with a CPU DRAM tier
saves a prompt's pages from CPU KV tensors shaped like ``pof bench vllm``'s model (8 layers, 4 KV
heads of 64, fp32 by default (``--dtype bfloat16``: a bf16 model's cache), 128-token pages, K
stored transposed as vLLM's CPU backend does), then loads
them into other blocks the way vLLM drives a forward (``start``, ``wait_layer`` per layer,
``end_step``): lookup-free, so the figure is the worker's own — open the read (headers), convert,
copy and check every layer of every page, close. Two paths in the same run: ``fused`` (one
native call per page and layer converts, copies and sums) and ``torch`` (strided torch copies,
then a checksum pass). Baseline: one ``numpy.copyto`` of the same number of bytes. Every load is
checked byte-exact against the saved blocks. ``--layout cpu_kt|cpu_vnni`` forces the block order
another host's kernel gives (K^T with the ``vec`` ISA, VNNI tiles with ``amx``), so one host
measures both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from unittest import mock

import numpy as np

LAYOUTS = ("engine", "cpu_kt", "cpu_vnni")


def run(*, pages: int = 46, repeat: int = 5, dtype: str = "float32", layout: str = "engine",
        threads: int | None = None) -> dict[str, Any]:
    """``layout``: the block order the engine's kernel gives on this host (``engine``), or one forced:
    ``cpu_kt`` (the ``vec`` ISA's) or ``cpu_vnni`` (the ``amx`` ISA's, bf16), so any host measures
    the data movement of both. ``threads``: torch's threads, as the engine sets them (default: one
    per core this process may run on, as vLLM's CPU worker does)."""
    import torch

    from pof_connector.adapters import vllm_layout, vllm_worker
    from pof_connector.adapters.vllm_geometry import VllmGeometry
    from pof_connector.adapters.vllm_metadata import LoadJob, PoFConnectorMetadata, SaveJob
    from pof_connector.adapters.vllm_worker import PoFWorker
    from pof_connector.config import PofConfig

    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
    heads, tokens, dim, layers = 4, 128, 64, 8
    geo = VllmGeometry(model="bench", kv_dtype=dtype, kv_heads=heads, head_dim=dim, num_layers=layers,
                       is_mla=False, block_size=tokens, page_tokens=tokens, tp_size=1)
    with tempfile.TemporaryDirectory(prefix="pof-bench-vllm-load-") as rt:
        cfg = PofConfig.from_mapping({"node_id": "bench", "index_url": "local", "runtime_dir": rt,
                                      "tiers": {"cpu_dram": {"size": f"{(pages + 2) * 3}MiB"}}})
        worker = PoFWorker(cfg, geo, tp_rank=0)
        kv = {f"model.layers.{i}.self_attn.attn":
              torch.randn(2 * pages + 2, heads, tokens, 2 * dim).to(getattr(torch, dtype))
              for i in range(layers)}
        if layout == "engine":
            worker.register(kv)
        else:
            forced = vllm_layout._kt_order if layout == "cpu_kt" else vllm_layout._vnni_order
            with mock.patch.object(vllm_worker, "cpu_block_order", lambda h, n, d, _dtype: forced(h, n, d)):
                worker.register(kv)
        assert worker.layout is not None
        if layout != "engine" and worker.layout.name != layout:
            raise RuntimeError(f"bench: the layout {layout} does not fit {dtype} blocks ({worker.layout.name})")
        try:
            return _measure(worker, kv, pages, repeat, vllm_layout, LoadJob, PoFConnectorMetadata, SaveJob)
        finally:
            worker.close()


def _measure(worker: Any, kv: dict[str, Any], pages: int, repeat: int, vllm_layout: Any, load_job: Any,
             metadata: Any, save_job: Any) -> dict[str, Any]:
    import torch

    def step(meta: Any) -> set[int]:
        worker.prepare_saves(meta)
        worker.start(meta)
        for name in kv:
            worker.wait_layer(name)
            worker.save_layer(name)
        worker.end_step()
        errors: set[int] = worker.take_load_errors()
        return errors

    tokens = worker.geo.page_tokens
    keys = worker.pool.keys_for(list(range(pages * tokens)))
    if step(metadata(saves=[save_job("save", keys, [[i] for i in range(pages)])])):
        raise RuntimeError("bench: the save failed")
    worker.pool.flush()
    sources = worker.pool.lookup(keys).sources
    if len(sources) != pages:
        raise RuntimeError(f"bench: {len(sources)} of {pages} pages stored")
    saved = {n: t[:pages].clone() for n, t in kv.items()}
    targets = [[pages + 1 + i] for i in range(pages)]

    def load() -> float:
        for t in kv.values():
            t[pages:].zero_()
        t0 = time.perf_counter()
        errors = step(metadata(loads=[load_job("load", keys, sources, targets)]))
        elapsed = time.perf_counter() - t0
        if errors or any(not torch.equal(t[pages + 1:2 * pages + 1], saved[n]) for n, t in kv.items()):
            raise RuntimeError("bench: a load failed or did not restore the saved blocks")
        return elapsed

    nbytes = pages * worker.pool.spec.page_bytes
    src, dst = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
    threads = worker.copy_threads
    times: dict[str, list[float]] = {"fused": [], "fused_one_thread": [], "torch": []}
    memcpy: list[float] = []
    memcpy_threads: list[float] = []
    original = vllm_layout.BlockLayout.can_copy_checked
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeat):        # interleaved, so every path sees the same machine
            for path in times:
                if path == "torch":
                    vllm_layout.BlockLayout.can_copy_checked = lambda self, kv: False
                worker.copy_threads = 1 if path == "fused_one_thread" else threads
                try:
                    times[path].append(load())
                finally:
                    vllm_layout.BlockLayout.can_copy_checked = original
                    worker.copy_threads = threads
            memcpy.append(timed_copy(dst, src, None))
            memcpy_threads.append(timed_copy(dst, src, pool, threads))
    best = {path: min(t) for path, t in times.items()}
    mc, mct = min(memcpy), min(memcpy_threads)
    return {
        "bench": "vllm_load", "layout": worker.layout.name, "dtype": str(next(iter(kv.values())).dtype),
        "pages": pages, "loaded_bytes": nbytes, "copy_threads": threads,
        "memcpy_s": round(mc, 6), "memcpy_threads_s": round(mct, 6),
        "fused_s": round(best["fused"], 6), "fused_one_thread_s": round(best["fused_one_thread"], 6),
        "torch_s": round(best["torch"], 6),
        "fused_median_s": round(statistics.median(times["fused"]), 6),
        "fused_one_thread_median_s": round(statistics.median(times["fused_one_thread"]), 6),
        "torch_median_s": round(statistics.median(times["torch"]), 6),
        "ratio": round(best["fused"] / mc, 3), "ratio_vs_memcpy_threads": round(best["fused"] / mct, 3),
        "one_thread_ratio": round(best["fused_one_thread"] / mc, 3), "torch_ratio": round(best["torch"] / mc, 3),
        "fused_available": original(worker.layout, next(iter(kv.values()))),
        "baseline": "memcpy_s: one numpy.copyto of loaded_bytes, same run; memcpy_threads_s: the same bytes copied "
                    "in copy_threads parts side by side; ratio = fused load (copy_threads threads, as in "
                    "the engine) / memcpy_s, ratio_vs_memcpy_threads = fused / memcpy_threads_s, one_thread_ratio "
                    "= fused on one thread / memcpy_s (best of repeats each)",
    }


def timed_copy(dst: np.ndarray, src: np.ndarray, pool: ThreadPoolExecutor | None = None, parts: int = 1) -> float:
    """Seconds for one copy of ``src`` into ``dst``: one ``numpy.copyto``, or (``pool``) split into
    ``parts`` copied side by side on the pool's threads (numpy releases the GIL)."""
    t0 = time.perf_counter()
    if pool is None:
        np.copyto(dst, src)
    else:
        bounds = np.linspace(0, len(src), parts + 1, dtype=np.int64)
        list(pool.map(lambda i: np.copyto(dst[bounds[i]:bounds[i + 1]], src[bounds[i]:bounds[i + 1]]), range(parts)))
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    if any(a == "--device" or a.startswith("--device=") for a in given):     # the GPU path: its own bench
        from pof_connector.bench import vllm_device_load

        return vllm_device_load.main(given)
    p = argparse.ArgumentParser(prog="python -m pof_connector.bench.vllm_load", description=__doc__.split("\n")[0])
    p.add_argument("--pages", type=int, default=46, help="pages per load (default 46: a 6,000-token prompt)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="the KV cache's dtype (default float32, as pof bench vllm runs)")
    p.add_argument("--layout", choices=LAYOUTS, default="engine",
                   help="the CPU cache's block order: the one vLLM's kernel gives on this host (default), or "
                        "cpu_kt (vec ISA) / cpu_vnni (amx ISA, bf16 only) forced, to measure either anywhere")
    p.add_argument("--threads", type=int, default=None,
                   help="torch's threads, as the engine sets them (default: one per core, as vLLM's CPU worker)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--device", help="cuda / cpu: the GPU path's bench instead (pof_connector.bench.vllm_device_load)")
    args = p.parse_args(argv)
    result = run(pages=args.pages, repeat=args.repeat, dtype=args.dtype, layout=args.layout, threads=args.threads)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['pages']} pages, {result['loaded_bytes'] / 1e6:.1f} MB, {result['dtype']}, "
              f"layout {result['layout']}: fused "
              f"{result['fused_s'] * 1e3:.1f} ms on {result['copy_threads']} threads = {result['ratio']:.2f} x memcpy "
              f"({result['memcpy_s'] * 1e3:.1f} ms), {result['ratio_vs_memcpy_threads']:.2f} x memcpy on "
              f"{result['copy_threads']} threads ({result['memcpy_threads_s'] * 1e3:.1f} ms); on one thread "
              f"{result['fused_one_thread_s'] * 1e3:.1f} ms = {result['one_thread_ratio']:.2f} x; "
              f"torch path {result['torch_s'] * 1e3:.1f} ms = {result['torch_ratio']:.2f} x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
