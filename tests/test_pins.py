"""Prefix pins: soft ones evicted last, hard ones not at all while they live; recorded in the index,
written back after the index lost them, expired on time, listed and removed (CLI desk and API)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest
from fastapi.testclient import TestClient

from pof_connector.config import PofConfig
from pof_connector.index import LocalIndex, LocalTable
from pof_connector.locality.api import make_app
from pof_connector.locality.locator import Locator
from pof_connector.pages.keys import PageKey, page_keys
from pof_connector.pages.layout import PageSpec
from pof_connector.pins import HARD, SOFT, Pin, PinBook, PinError
from pof_connector.pins.pin_desk import PinDesk
from pof_connector.pool import Pool
from pof_connector.pool.pin_copies import placed, rank
from pof_connector.tiers.base import slot_bytes_for
from pof_connector.tiers.slot_table import KEEP_HARD, KEEP_NONE, KEEP_SOFT, SlotTable

SPEC = PageSpec(num_layers=2, segment_bytes=1024, page_tokens=16)
SLOT = slot_bytes_for(SPEC)


def key(i: int) -> PageKey:
    return PageKey(bytes(16), i.to_bytes(32, "little"))


def content(k: PageKey) -> list[np.ndarray]:
    rng = np.random.default_rng(int.from_bytes(k.digest[:8], "little"))
    return [rng.integers(0, 255, SPEC.segment_bytes, dtype=np.uint8) for _ in range(SPEC.num_layers)]


def test_soft_pins_go_last_and_hard_pins_never() -> None:
    t = SlotTable(range(3))
    levels = {key(0): KEEP_HARD, key(1): KEEP_SOFT}
    t.set_keep(lambda k: levels.get(k, KEEP_NONE))
    for i in range(3):
        t.prepare_store(key(i))
        t.complete_store(key(i), ok=True)
    got = t.prepare_store(key(3))             # 2 is the one unpinned page, though the newest
    assert got is not None and got[1] == key(2)
    t.complete_store(key(3), ok=True)
    levels[key(3)] = KEEP_HARD
    got = t.prepare_store(key(4))             # only soft is left to give
    assert got is not None and got[1] == key(1)
    t.complete_store(key(4), ok=True)
    levels[key(4)] = KEEP_HARD
    assert t.prepare_store(key(5)) is None and not t.can_allocate()      # all hard: refused


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def table() -> LocalTable:
    return LocalTable()


@pytest.fixture
def pool(runtime_dir: str, namespace: bytes, table: LocalTable) -> Iterator[Pool]:
    config = PofConfig.from_mapping({"node_id": "a", "index_url": "local", "runtime_dir": runtime_dir,
                                     "heartbeat_s": 0.05, "node_ttl_s": 2.0,
                                     "tiers": {"cpu_dram": {"size": 6 * SLOT}}})
    p = Pool(config, SPEC, namespace, index=LocalIndex("a", table), meta={"model": "m"})
    yield p
    p.close()


def test_a_hard_pin_keeps_a_prefix_through_a_flood_until_it_expires(pool: Pool, table: LocalTable) -> None:
    clock = Clock()
    desk = PinDesk(LocalIndex(None, table), Locator(LocalIndex(None, table), nodes_ttl_s=0.0), clock=clock)
    book = PinBook(clock=clock)
    for tier in pool.tiers:
        tier.set_keep(book.keep)
    system = list(range(16 * 3))
    keys = pool.keys_for(system, cache_salt="org")
    pool.store([(k, content(k)) for k in keys]).result()
    pin = desk.pin([*system, 7, 7], model="m", cache_salt="org", ttl_s=60, kind=HARD, label="acme")
    assert pin.keys == tuple(keys) and pin.tokens == 48
    book.sync(pool.index, write_back=True)
    for r in range(6):                                            # 6 x 3 new pages through 6 slots
        more = pool.keys_for(np.arange(48) + 1000 * (r + 1))
        pool.store([(k, content(k)) for k in more]).result()
    assert pool.lookup(keys).pages == 3                           # the pinned prefix stayed
    clock.now += 61                                               # the pin ends
    book.sync(pool.index, write_back=True)
    assert desk.list() == [] and table.pins == {}                 # the expired record was tidied away
    for r in range(2):
        more = pool.keys_for(np.arange(48) + 50_000 * (r + 1))
        pool.store([(k, content(k)) for k in more]).result()
    assert pool.lookup(keys).pages == 0                           # plain LRU again


def test_pins_are_written_back_after_the_index_lost_them(pool: Pool, table: LocalTable) -> None:
    desk = PinDesk(LocalIndex(None, table), Locator(LocalIndex(None, table), nodes_ttl_s=0.0))
    pin = desk.pin(list(range(32)), model=None, cache_salt=None, ttl_s=600, kind=SOFT)
    book = pool._membership.pins
    book.sync(pool.index, write_back=True)
    assert [p.pin_id for p in book.pins()] == [pin.pin_id]
    table.pins.clear()                                            # the index restarted empty
    book.sync(pool.index)                                         # an ordinary read: not a loss
    assert book.pins() == []
    book.set([pin])
    book.sync(pool.index, write_back=True)                       # a fresh registration: written back
    assert [p.pin_id for p in desk.list()] == [pin.pin_id]
    assert desk.remove(pin.pin_id) and not desk.remove(pin.pin_id)
    book.sync(pool.index)
    assert book.pins() == []                                      # removed is removed


def test_a_restarted_node_learns_the_pins_from_the_index(pool: Pool, table: LocalTable) -> None:
    desk = PinDesk(LocalIndex(None, table), Locator(LocalIndex(None, table), nodes_ttl_s=0.0))
    pin = desk.pin(list(range(32)), model="m", cache_salt=None, ttl_s=600, kind=HARD)
    fresh = PinBook()
    fresh.sync(LocalIndex(None, table))
    assert [p.pin_id for p in fresh.pins()] == [pin.pin_id]
    assert fresh.keep(pin.keys[0]) == KEEP_HARD and fresh.keep(key(9)) == KEEP_NONE


@pytest.mark.parametrize("raw", [
    "not json", "[]", json.dumps({"id": "zz", "keys": [], "kind": "soft", "expires_at": 1}),
    json.dumps({"id": "0" * 16, "keys": ["ab"], "kind": "soft", "expires_at": 1}),
    json.dumps({"id": "0" * 16, "keys": [], "kind": "forever", "expires_at": 1}),
    json.dumps({"id": "0" * 16, "keys": [], "kind": "soft", "expires_at": "soon"}),
    json.dumps({"id": "0" * 16, "keys": [], "kind": "soft", "expires_at": 1, "replicas": -1}),
    json.dumps({"id": "0" * 16, "keys": [], "kind": "soft", "expires_at": 1, "tenant": "not a name!"}),
])
def test_a_malformed_pin_record_is_refused(raw: str) -> None:
    with pytest.raises(PinError):
        Pin.from_json(raw)


def test_pin_requests_are_checked(pool: Pool, table: LocalTable) -> None:
    desk = PinDesk(LocalIndex(None, table), Locator(LocalIndex(None, table), nodes_ttl_s=0.0))
    with pytest.raises(PinError, match="kind: expected 'soft'"):
        desk.pin(list(range(32)), model="m", cache_salt=None, ttl_s=60, kind="forever")
    with pytest.raises(PinError, match="ttl_s"):
        desk.pin(list(range(32)), model="m", cache_salt=None, ttl_s=0, kind=SOFT)
    with pytest.raises(PinError, match="fill no page"):
        desk.pin(list(range(5)), model="m", cache_salt=None, ttl_s=60, kind=SOFT)


def test_the_api_pins_only_with_a_token(pool: Pool, table: LocalTable) -> None:
    body = {"model": "m", "tokens": list(range(32)), "ttl_s": 60, "kind": "hard", "cache_salt": "s3cret",
            "replicas": 2, "tenant": "acme"}
    open_api = TestClient(make_app(LocalIndex(None, table)))
    assert open_api.post("/v1/pins", json=body).status_code == 403
    api = TestClient(make_app(LocalIndex(None, table), token="t0k"))
    assert api.post("/v1/pins", json=body).status_code == 401
    auth = {"Authorization": "Bearer t0k"}
    r = api.post("/v1/pins", json=body, headers=auth)
    assert r.status_code == 201, r.text
    made = r.json()
    assert made["kind"] == "hard" and made["pages"] == 2 and "s3cret" not in r.text
    assert (made["replicas"], made["tenant"]) == (2, "acme")
    listed = api.get("/v1/pins", headers=auth).json()
    assert [p["id"] for p in listed] == [made["id"]]
    assert "s3cret" not in json.dumps(table.pins)
    assert api.delete(f"/v1/pins/{made['id']}", headers=auth).status_code == 200
    assert api.delete(f"/v1/pins/{made['id']}", headers=auth).status_code == 404
    bad = api.post("/v1/pins", json={**body, "kind": "forever"}, headers=auth)
    assert bad.status_code == 422 and "kind" in bad.text
    bad = api.post("/v1/pins", json={**body, "tenant": "a salt, not a name"}, headers=auth)
    assert bad.status_code == 422 and "tenant" in bad.text


# ---- replicas: copies of a pinned prefix on other nodes ----------------------------------------


def cxl_pool(name: str, runtime_dir: str, shm_path: str, namespace: bytes, table: LocalTable) -> Pool:
    config = PofConfig.from_mapping({"node_id": name, "index_url": "local", "runtime_dir": runtime_dir,
                                     "heartbeat_s": 0.05, "node_ttl_s": 2.0,
                                     "tiers": {"cxl": {"path": shm_path, "size": 4 * 8 * SLOT, "partitions": 4}}})
    return Pool(config, SPEC, namespace, index=LocalIndex(name, table), meta={"model": "m"})


def copy_round(p: Pool) -> int:
    """One check of every pin on ``p`` now (the heartbeat does it every PinBook.SYNC_EVERY_S, and
    once at a node's start); the pages ``p`` copied so far, by whichever check."""
    m = p._membership
    m.pins.sync(p.index)
    assert m.copies is not None
    for pin in m.pins.pins():
        m.copies.check(pin)
    return int(p.stats.get("pin_copied_pages"))


def test_rank_is_the_same_everywhere_and_differs_by_pin() -> None:
    nodes = [f"n{i}" for i in range(8)]
    assert rank("0" * 16, nodes) == rank("0" * 16, list(reversed(nodes)))
    assert rank("0" * 16, nodes) != rank("1" * 16, nodes)


def test_a_pinned_prefix_with_two_replicas_survives_a_flood_and_its_holders_death(
        runtime_dir: str, shm_path: str, namespace: bytes, table: LocalTable) -> None:
    a, b = (cxl_pool(n, runtime_dir, shm_path, namespace, table) for n in ("a", "b"))
    c: Pool | None = None
    try:
        desk = PinDesk(LocalIndex(None, table), Locator(LocalIndex(None, table), nodes_ttl_s=0.0))
        system = list(range(16 * 3))
        keys = a.keys_for(system, cache_salt="org")
        a.store([(k, content(k)) for k in keys]).result()
        assert {s.node for s in b.lookup(keys).sources} == {"a"}      # b reads a's partition
        pin = desk.pin(system, model="m", cache_salt="org", ttl_s=600, kind=HARD, replicas=2, tenant="acme")
        assert copy_round(a) == 0                                      # a holds it: nothing to copy
        assert copy_round(b) == 3 and copy_round(b) == 3               # b copies it once
        assert all(b.contains(k) for k in keys)
        assert set(LocalIndex(None, table).longest_prefix(keys)) == {"a", "b"}
        bufs = [np.zeros(SPEC.page_bytes, np.uint8) for _ in keys]
        h = b.load(keys, b.lookup(keys).sources, bufs)
        assert h.wait(5) and h.failed == {}
        assert [s.node for s in b.lookup(keys).sources] == ["b"] * 3
        for p in (a, b):                                               # a flood through both nodes' 8 slots
            for r in range(4):
                more = p.keys_for(np.arange(48) + 1000 * (r + 1) + (7 if p is b else 0))
                p.store([(k, content(k)) for k in more]).result()
            assert all(p.contains(k) for k in keys)                    # the hard pin kept every copy
        a.close()                                                      # the first holder is gone
        left = LocalIndex(None, table).longest_prefix(keys)
        assert set(left) == {"b"} and left["b"].pages == 3             # b's copy: still a full hit
        c = cxl_pool("c", runtime_dir, shm_path, namespace, table)
        assert c.lookup(keys).pages == 3
        assert copy_round(c) == 3                                      # c restores the second copy
        assert set(LocalIndex(None, table).longest_prefix(keys)) == {"b", "c"}
        assert pin.replicas == 2
    finally:
        for p in (a, b, c):
            if p is not None:
                p.close()


def test_only_the_first_ranked_node_copies(runtime_dir: str, shm_path: str, namespace: bytes,
                                           table: LocalTable) -> None:
    pools = [cxl_pool(n, runtime_dir, shm_path, namespace, table) for n in ("a", "b", "c")]
    try:
        desk = PinDesk(LocalIndex(None, table), Locator(LocalIndex(None, table), nodes_ttl_s=0.0))
        system = list(range(32))
        keys = pools[0].keys_for(system)
        pools[0].store([(k, content(k)) for k in keys]).result()
        pin = desk.pin(system, model="m", cache_salt=None, ttl_s=600, kind=SOFT, replicas=2)
        first = rank(pin.pin_id, ["b", "c"])[0]
        copied = {p.node_id: copy_round(p) for p in pools[1:]}
        assert copied == {first: 2, ({"b", "c"} - {first}).pop(): 0}
    finally:
        for p in pools:
            p.close()


def test_a_copy_that_cannot_be_read_stores_nothing(runtime_dir: str, shm_path: str, namespace: bytes,
                                                   table: LocalTable) -> None:
    a, b = (cxl_pool(n, runtime_dir, shm_path, namespace, table) for n in ("a", "b"))
    try:
        desk = PinDesk(LocalIndex(None, table), Locator(LocalIndex(None, table), nodes_ttl_s=0.0))
        system = list(range(32))
        keys = a.keys_for(system)
        a.store([(k, content(k)) for k in keys]).result()
        desk.pin(system, model="m", cache_salt=None, ttl_s=600, kind=SOFT, replicas=2)
        cxl = a.tiers[0]
        ref = cxl.find(keys[1], touch=False)
        assert ref is not None
        cxl._slot(ref.slot)[SPEC.header_bytes + 5] ^= 0xFF          # page 1's bytes go bad on a
        assert copy_round(b) == 1                                    # only the page that checks out
        assert b.contains(keys[0]) and not b.contains(keys[1])
        assert b.stats.get("pin_copy_failures") == 1
    finally:
        a.close()
        b.close()


def test_a_pins_keys_get_their_chain_places_back(namespace: bytes) -> None:
    keys = page_keys(namespace, list(range(16 * 40)), 16, cache_salt="org")          # 40 pages: 3 segments
    bare = [PageKey(k.namespace, k.digest) for k in keys]
    assert [k.place for k in placed(bare)] == [k.place for k in keys]
