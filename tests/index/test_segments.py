"""Segment records in the locality index (pof_connector/index/segments.py and the segment scripts
of pof_connector/index/redis.py), on a real Redis-protocol server: a lookup of placed keys must
give what the per-page schema gives for the same holdings, whatever the branches, withdraws and
hostile values."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import redis

from pof_connector.index import record_runs
from pof_connector.index.base import MEDIA, Location, NodeInfo, PrefixMatch
from pof_connector.index.redis import RedisIndex, flat_key, loc_key, records_key, segment_key
from pof_connector.index.segments import MAX_TAGS, SegmentQuery
from pof_connector.index.server import RedisServer
from pof_connector.index.summary import encode_summary, parse_summary
from pof_connector.pages.keys import SEGMENT_PAGES, ChainPlace, Namespace, PageKey, chain_keys, keys_from_hex, page_keys
from pof_connector.pages.layout import PageSpec


def _flat(keys: list[PageKey], namespace: bytes) -> list[PageKey]:
    """The same pages in ``namespace``, without places: they go to per-page fields."""
    return [PageKey(namespace, k.digest) for k in keys]


def _view(found: dict[str, PrefixMatch]) -> dict[str, tuple[list[int], list[int], list[int]]]:
    return {n: (m.media.tolist(), m.slots.tolist(), m.generations.tolist()) for n, m in found.items()}


def _branches(namespace: bytes, shared: int, count: int, length: int, seed: int) -> list[list[PageKey]]:
    """``count`` chains of ``length`` pages that share their first ``shared`` pages."""
    rng = np.random.default_rng(seed)
    trunk = rng.integers(0, 30_000, size=shared * 16)
    return [page_keys(namespace, np.concatenate([trunk, rng.integers(0, 30_000, size=(length - shared) * 16)]), 16)
            for _ in range(count)]


def test_places_follow_the_chain(namespace: bytes) -> None:
    keys = page_keys(namespace, np.arange(16 * 40), 16)
    for i, k in enumerate(keys):
        assert k.place == ChainPlace(i, keys[i - i % SEGMENT_PAGES].digest)
    # Grown in steps (the vLLM scheduler's way), the keys and places are the same.
    digests = [k.digest for k in keys]
    grown: list[PageKey] = []
    for cut in (3, 17, 32, 40):
        grown += chain_keys(namespace, grown, digests[len(grown):cut])
    assert [(k, k.place) for k in grown] == [(k, k.place) for k in keys]
    # From an engine's hex digests with those before them (SGLang's prefix_keys), from page 0 or not.
    hexes = [k.digest.hex() for k in keys]
    for cut in (0, 7, 16, 21):
        placed = keys_from_hex(namespace, hexes[cut:], hexes[:cut])
        assert [(k, k.place) for k in placed] == [(k, k.place) for k in keys[cut:]]
    assert all(k.place is None for k in keys_from_hex(namespace, hexes))


def test_a_place_is_not_part_of_the_identity_and_travels(namespace: bytes) -> None:
    key = page_keys(namespace, np.arange(16 * 20), 16)[19]
    bare = PageKey(key.namespace, key.digest)
    assert bare == key and hash(bare) == hash(key) and {bare: 1}[key] == 1
    assert PageKey.from_wire(key.wire()).place == key.place and PageKey.from_wire(bare.wire()).place is None
    for bad in ([key.namespace.hex()], [*key.wire()[:3]], [*key.wire()[:2], -1, key.digest.hex()],
                [*key.wire()[:2], True, key.digest.hex()], [*key.wire()[:2], 3, "00"], [1, 2]):
        with pytest.raises(ValueError):
            PageKey.from_wire(bad)


def test_a_query_is_cut_into_its_segments(namespace: bytes) -> None:
    keys = page_keys(namespace, np.arange(16 * 50), 16)
    q = SegmentQuery.of(keys[5:37])                       # starts at offset 5 of segment 0
    assert q is not None and q.first_page.tolist() == [-5, 11, 27]
    assert [bytes(f) for f in q.fields] == [keys[h].digest[:16] for h in (0, 16, 32)]
    assert SegmentQuery.of(keys[16:32]).first_page.tolist() == [0]         # type: ignore[union-attr]
    assert SegmentQuery.of(_flat(keys, namespace)) is None                  # no places: per-page fields
    assert SegmentQuery.of(keys[:3] + keys[4:8]) is None                    # not consecutive


def test_lookups_match_the_per_page_schema(redis_server: RedisServer) -> None:
    """Random holdings of branching chains (more branches than an offset keeps, so some pages go
    to per-page fields), published and partly withdrawn in a placed namespace and, as placeless
    keys, in a twin namespace: every lookup, from any page of any chain, gives the same runs."""
    spec = PageSpec(2, 1024, 16)
    placed_ns = Namespace("seg", "bfloat16", "x", spec, extra="placed").digest
    flat_ns = Namespace("seg", "bfloat16", "x", spec, extra="flat").digest
    nodes = [RedisIndex(redis_server.url, f"n{i}") for i in range(3)]
    reader = RedisIndex(redis_server.url, None)
    rng = random.Random(7)
    try:
        for n in nodes:
            n.heartbeat(NodeInfo(str(n.node_id)), 30)
        chains = _branches(placed_ns, 20, MAX_TAGS + 3, 60, seed=1) + _branches(placed_ns, 3, 3, 40, seed=2)
        published: list[tuple[RedisIndex, PageKey, Location]] = []
        slot = 0
        for chain in chains:
            for n in nodes:
                held = rng.randrange(len(chain) + 1)
                for key in chain[:held]:
                    if rng.random() < 0.9:              # holes too
                        slot += 1
                        loc = Location(str(n.node_id), MEDIA[rng.randrange(3)], slot, rng.randrange(1, 1 << 40))
                        published.append((n, key, loc))
                        if rng.random() < 0.1:          # the same page in a second medium
                            published.append((n, key, Location(loc.node, "cxl", slot + 100_000, 5)))
        rng.shuffle(published)
        for node in nodes:
            mine = [(k, loc) for n, k, loc in published if n is node]
            for s in range(0, len(mine), 97):
                node.publish(mine[s:s + 97])
                node.publish([(PageKey(flat_ns, k.digest), loc) for k, loc in mine[s:s + 97]])
        gone = rng.sample(published, len(published) // 5)
        for n, key, loc in gone:
            n.withdraw([(key, loc)])
            n.withdraw([(PageKey(flat_ns, key.digest), loc)])
        raw = redis.Redis(unix_socket_path=str(redis_server.socket))
        summaries = [parse_summary(v) for v in raw.hvals(segment_key(placed_ns))]
        assert all(sm is not None and sm.layers <= MAX_TAGS for sm in summaries)
        assert any(sm.marks for sm in summaries if sm), "no offset overflowed: the test does not reach per-page fields"
        assert raw.exists(flat_key(loc_key(placed_ns))) == 0            # every page there was placed
        looked = 0
        for chain in chains:
            for start in (0, 1, 15, 16, 23):
                for end in (start + 1, start + 17, len(chain)):
                    got, want = reader.longest_prefix(chain[start:end]), reader.longest_prefix(
                        _flat(chain[start:end], flat_ns))
                    assert _view(got) == _view(want), (start, end)
                    looked += bool(want)
        assert looked > 20
    finally:
        reader.close()
        for n in nodes:
            n.close()


def test_a_placeless_publisher_in_a_placed_namespace_is_seen(redis_server: RedisServer, namespace: bytes,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = RedisIndex(redis_server.url, "a"), RedisIndex(redis_server.url, "b")
    reader = RedisIndex(redis_server.url, None)
    raw = redis.Redis(unix_socket_path=str(redis_server.socket))
    try:
        a.heartbeat(NodeInfo("a"), 30)
        b.heartbeat(NodeInfo("b"), 30)
        keys = page_keys(namespace, np.arange(16 * 40), 16)
        a.publish([(k, Location("a", "cpu_dram", i, 1)) for i, k in enumerate(keys[:10])])
        flat = [(k, Location("b", "cxl", i, 2)) for i, k in enumerate(_flat(keys[:30], namespace))]
        b.publish(flat)
        assert raw.exists(flat_key(loc_key(namespace))) == 1
        trips: list[int] = []
        send = reader._send_then       # every round trip goes through it
        monkeypatch.setattr(reader, "_send_then", lambda packed, n, then: trips.append(n) or send(packed, n, then))
        for _ in range(2):
            got = reader.longest_prefix(keys)
            assert {n: m.pages for n, m in got.items()} == {"a": 10, "b": 30}
            assert got["b"].slots.tolist() == list(range(30))
        # The flag is learnt by the first lookup (a second round for the per-page fields); the next
        # reads them in its only round.
        assert trips == [4, 1, 5]
        b.withdraw(flat)
        assert raw.exists(flat_key(loc_key(namespace))) == 0            # no placeless page left
        for _ in range(2):
            assert {n: m.pages for n, m in reader.longest_prefix(keys).items()} == {"a": 10}
        assert trips[3:] == [5, 4]                                      # the flag's absence is learnt too
    finally:
        for c in (a, b, reader):
            c.close()


def test_an_overflowed_page_is_withdrawn_from_its_own_field(redis_server: RedisServer, namespace: bytes) -> None:
    a = RedisIndex(redis_server.url, "a")
    reader = RedisIndex(redis_server.url, None)
    raw = redis.Redis(unix_socket_path=str(redis_server.socket))
    try:
        a.heartbeat(NodeInfo("a"), 30)
        chains = _branches(namespace, 4, MAX_TAGS + 2, 16, seed=3)     # they part at offset 4 of segment 0
        entries = [[(k, Location("a", "cpu_dram", 100 * c + i, 1)) for i, k in enumerate(chain)]
                   for c, chain in enumerate(chains)]
        for e in entries:
            a.publish(e)
        overflowed = [k.digest[:16] for k, _ in entries[-1][4:]]
        assert all(raw.hexists(loc_key(namespace), f) for f in overflowed)
        for chain in chains:
            assert reader.longest_prefix(chain)["a"].pages == 16
        a.withdraw(entries[-1][4:])
        assert not any(raw.hexists(loc_key(namespace), f) for f in overflowed)
        assert reader.longest_prefix(chains[-1])["a"].pages == 4
        # Room again at those offsets: a page that comes back goes to the segment.
        a.withdraw(entries[0][4:])
        a.publish(entries[-1][4:])
        assert not any(raw.hexists(loc_key(namespace), f) for f in overflowed)
        assert reader.longest_prefix(chains[-1])["a"].pages == 16
    finally:
        a.close()
        reader.close()


@pytest.mark.parametrize("decoder", ["native", "numpy"])
def test_hostile_segment_values_end_the_run_and_are_counted(redis_server: RedisServer, namespace: bytes,
                                                            decoder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Segment values cut short, padded or empty, unknown media, offsets past the segment: misses
    counted through ``on_refused``, never a raise or a wrong location."""
    if decoder == "numpy":
        monkeypatch.setattr(record_runs, "_native", None)
    else:
        from pof_connector.index import segments
        if not segments.NATIVE:
            pytest.skip("the native segment decoder was not built (test_segments_native says whether it must be)")
    a = RedisIndex(redis_server.url, "a")
    reader = RedisIndex(redis_server.url, None)
    raw = redis.Redis(unix_socket_path=str(redis_server.socket))
    refused: list[tuple[int, str]] = []
    reader.on_refused = lambda n, why: refused.append((n, why))
    try:
        a.heartbeat(NodeInfo("a"), 30)
        keys = page_keys(namespace, np.arange(16 * 48), 16)
        a.publish([(k, Location("a", "cpu_dram", i, 1)) for i, k in enumerate(keys)])
        key, field = segment_key(namespace), keys[16].digest[:16]
        good = raw.hget(key, field)
        assert good is not None and parse_summary(good) is not None
        for bad in (good + b"\x00", good[:-1], b""):
            raw.hset(key, field, bad)
            refused.clear()
            assert {n: m.pages for n, m in reader.longest_prefix(keys).items()} == {"a": 16}
            assert refused == [(1, "malformed")]
        sm = parse_summary(good)
        assert sm is not None and len(sm.holders) == 1
        inc, medium, masks = sm.holders[0]
        # Page 19 (offset 3) in a medium no build knows, not in its own: the run stops before it.
        sm.holders = [(inc, medium, [masks[0] & ~(1 << 3)]), (inc, 200, [1 << 3])]
        raw.hset(key, field, encode_summary(sm))
        refused.clear()
        got = reader.longest_prefix(keys)
        assert got["a"].pages == 19 and refused == [(1, "unknown_medium")]
        assert got["a"].slots.tolist() == list(range(19))
    finally:
        a.close()
        reader.close()


