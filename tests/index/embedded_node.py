"""One pool node process for the embedded-index liveness tests (test_embedded_liveness.py).

``python -m tests.index.embedded_node RUNTIME_DIR NODE_INDEX NODES INDEX_TIMEOUT_S`` runs a worker
pool on ``index_url: embedded``: it stores a new chain of :data:`CHAIN_PAGES` pages every
:data:`STORE_EVERY_S` seconds and looks up another node's chains through the index, until the
file ``RUNTIME_DIR/stop-store`` appears; it then writes ``done-<node>.json`` (chains stored,
lookups, the pool's counters) and keeps heartbeating until SIGTERM, when it writes
``final-<node>.json``, leaves the index and exits.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

from pof_connector.config import PofConfig
from pof_connector.pages.keys import Namespace, PageKey, page_keys
from pof_connector.pages.layout import PageSpec
from pof_connector.pool import Pool

SPEC = PageSpec(num_layers=2, segment_bytes=1024, page_tokens=16)
NAMESPACE = Namespace("tests/model", "bfloat16", "mha:kv_heads=2:head_dim=64", SPEC).digest
MODEL = "tests/model"
CHAIN_PAGES = 4
STORE_EVERY_S = 0.1
HEARTBEAT_S = 0.5


def node_id(index: int) -> str:
    return f"n{index}"


def chain_tokens(node: int, chain: int) -> list[int]:
    return [1000 + node, chain, *range(CHAIN_PAGES * SPEC.page_tokens - 2)]


def chain_keys(node: int, chain: int) -> list[PageKey]:
    return page_keys(NAMESPACE, chain_tokens(node, chain), SPEC.page_tokens)


def config(runtime_dir: str, node: int, index_timeout_s: float) -> PofConfig:
    return PofConfig.from_mapping({"node_id": node_id(node), "index_url": "embedded", "runtime_dir": runtime_dir,
                                   "heartbeat_s": HEARTBEAT_S, "node_ttl_s": 5.0, "index_timeout_s": index_timeout_s,
                                   "tiers": {"cpu_dram": {"size": "64MiB"}}})


def counters(pool: Pool) -> dict[str, float]:
    return {name: pool.stats.get(name) for name in ("index_errors", "index_timeouts", "index_restarts")}


def main(runtime_dir: str, node: int, nodes: int, index_timeout_s: float) -> int:
    rt = Path(runtime_dir)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    pool = Pool(config(runtime_dir, node, index_timeout_s), SPEC, NAMESPACE, meta={"model": MODEL})
    chains = lookups = found = 0
    page = [np.full(SPEC.segment_bytes, node, np.uint8)] * SPEC.num_layers
    other = (node + 1) % nodes
    while not (rt / "stop-store").exists() and not stop.is_set():
        t0 = time.monotonic()
        pool.store([(k, page) for k in chain_keys(node, chains)]).result()
        chains += 1
        if nodes > 1:
            # Another node's chain it has surely stored (they store at the same pace): found
            # through the index, or a miss when the index did not answer in time.
            got = pool.lookup(chain_keys(other, lookups % max(1, chains - 20)))
            lookups += 1
            found += max(got.pages, got.elsewhere.get(node_id(other), 0)) == CHAIN_PAGES
        time.sleep(max(0.0, STORE_EVERY_S - (time.monotonic() - t0)))
    (rt / f"done-{node_id(node)}.json").write_text(json.dumps(
        {"chains": chains, "lookups": lookups, "found": found, **counters(pool)}))
    stop.wait()
    final = counters(pool)
    pool.close()
    (rt / f"final-{node_id(node)}.json").write_text(json.dumps(final))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])))
