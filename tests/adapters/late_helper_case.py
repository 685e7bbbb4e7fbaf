"""Issue 39, finding 2's adversary, in a process of its own (the native kernel reads
``POF_CREW_STALL_US`` when it loads): a late copy-crew helper must never write into engine blocks
after their check.

Node B's vLLM worker (real ``PoFWorker``, CPU KV tensors, the native fused copy with a crew of two
threads) loads pages that node A owns in a CXL region they share. With the helper stalled after it
claimed a page, B's own thread copies that page, checks it and lets the forward read it; then A
rewrites its slots (another page's bytes), and the stalled helper wakes. Prints one JSON line:
how many of B's accepted blocks differ, after the forward, from what their checks accepted, over
``--rounds`` rounds, and how many pages the crew's callers copied again for late helpers (``stolen``: the
adversary was exercised).

Run: ``POF_CREW_STALL_US=200000 python -m tests.adapters.late_helper_case --shm PATH --runtime DIR``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from pof_connector.adapters.vllm_geometry import VllmGeometry
from pof_connector.adapters.vllm_metadata import LoadJob, PoFConnectorMetadata
from pof_connector.adapters.vllm_worker import PoFWorker
from pof_connector.config import PofConfig
from pof_connector.index.server import RedisServer
from pof_connector.pages import page_sum
from pof_connector.pages.layout import PageSpec
from pof_connector.pool import Pool

H, N, D, LAYERS, PAGES = 2, 32, 32, 2, 12
P = 2 * N
GEO = VllmGeometry(model="m", kv_dtype="float32", kv_heads=H, head_dim=D, num_layers=LAYERS, is_mla=False,
                   block_size=N, page_tokens=P, tp_size=1)


def content(spec: PageSpec, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, spec.segment_bytes, dtype=np.uint8) for _ in range(spec.num_layers)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shm", required=True)
    ap.add_argument("--runtime", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)               # the worker copies with a crew of torch's threads
    server = RedisServer(Path(args.runtime) / "redis").start()
    tiers = {"cxl": {"path": args.shm, "size": "16MiB", "partitions": 2}}

    def cfg(node: str) -> PofConfig:
        return PofConfig.from_mapping({"node_id": node, "index_url": server.url, "runtime_dir": args.runtime,
                                       "tiers": tiers, "heartbeat_s": 0.2})

    b = PoFWorker(cfg("b"), GEO, tp_rank=0, overlap=False)
    kv = {f"model.layers.{i}.self_attn.attn": torch.zeros(8 + 2 * PAGES, H, N, 2 * D) for i in range(LAYERS)}
    b.register(kv)
    assert b.pool is not None
    a = Pool(cfg("a"), b.pool.spec, b.pool.namespace)
    differing = 0
    try:
        tier = a.tiers[0]
        for rnd in range(args.rounds):
            keys = a.keys_for(np.arange(rnd * 10_000, rnd * 10_000 + PAGES * P))
            a.store([(k, content(a.spec, 7 * rnd + i)) for i, k in enumerate(keys)]).result()
            found = b.pool.lookup(keys)
            for _ in range(100):
                if found.pages == PAGES:
                    break
                b.pool.finder.refresh_nodes()
                found = b.pool.lookup(keys)
            assert found.pages == PAGES and {s.node for s in found.sources} == {"a"}, found
            blocks = [[8 + 2 * i, 9 + 2 * i] for i in range(PAGES)]
            meta = PoFConnectorMetadata(loads=[LoadJob(f"r{rnd}", keys, found.sources, blocks)])
            b.track(meta)
            b.start(meta)
            for name in b.layer_index:                # every layer copied and checked: the forward reads them
                b.wait_layer(name)
            accepted = [t[8:].clone() for t in kv.values()]
            for i, k in enumerate(keys):              # then A reuses its slots for other pages
                tier.remove(k)
                other = a.keys_for(np.arange(900_000 + 100 * i, 900_000 + 100 * i + P))[0]
                got = tier.prepare_store(other)
                assert got is not None
                tier.write(got[0], other, content(a.spec, 10_000 + i))
                tier.complete_store(other, True)
            b.end_step()                              # after the forward: settle(), reports
            errors = b.take_load_errors()
            ok_blocks = [blk for pair in blocks for blk in pair if blk not in errors]
            for before, now in zip(accepted, kv.values(), strict=True):
                differing += sum(int(not torch.equal(now[blk].view(torch.int32), before[blk - 8].view(torch.int32)))
                                 for blk in ok_blocks)           # as integers: random bytes hold NaNs
            for k in a.tiers[0].stored():             # empty the region for the next round
                tier.remove(k[0])
        native = page_sum._native
        stolen = native.crew_stats()[1] if native is not None and hasattr(native, "crew_stats") else 0
        print(json.dumps({"differing_blocks": differing, "stolen": stolen, "rounds": args.rounds}))
    finally:
        b.close()
        a.close()
        server.stop()


if __name__ == "__main__":
    main()
