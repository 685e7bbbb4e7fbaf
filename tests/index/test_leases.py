"""The leases a lookup reads (``pof:{pof}:leases``, lua/leases.lua): the live ZSET's incarnations and
expiries in one string, written by the scripts that write the ZSET."""

from __future__ import annotations

import time

import numpy as np
import pytest
import redis

from pof_connector.index import Location, NodeInfo
from pof_connector.index.live_set import LEASE, LiveSet
from pof_connector.index.redis import K_LEASES, K_LIVE, RedisIndex
from pof_connector.index.server import RedisServer
from pof_connector.pages.keys import page_keys


def at(ms: int) -> list[bytes]:
    """``TIME``'s reply at ``ms`` milliseconds."""
    return [str(ms // 1000).encode(), str(ms % 1000 * 1000).encode()]


def leases(*entries: tuple[int, float]) -> bytes:
    out = np.zeros(len(entries), dtype=LEASE)
    for i, (inc, expiry) in enumerate(entries):
        out[i] = (inc, expiry)
    return out.tobytes()


def test_leases_count_until_their_expiry_and_reuse_stops_there() -> None:
    s = LiveSet()
    got = leases((9, 9_000.0), (7, 5_000.0))
    assert s.of(at(1_000), got).tolist() == [7, 9]
    assert s.of(at(4_999), got).tolist() == [7, 9]
    assert s.of(at(5_000), got).tolist() == [9]                # 7's lease ended, the value unchanged
    assert s.of(at(4_000), got).tolist() == [7, 9]             # the clock stepped back
    assert s.of(at(9_000), got).tolist() == []
    assert s.of(at(1_000), None).tolist() == []                # no key: nobody registered
    assert s.of(at(1_000), leases((7, 5_000.0))).tolist() == [7]


def test_leases_cut_short_or_odd_count_no_holder_they_do_not_hold() -> None:
    """A value that is not whole entries loses its cut entry; incarnation 0, a NaN expiry and a repeat
    are not counted (twice)."""
    s = LiveSet()
    whole = leases((3, 8_000.0), (0, 8_000.0), (5, float("nan")), (3, 9_000.0))
    assert s.of(at(1_000), whole).tolist() == [3]
    assert s.of(at(1_000), whole + leases((4, 8_000.0))[:11]).tolist() == [3]


def registry(r: redis.Redis) -> tuple[dict[int, float], dict[int, float]]:
    """(the live ZSET, the leases) as incarnation -> expiry."""
    zset = {int(m): float(sc) for m, sc in r.zrange(K_LIVE, 0, -1, withscores=True)}
    raw = r.get(K_LEASES) or b""
    assert len(raw) % LEASE.itemsize == 0
    got = np.frombuffer(raw, dtype=LEASE)
    assert len(set(got["inc"].tolist())) == len(got)           # one entry per incarnation
    return zset, dict(zip(got["inc"].tolist(), got["expiry"].tolist(), strict=True))


def test_the_scripts_keep_the_leases_equal_to_the_live_zset(redis_server: RedisServer) -> None:
    """Registration, renewal, a restart (a new process of a live node id), leave and expiry each
    change the ZSET; after each the leases hold the same incarnations with the same expiries."""
    r = redis.Redis.from_url(redis_server.url)
    a, b, c = (RedisIndex(redis_server.url, n) for n in "abc")
    try:
        a.heartbeat(NodeInfo("a"), 10)
        b.heartbeat(NodeInfo("b"), 10)
        c.heartbeat(NodeInfo("c"), 0.05)
        zset, got = registry(r)
        assert got == zset and len(got) == 3
        a.heartbeat(NodeInfo("a"), 20)                         # renewal: in place, no new entry
        zset, got = registry(r)
        assert got == zset and len(got) == 3
        a2 = RedisIndex(redis_server.url, "a")                 # a restarted: its former incarnation dies now
        a2.heartbeat(NodeInfo("a"), 10)
        zset, got = registry(r)
        assert got == zset and a.incarnation not in got and a2.incarnation in got
        b.leave()
        zset, got = registry(r)
        assert got == zset and b.incarnation not in got
        time.sleep(0.1)                                        # c's lease ends; the next heartbeat prunes it
        a2.heartbeat(NodeInfo("a"), 10)
        zset, got = registry(r)
        assert got == zset and set(got) == {a2.incarnation}
        a2.leave()
        assert registry(r) == ({}, {}) and not r.exists(K_LEASES)
        a2.close()
    finally:
        for x in (a, b, c):
            x.close()
        r.close()


@pytest.mark.parametrize("junk", [b"", b"\x01\x02\x03", b"\x07\x00\x00\x00" * 5])
def test_a_heartbeat_realigns_leases_that_are_not_whole_entries(redis_server: RedisServer, junk: bytes) -> None:
    """A value that is not whole entries (not these scripts' writing) loses its cut end when the next
    registration appends, so every entry stays at a multiple of 12 bytes."""
    r = redis.Redis.from_url(redis_server.url)
    a = RedisIndex(redis_server.url, "a")
    try:
        r.set(K_LEASES, junk)
        a.heartbeat(NodeInfo("a"), 10)
        raw = r.get(K_LEASES) or b""
        assert len(raw) % LEASE.itemsize == 0
        assert a.incarnation in np.frombuffer(raw, dtype=LEASE)["inc"].tolist()
    finally:
        a.close()
        r.close()


def test_a_lookup_counts_the_leases_not_a_registration_only_in_the_zset(redis_server: RedisServer,
                                                                         namespace: bytes) -> None:
    """A holder is counted only while the leases have it: an incarnation that only the ZSET lists
    (an older release's heartbeat) is a miss, and the leases' removal alone drops a holder at once."""
    r = redis.Redis.from_url(redis_server.url)
    a, reader = RedisIndex(redis_server.url, "a"), RedisIndex(redis_server.url, None)
    try:
        a.heartbeat(NodeInfo("a"), 10)
        ks = page_keys(namespace, list(range(16 * 2)), 16)
        a.publish([(k, Location("a", "cpu_dram", i, 1)) for i, k in enumerate(ks)])
        assert reader.longest_prefix(ks)["a"].pages == 2
        raw = r.get(K_LEASES)
        r.delete(K_LEASES)                                     # the ZSET still lists a
        assert reader.longest_prefix(ks) == {}
        r.set(K_LEASES, raw)
        assert reader.longest_prefix(ks)["a"].pages == 2
    finally:
        for x in (a, reader):
            x.close()
        r.close()
