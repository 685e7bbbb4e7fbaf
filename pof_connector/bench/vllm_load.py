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
import statistics
import tempfile
import time
from typing import Any
from unittest import mock

import numpy as np

LAYOUTS = ("engine", "cpu_kt", "cpu_vnni")


def run(*, pages: int = 46, repeat: int = 5, dtype: str = "float32", layout: str = "engine") -> dict[str, Any]:
    """``layout``: the block order the engine's kernel gives on this host (``engine``), or one forced:
    ``cpu_kt`` (the ``vec`` ISA's) or ``cpu_vnni`` (the ``amx`` ISA's, bf16), so any host measures
    the data movement of both."""
    import torch

    from pof_connector.adapters import vllm_layout, vllm_worker
    from pof_connector.adapters.vllm_geometry import VllmGeometry
    from pof_connector.adapters.vllm_metadata import LoadJob, PoFConnectorMetadata, SaveJob
    from pof_connector.adapters.vllm_worker import PoFWorker
    from pof_connector.config import PofConfig

    torch.set_num_threads(1)
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
    times: dict[str, list[float]] = {"fused": [], "torch": []}
    memcpy: list[float] = []
    original = vllm_layout.BlockLayout.can_copy_checked
    for _ in range(repeat):        # interleaved, so both paths see the same machine
        for path in times:
            if path == "torch":
                vllm_layout.BlockLayout.can_copy_checked = lambda self, kv: False
            try:
                times[path].append(load())
            finally:
                vllm_layout.BlockLayout.can_copy_checked = original
        t0 = time.perf_counter()
        np.copyto(dst, src)
        memcpy.append(time.perf_counter() - t0)
    best = {path: min(t) for path, t in times.items()}
    mc = min(memcpy)
    return {
        "bench": "vllm_load", "layout": worker.layout.name, "dtype": str(next(iter(kv.values())).dtype),
        "pages": pages, "loaded_bytes": nbytes,
        "memcpy_s": round(mc, 6),
        "fused_s": round(best["fused"], 6), "torch_s": round(best["torch"], 6),
        "fused_median_s": round(statistics.median(times["fused"]), 6),
        "torch_median_s": round(statistics.median(times["torch"]), 6),
        "ratio": round(best["fused"] / mc, 3), "torch_ratio": round(best["torch"] / mc, 3),
        "fused_available": original(worker.layout, next(iter(kv.values()))),
        "baseline": "one numpy.copyto of loaded_bytes, same run; ratio = fused load / memcpy (best of repeats)",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pof_connector.bench.vllm_load", description=__doc__.split("\n")[0])
    p.add_argument("--pages", type=int, default=46, help="pages per load (default 46: a 6,000-token prompt)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="the KV cache's dtype (default float32, as pof bench vllm runs)")
    p.add_argument("--layout", choices=LAYOUTS, default="engine",
                   help="the CPU cache's block order: the one vLLM's kernel gives on this host (default), or "
                        "cpu_kt (vec ISA) / cpu_vnni (amx ISA, bf16 only) forced, to measure either anywhere")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    result = run(pages=args.pages, repeat=args.repeat, dtype=args.dtype, layout=args.layout)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['pages']} pages, {result['loaded_bytes'] / 1e6:.1f} MB, {result['dtype']}, "
              f"layout {result['layout']}: fused "
              f"{result['fused_s'] * 1e3:.1f} ms = {result['ratio']:.2f} x memcpy ({result['memcpy_s'] * 1e3:.1f} ms); "
              f"torch path {result['torch_s'] * 1e3:.1f} ms = {result['torch_ratio']:.2f} x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