def test_sweep_drops_dead_segment_records_and_keeps_markers(redis_server: RedisServer, namespace: bytes) -> None:
    a = RedisIndex(redis_server.url, "a")
    a.heartbeat(NodeInfo("a"), 0.3)
    chains = _branches(namespace, 4, MAX_TAGS + 1, 8, seed=4)
    for c, chain in enumerate(chains):
        a.publish([(k, Location("a", "cpu_dram", 10 * c + i, 1)) for i, k in enumerate(chain)])
    time.sleep(0.4)
    b = RedisIndex(redis_server.url, "b")
    try:
        b.heartbeat(NodeInfo("b"), 10)             # expires a's incarnation in the server's books
        b.publish([(chains[0][0], Location("b", "cxl", 3, 1))])
        locations = 4 + (MAX_TAGS + 1) * 4         # the shared pages once, each chain's own 4
        assert b.stats()["locations"] == locations + 1
        assert b.sweep(namespace) == locations
        assert b.stats()["locations"] == 1
        raw = redis.Redis(unix_socket_path=str(redis_server.socket))
        sm = parse_summary(raw.hget(segment_key(namespace), chains[0][0].digest[:16]) or b"")
        assert sm is not None and sm.marks == 0b1111 << 4      # the marks of offsets 4-7 stay
        assert [h[0] for h in sm.holders] == [b.incarnation]   # a's holder entries went with its records
        assert raw.hlen(records_key(namespace)) == 1
    finally:
        a.close()
        b.close()
