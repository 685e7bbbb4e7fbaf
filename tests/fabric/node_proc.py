"""A pool node in its own process, driven by JSON lines on stdin (one reply line per command).

    python tests/fabric/node_proc.py CONFIG_JSON [LAYERS:SEGMENT_BYTES]

Pages are identified by (seed, pages): the keys of ``pages`` full pages of the tokens
``seed * 1_000_000 + arange(16 * pages)``; their content is derived from each key, so any process
can check a page byte for byte.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

import numpy as np

from pof_connector.config import PofConfig
from pof_connector.pages.keys import Namespace, PageKey
from pof_connector.pages.layout import PageSpec
from pof_connector.pool import Lookup, Pool

SPEC = PageSpec(num_layers=3, segment_bytes=2048, page_tokens=16)
NAMESPACE = Namespace("tests/model", "bfloat16", "mha:kv_heads=2:head_dim=64", SPEC).digest
"""Kept when ``main`` takes another geometry: the tests compute keys with this one."""


def content(k: PageKey, spec: PageSpec | None = None) -> list[np.ndarray]:
    """Page ``k``'s segments, of ``spec``'s geometry (``None``: this process's :data:`SPEC`)."""
    spec = spec or SPEC
    rng = np.random.default_rng(int.from_bytes(k.digest[:8], "little"))
    return [rng.integers(0, 255, spec.segment_bytes, dtype=np.uint8) for _ in range(spec.num_layers)]


class Node:
    def __init__(self, config: PofConfig) -> None:
        self.pool = Pool(config, SPEC, NAMESPACE)
        self.saved: dict[str, Lookup] = {}

    def keys(self, seed: int, pages: int) -> list[PageKey]:
        return self.pool.keys_for(np.arange(16 * pages, dtype=np.int64) + seed * 1_000_000)

    def op_store(self, seed: int, pages: int) -> dict[str, Any]:
        keys = self.keys(seed, pages)
        return {"stored": self.pool.store([(k, content(k)) for k in keys]).result()}

    def op_remove(self, seed: int, pages: int) -> dict[str, Any]:
        """Forget pages in the tiers only (the index still points at their old slots)."""
        removed = sum(t.remove(k) is not None for k in self.keys(seed, pages) for t in self.pool.tiers)
        return {"removed": removed}

    def op_lookup(self, seed: int, pages: int, save: str = "") -> dict[str, Any]:
        lk = self.pool.lookup(self.keys(seed, pages))
        if save:
            self.saved[save] = lk
        return {"pages": lk.pages, "nodes": sorted({s.node for s in lk.sources}),
                "slots": [s.slot for s in lk.sources]}

    def op_load(self, seed: int, pages: int, saved: str = "", zero_copy: bool = False) -> dict[str, Any]:
        """Load (a saved lookup's plan, or a fresh one) and check every page that did not fail."""
        keys = self.keys(seed, pages)
        lk = self.saved[saved] if saved else self.pool.lookup(keys)
        keys = keys[:lk.pages]
        bufs = [np.zeros(SPEC.page_bytes, np.uint8) for _ in keys]
        t0 = time.monotonic()
        if zero_copy:                       # the adapters' path: Pool.open_read, segment by segment
            reader = self.pool.open_read(keys, lk.sources)
            for layer in range(SPEC.num_layers):
                for i, buf in enumerate(bufs):
                    reader.copy_into(i, layer, SPEC.segment(buf, layer))
            failed = dict(reader.failed)
            reader.close()
        else:
            handle = self.pool.load(keys, lk.sources, bufs)
            handle.wait(30)
            failed = handle.failed
        seconds = time.monotonic() - t0
        exact = all(
            bytes(SPEC.segment(memoryview(buf), layer)) == data.tobytes()
            for i, (buf, k) in enumerate(zip(bufs, keys, strict=True)) if i not in failed
            for layer, data in enumerate(content(k)))
        return {"pages": len(keys), "failed": {str(i): r for i, r in failed.items()}, "exact": exact,
                "seconds": seconds}

    def op_peers(self) -> dict[str, Any]:
        fabric = self.pool.fabric
        return {"peers": [] if fabric is None else fabric.peers.connected,
                "quarantined": 0 if fabric is None else fabric.staging.quarantined_slots}

    def op_spill(self) -> dict[str, Any]:
        """Pages of this node living in other nodes' slots now."""
        fabric = self.pool.fabric
        writer = None if fabric is None else fabric.writer
        return {"spilled": 0 if writer is None else writer.spilled}

    def op_stats(self) -> dict[str, Any]:
        return {"stats": self.pool.stats.snapshot()}


def main() -> None:
    global SPEC
    if len(sys.argv) > 2:       # another page geometry, e.g. large pages for transfers that take time
        layers, segment_bytes = (int(x) for x in sys.argv[2].split(":"))
        SPEC = PageSpec(num_layers=layers, segment_bytes=segment_bytes, page_tokens=16)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[node {os.getpid()}] %(levelname)s %(name)s: %(message)s")
    # Replies get the pipe to themselves: UCX and NIXL's logger write to fd 1 from other threads,
    # and a line of theirs landing inside a reply once broke its JSON (the link-cut test).
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply_with(obj: dict[str, Any]) -> None:
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    node = Node(PofConfig.from_json(sys.argv[1]))
    reply_with({"ready": True, "pid": os.getpid(), "meta": node.pool.meta})
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd.pop("op")
            if op == "quit":
                break
            try:
                reply = getattr(node, f"op_{op}")(**cmd)
            except Exception as e:   # report, keep serving: the test decides
                reply = {"error": f"{type(e).__name__}: {e}"}
            reply_with(reply)
    finally:
        node.pool.close()


if __name__ == "__main__":
    main()
