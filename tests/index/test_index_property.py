"""Random publish / withdraw / evict / reclaim / spill / lease-expiry sequences from several nodes on a
real server: after every step, every lookup's runs (media, slots, generations) equal both what the
nodes hold (a model kept beside them) and a brute-force reading of the index's slot records,
summaries and per-page fields; and no summary bit lacks its record, nor a record its bit."""

from __future__ import annotations

import random
import time

import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pof_connector.index.base import MEDIA, Location, NodeInfo, PrefixMatch
from pof_connector.index.redis import RedisIndex, loc_key, records_key, segment_key
from pof_connector.index.segments import MAX_TAGS, tag
from pof_connector.index.server import RedisServer
from pof_connector.index.summary import parse_records, parse_summary
from pof_connector.pages.keys import SEGMENT_PAGES, PageKey, page_keys

NODES = ("a", "b", "c")
OPS = ["publish"] * 4 + ["withdraw", "evict", "reclaim", "spill", "expire"]
Held = dict[str, dict[PageKey, dict[int, tuple[int, int]]]]
"""Per holder node, per page, per medium code: (slot, generation)."""


def _chains(namespace: bytes, rng: random.Random) -> list[list[PageKey]]:
    """Branches that part inside segment 1 (more than an offset keeps: some go to per-page fields),
    and one that parts at a segment's head."""
    trunk = [rng.randrange(30_000) for _ in range(16 * 21)]
    out = []
    for _ in range(MAX_TAGS + 2):
        tail = [rng.randrange(30_000) for _ in range(16 * 19)]
        out.append(page_keys(namespace, trunk + tail, 16))
    out.append(page_keys(namespace, trunk[:16 * 16] + [rng.randrange(30_000) for _ in range(16 * 20)], 16))
    return out


def _expected(held: Held, keys: list[PageKey], live: set[str]) -> dict[str, tuple[list[int], list[int], list[int]]]:
    """Each live holder's leading run of ``keys``: of a page in two media, the lowest code."""
    out = {}
    for node in sorted(live):
        media, slots, gens = [], [], []
        for k in keys:
            there = held.get(node, {}).get(k)
            if not there:
                break
            code = min(there)
            media.append(code)
            slots.append(there[code][0])
            gens.append(there[code][1])
        if media:
            out[node] = (media, slots, gens)
    return out


def _brute(raw: redis.Redis, namespace: bytes, keys: list[PageKey], incs: dict[int, str]
           ) -> dict[str, tuple[list[int], list[int], list[int]]]:
    """The runs read off the index's raw contents: per page, its summary's layer for its tag, the
    records of every live incarnation at that (layer, offset), and the page's per-page field."""
    records = {f: parse_records(v) for f, v in raw.hgetall(records_key(namespace)).items()}
    summaries = {f: parse_summary(v) for f, v in raw.hgetall(segment_key(namespace)).items()}
    pages = raw.hgetall(loc_key(namespace))
    per_page: list[dict[str, dict[int, tuple[int, int]]]] = []
    for k in keys:
        assert k.place is not None
        field, o = k.place.head[:16], k.place.offset
        here: dict[str, dict[int, tuple[int, int]]] = {}
        sm = summaries.get(field)
        layer = next((la for la in range(sm.layers) if sm.tags.get(la * 16 + o) == tag(k.digest)), None) if sm else None
        for inc, node in incs.items():
            recs = records.get(field + inc.to_bytes(4, "little"), {})
            for (medium, la, off), loc in recs.items():
                if la == layer and off == o:
                    here.setdefault(node, {})[medium] = loc
        raw_recs = pages.get(k.digest[:16], b"")
        for p in range(0, len(raw_recs), 17):
            r = raw_recs[p:p + 17]
            inc = int.from_bytes(r[:4], "little")
            if inc in incs:
                here.setdefault(incs[inc], {})[r[4]] = (int.from_bytes(r[5:9], "little"),
                                                        int.from_bytes(r[9:17], "little", signed=True))
        per_page.append(here)
    held: Held = {}
    for k, here in zip(keys, per_page, strict=True):
        for node, media in here.items():
            held.setdefault(node, {})[k] = media
    return _expected(held, keys, set(incs.values()))


def _consistent(raw: redis.Redis, namespace: bytes) -> None:
    """Every summary bit has its record and every record its bit."""
    bits = set()
    for field, v in raw.hgetall(segment_key(namespace)).items():
        sm = parse_summary(v)
        assert sm is not None
        for inc, medium, masks in sm.holders:
            for la, m in enumerate(masks):
                bits |= {(field, inc, medium, la, o) for o in range(SEGMENT_PAGES) if m >> o & 1}
                assert all(la * 16 + o in sm.tags for o in range(SEGMENT_PAGES) if m >> o & 1)
    recs = set()
    for f, v in raw.hgetall(records_key(namespace)).items():
        for medium, la, o in parse_records(v):
            recs.add((f[:16], int.from_bytes(f[16:], "little"), medium, la, o))
    assert bits == recs


