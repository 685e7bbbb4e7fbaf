"""Measurement prototype for docs/index-segments.md (not part of the package).

Publishes the layout of ``pof bench index`` (a 2,000-page chain; node k of 4 holds its first
2000*(4-k)/4 pages) in today's per-page schema (through RedisIndex) and, beside it, as one hash
field per SEGMENT pages (26-byte records: offset | 8-byte tag | today's 17-byte record). Then
times, interleaved on one private server: RedisIndex.longest_prefix, a segment lookup decoded in
plain numpy, the send+read of each lookup's three pipelined commands alone, and PING.

    PYTHONPATH=. python docs/index-segments-prototype.py [SEGMENT ...]
"""
import sys
import tempfile
import time

import numpy as np
import redis

from pof_connector.index.base import Location, NodeInfo
from pof_connector.index.record_runs import FIELD_BYTES
from pof_connector.index.redis import LIVE_QUERY, RedisIndex, hmget_resp, loc_key
from pof_connector.index.server import RedisServer
from pof_connector.keys import Namespace, page_keys

PAGES, NODES, ITERATIONS, PAGE_TOKENS = 2000, 4, 300, 64
SEG = np.dtype([("off", "u1"), ("tag", "V8"), ("inc", "<u4"), ("medium", "u1"), ("slot", "<u4"), ("gen", "<u8")])
assert SEG.itemsize == 26


def held(k: int) -> int:
    return PAGES * (NODES - k) // NODES


def measure(url: str, segment: int) -> None:
    clients = [RedisIndex(url, f"n{k}") for k in range(NODES)]
    for c in clients:
        c.heartbeat(NodeInfo(str(c.node_id)), 600)
    ns = Namespace("proto", "bfloat16", f"segment={segment}", PAGE_TOKENS).digest
    tokens = np.random.default_rng(segment).integers(0, 32000, size=PAGES * PAGE_TOKENS, dtype=np.uint32)
    keys = page_keys(ns, tokens, PAGE_TOKENS)
    for k, c in enumerate(clients):
        c.publish([(key, Location(str(c.node_id), "cpu_dram", i, 1)) for i, key in enumerate(keys[:held(k)])])
    r = redis.Redis.from_url(url)
    seg_key = b"pof:{pof}:seg:" + ns.hex().encode()
    heads = [keys[h].digest[:FIELD_BYTES] for h in range(0, PAGES, segment)]
    pipe = r.pipeline(transaction=False)
    for s, head in enumerate(heads):
        recs = [(p - s * segment, keys[p].digest[:8], c.incarnation, 0, p, 1)
                for k, c in enumerate(clients) for p in range(s * segment, min(held(k), s * segment + segment))]
        pipe.hset(seg_key, head, np.array(recs, dtype=SEG).tobytes())
    pipe.execute()
    mem_seg = int(r.memory_usage(seg_key, samples=0) or 0)
    mem_page = int(r.memory_usage(loc_key(ns), samples=0) or 0)
    locations = sum(held(k) for k in range(NODES))
    tags = np.frombuffer(b"".join(k.digest[:8] for k in keys), dtype="V8")
    reader = RedisIndex(url, None)
    seg_packed = LIVE_QUERY + hmget_resp(seg_key, np.frombuffer(b"".join(heads), np.uint8).reshape(-1, FIELD_BYTES))
    digests = np.frombuffer(b"".join(k.digest for k in keys), np.uint8).reshape(PAGES, -1)[:, :FIELD_BYTES]
    page_packed = LIVE_QUERY + hmget_resp(loc_key(ns).encode(), digests)

    def seg_lookup() -> dict[int, int]:
        _, _, vals = reader._send(seg_packed, 3)
        lens = np.fromiter(map(len, vals), dtype=np.int64, count=len(vals))
        recs = np.frombuffer(b"".join(vals), dtype=SEG)
        page = np.repeat(np.arange(len(vals)), lens // SEG.itemsize) * segment + recs["off"]
        ok = (page < PAGES) & (tags[np.minimum(page, PAGES - 1)] == recs["tag"])
        runs = {}
        for inc in np.unique(recs["inc"][ok]):
            have = np.zeros(PAGES + 1, bool)
            have[page[ok & (recs["inc"] == inc)]] = True
            runs[int(inc)] = int(np.argmin(have))
        return runs

    assert sorted(seg_lookup().values()) == sorted(held(k) for k in range(NODES))
    times: dict[str, list[float]] = {"per_page": [], "segment": [], "per_page_io": [], "segment_io": [], "ping": []}
    for _ in range(ITERATIONS):
        for name, fn in (("per_page", lambda: reader.longest_prefix(keys)), ("segment", seg_lookup),
                         ("per_page_io", lambda: reader._send(page_packed, 3)),
                         ("segment_io", lambda: reader._send(seg_packed, 3)), ("ping", reader.ping_ms)):
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1000)
    med = {name: float(np.median(t)) for name, t in times.items()}
    print(f"segment={segment}: ping {med['ping']:.3f} ms | per-page lookup {med['per_page']:.3f} ms "
          f"(ratio {med['per_page'] / med['ping']:.2f}, send+read {med['per_page_io']:.3f}) | segment lookup "
          f"{med['segment']:.3f} ms (ratio {med['segment'] / med['ping']:.2f}, send+read {med['segment_io']:.3f}) | "
          f"hash bytes per location: per-page {mem_page / locations:.1f}, segment {mem_seg / locations:.1f}")
    for c in clients:
        c.leave()
        c.close()
    reader.close()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        server = RedisServer(tmp).start()
        try:
            for arg in sys.argv[1:] or ["16"]:
                measure(server.url, int(arg))
        finally:
            server.stop()
