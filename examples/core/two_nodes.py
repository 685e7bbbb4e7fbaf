"""Two pool nodes on one host, on the embedded index: node A stores a prompt's pages in a shared
CXL region (a file under /dev/shm here), node B — another process — finds them through the index
and loads them layer by layer. Prints what came from where and the pool's counters.

    python examples/core/two_nodes.py [--pages 64] [--page-kib 256]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import tempfile
import time

import numpy as np
from rich.table import Table

from pof_connector.config import PofConfig
from pof_connector.console import console
from pof_connector.index.embedded import stop_embedded
from pof_connector.pages.keys import Namespace
from pof_connector.pages.layout import PageSpec
from pof_connector.pool import Pool

LAYERS = 8


def make_config(node: str, region: str, runtime_dir: str) -> PofConfig:
    return PofConfig.from_mapping({
        "node_id": node, "index_url": "embedded", "runtime_dir": runtime_dir, "heartbeat_s": 0.2,
        # Tier order is preference: pages go to the shared CXL region first, so the other
        # process can read them with plain loads; DRAM takes what CXL evicts.
        "tiers": {"cxl": {"path": region, "size": "512MiB"}, "cpu_dram": {"size": "256MiB"}},
    })


def fake_kv(seed: int, spec: PageSpec) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, spec.segment_bytes, dtype=np.uint8) for _ in range(spec.num_layers)]


def node_b(region: str, runtime_dir: str, spec: PageSpec, ns: bytes, tokens: np.ndarray,
           q: mp.Queue) -> None:  # type: ignore[type-arg]
    pool = Pool(make_config("node-b", region, runtime_dir), spec, ns)
    try:
        keys = pool.keys_for(tokens)
        deadline = time.monotonic() + 10
        while pool.lookup(keys).pages < len(keys) and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.perf_counter()
        lk = pool.lookup(keys)
        t1 = time.perf_counter()
        bufs = [np.empty(spec.page_bytes, np.uint8) for _ in range(lk.pages)]
        handle = pool.load(keys[:lk.pages], lk.sources, bufs)
        handle.wait_layer(0)
        t2 = time.perf_counter()
        handle.wait()
        t3 = time.perf_counter()
        exact = sum(
            all(bytes(spec.segment(memoryview(b), layer)) == seg.tobytes()
                for layer, seg in enumerate(fake_kv(i, spec)))
            for i, b in enumerate(bufs) if i not in handle.failed)
        q.put({"pages": lk.pages, "per_tier": lk.per_tier(), "from": sorted({s.node for s in lk.sources}),
               "lookup_ms": (t1 - t0) * 1e3, "layer0_ms": (t2 - t1) * 1e3, "all_ms": (t3 - t1) * 1e3,
               "failed": len(handle.failed), "byte_exact": exact})
    finally:
        pool.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-kib", type=int, default=256)
    args = ap.parse_args()
    out = console()
    spec = PageSpec(num_layers=LAYERS, segment_bytes=args.page_kib * 1024 // LAYERS, page_tokens=64)
    ns = Namespace("examples/fake-model", "bfloat16", "mha", spec).digest
    tokens = np.random.default_rng(0).integers(0, 32000, spec.page_tokens * args.pages)
    runtime_dir = tempfile.mkdtemp(prefix="pof-demo-", dir="/tmp")
    region = os.path.join(tempfile.mkdtemp(prefix="pof-demo-", dir="/dev/shm"), "cxl.region")
    out.print(f"[bold]pof demo[/]: {args.pages} pages of {args.page_kib} KiB, CXL region {region}, "
                  f"embedded index in {runtime_dir}")
    a = Pool(make_config("node-a", region, runtime_dir), spec, ns)
    try:
        keys = a.keys_for(tokens)
        t0 = time.perf_counter()
        stored = a.store([(k, fake_kv(i, spec)) for i, k in enumerate(keys)]).result()
        out.print(f"node-a stored {stored} pages in {(time.perf_counter() - t0) * 1e3:.1f} ms")
        q: mp.Queue = mp.get_context("spawn").Queue()  # type: ignore[type-arg]
        p = mp.get_context("spawn").Process(target=node_b, args=(region, runtime_dir, spec, ns, tokens, q))
        p.start()
        result = q.get(timeout=60)
        p.join()
    finally:
        a.close()
        stop_embedded(runtime_dir)      # this demo's private index server
        shutil.rmtree(runtime_dir, ignore_errors=True)
        shutil.rmtree(os.path.dirname(region), ignore_errors=True)
    table = Table(title="node-b asked the pool for the prompt's prefix")
    for col in ("prompt pages", "loaded", "from node", "tiers", "byte-exact", "lookup ms", "layer 0 ms", "all ms"):
        table.add_column(col, no_wrap=True)
    tiers = " ".join(f"{m}:{n}" for m, n in result["per_tier"].items())
    table.add_row(str(args.pages), str(result["pages"]), ",".join(result["from"]), tiers,
                  f"{result['byte_exact']}/{result['pages']}", f"{result['lookup_ms']:.2f}",
                  f"{result['layer0_ms']:.2f}", f"{result['all_ms']:.2f}")
    out.print(table)


if __name__ == "__main__":
    main()