def _view(found: dict[str, PrefixMatch]) -> dict[str, tuple[list[int], list[int], list[int]]]:
    return {n: (m.media.tolist(), m.slots.tolist(), m.generations.tolist()) for n, m in found.items()}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_lookups_equal_the_slot_records(redis_server: RedisServer, seed: int) -> None:
    rng = random.Random(seed)
    namespace = rng.randbytes(16)
    raw = redis.Redis(unix_socket_path=str(redis_server.socket))
    clients = {n: RedisIndex(redis_server.url, n) for n in NODES}
    reader = RedisIndex(redis_server.url, None)
    held: Held = {}
    next_gen = iter(range(1, 1 << 30))
    found = overflowed = 0
    try:
        for c in clients.values():
            c.heartbeat(NodeInfo(str(c.node_id)), 30)
        chains = _chains(namespace, rng)
        pool = [k for chain in chains for k in chain]
        for step in range(40):
            # First each branch's pages of segment 1 (so some offsets overflow), then anything.
            op = "publish" if step < len(chains) else rng.choice(OPS)
            node = rng.choice(NODES)
            client = clients[node]
            mine = held.setdefault(node, {})
            if op == "publish":                     # a run of a chain, in some media
                chain = chains[step] if step < len(chains) else rng.choice(chains)
                start = 16 if step < len(chains) else rng.randrange(len(chain))
                batch = []
                for k in chain[start:start + (16 if step < len(chains) else rng.randrange(1, 40))]:
                    code = rng.choice((0, 0, 1, 2))
                    loc = (rng.randrange(1 << 20), next(next_gen))
                    mine.setdefault(k, {})[code] = loc
                    batch.append((k, Location(node, MEDIA[code], *loc)))
                client.publish(batch)
            elif op in ("withdraw", "evict", "reclaim") and mine:
                victims = rng.sample(sorted(mine, key=lambda k: k.digest), min(len(mine), rng.randrange(1, 20)))
                gone = []
                for k in victims:
                    code = rng.choice(sorted(mine[k]))
                    slot, gen = mine[k].pop(code)
                    gone.append((k, Location(node, MEDIA[code], slot, gen)))
                    if not mine[k]:
                        del mine[k]
                if op == "withdraw":               # a late withdraw of an older place changes nothing
                    k, loc = gone[0]
                    client.withdraw([(k, Location(node, loc.medium, loc.slot, loc.generation - 1))])
                client.withdraw(gone)
                if op == "reclaim":                 # the freed slots hold other pages now
                    again = []
                    for (_, loc), k in zip(gone, rng.sample(pool, len(gone)), strict=True):
                        new = (loc.slot, next(next_gen))
                        mine.setdefault(k, {})[MEDIA.index(loc.medium)] = new
                        again.append((k, Location(node, loc.medium, *new)))
                    client.publish(again)
            elif op == "spill":                     # pages this node wrote into another node's slots
                other = rng.choice([n for n in NODES if n != node])
                batch = []
                for k in rng.sample(pool, 5):
                    loc = (rng.randrange(1 << 20), next(next_gen))
                    held.setdefault(other, {}).setdefault(k, {})[1] = loc
                    batch.append((k, Location(other, MEDIA[1], *loc)))
                client.publish(batch)
            elif op == "expire":                    # its lease lapses; it comes back and re-publishes some
                client.heartbeat(NodeInfo(node), 0.05)
                time.sleep(0.07)
                assert node not in reader.longest_prefix(chains[0])
                assert client.heartbeat(NodeInfo(node), 30) is True
                keep = {k: m for k, m in mine.items() if rng.random() < 0.5}
                held[node] = keep
                client.publish([(k, Location(node, MEDIA[c], *loc)) for k, m in keep.items() for c, loc in m.items()])
            live_incs = {c.incarnation: n for n, c in clients.items() if c.incarnation is not None}
            for chain in rng.sample(chains, 3):
                start = rng.choice((0, 0, 5, 16, 21))
                keys = chain[start:start + rng.choice((3, 17, 40, len(chain)))]
                want = _expected(held, keys, set(NODES))
                assert _view(reader.longest_prefix(keys)) == want, (op, start)
                found += sum(len(m) for m, _, _ in want.values())
                assert _brute(raw, namespace, keys, live_incs) == want, (op, start)
            _consistent(raw, namespace)
            overflowed += raw.hlen(loc_key(namespace)) > 0
        assert found > 100 and overflowed, "the sequence reached no runs or no per-page field"
        swept = clients["a"].sweep(namespace)
        assert swept >= 0
        _consistent(raw, namespace)
        for chain in chains:
            assert _view(reader.longest_prefix(chain)) == _expected(held, chain, set(NODES))
    finally:
        raw.close()
        reader.close()
        for c in clients.values():
            c.close()
