"""The owner side of ``pof bench fabric``: a pool node in its own process that stores pages and
serves them over the fabric until its stdin closes.

    python -m pof_connector.bench.fabric_owner '{"config": {...}, "layers": 8, "segment_bytes": 32768,
                                                  "pages": 64}'

It prints one JSON line ``{"ready": true, "pid": ...}`` once every page is stored and published.
Page ``i`` holds the bytes :func:`page_content` derives from its key, so the reader checks every
fetched byte without any exchange besides the index.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from pof_connector.config import PofConfig
from pof_connector.pages.keys import Namespace, PageKey, page_keys
from pof_connector.pages.layout import PageSpec
from pof_connector.pool import Pool

PAGE_TOKENS = 16


def bench_spec(layers: int, segment_bytes: int) -> PageSpec:
    return PageSpec(num_layers=layers, segment_bytes=segment_bytes, page_tokens=PAGE_TOKENS)


def bench_namespace(spec: PageSpec) -> bytes:
    return Namespace("bench/fabric", "uint8", f"bench:segment={spec.segment_bytes}", spec).digest


def bench_keys(spec: PageSpec, pages: int) -> list[PageKey]:
    """The keys of the owner's pages (one chain, so the reader's lookup finds all of them)."""
    return page_keys(bench_namespace(spec), np.arange(spec.page_tokens * pages, dtype=np.int64), spec.page_tokens)


def page_content(spec: PageSpec, key: PageKey) -> list[np.ndarray]:
    """Per-layer segment bytes of ``key``'s page, derived from the key alone."""
    rng = np.random.default_rng(int.from_bytes(key.digest[:8], "little"))
    data = np.frombuffer(rng.bytes(spec.num_layers * spec.segment_bytes), dtype=np.uint8)
    return [data[i * spec.segment_bytes:(i + 1) * spec.segment_bytes] for i in range(spec.num_layers)]


def main() -> None:
    args = json.loads(sys.argv[1])
    spec = bench_spec(int(args["layers"]), int(args["segment_bytes"]))
    pool = Pool(PofConfig.from_mapping(args["config"]), spec, bench_namespace(spec))
    try:
        keys = bench_keys(spec, int(args["pages"]))
        stored = pool.store([(k, page_content(spec, k)) for k in keys]).result()
        pool.flush()
        print(json.dumps({"ready": True, "stored": stored}), flush=True)
        for _ in sys.stdin:        # serve until the reader closes our stdin (or kills us)
            pass
    finally:
        pool.close()


if __name__ == "__main__":
    main()
