from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pof_connector.config import PofConfig
from pof_connector.config.tenant_config import DEFAULT_TENANT
from pof_connector.index import LocalIndex, LocalTable, Location, NodeInfo
from pof_connector.index.redis import RedisIndex
from pof_connector.index.server import RedisServer
from pof_connector.pages import page_sum
from pof_connector.pages.keys import PageKey
from pof_connector.pages.layout import PageSpec
from pof_connector.pool import Pool
from pof_connector.pool import pool as pool_module
from pof_connector.tiers import SlotRef
from pof_connector.tiers.base import slot_bytes_for
from pof_connector.tiers.cxl import TRADE_FLOOR, TRADE_SHORT_S

SPEC = PageSpec(num_layers=3, segment_bytes=2048, page_tokens=16)


def content(k: PageKey) -> list[np.ndarray]:
    rng = np.random.default_rng(int.from_bytes(k.digest[:8], "little"))
    return [rng.integers(0, 255, SPEC.segment_bytes, dtype=np.uint8) for _ in range(SPEC.num_layers)]


def cfg(node: str, runtime_dir: str, index_url: str = "local", **tiers: dict[str, object]) -> PofConfig:
    return PofConfig.from_mapping({"node_id": node, "index_url": index_url, "runtime_dir": runtime_dir,
                                   "heartbeat_s": 0.05, "node_ttl_s": 2.0,
                                   "tiers": tiers or {"cpu_dram": {"size": "1MiB"}}})


def wait_for(pred, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def load_all(pool: Pool, keys: list[PageKey]) -> tuple[list[np.ndarray], dict[int, str], int]:
    lk = pool.lookup(keys)
    bufs = [np.zeros(SPEC.page_bytes, np.uint8) for _ in range(lk.pages)]
    h = pool.load(keys[:lk.pages], lk.sources, bufs)
    assert h.wait(10)
    return bufs, h.failed, lk.pages


def assert_pages(bufs: list[np.ndarray], keys: list[PageKey], skip: set[int] = frozenset()) -> None:  # type: ignore[assignment]
    for i, (buf, k) in enumerate(zip(bufs, keys, strict=False)):
        if i in skip:
            continue
        for layer, data in enumerate(content(k)):
            assert bytes(SPEC.segment(memoryview(buf), layer)) == data.tobytes(), (i, layer)


@pytest.fixture
def pool(runtime_dir: str, namespace: bytes) -> Iterator[Pool]:
    p = Pool(cfg("a", runtime_dir), SPEC, namespace)
    yield p
    p.close()


def test_store_lookup_load_layer_by_layer(pool: Pool) -> None:
    keys = pool.keys_for(np.arange(16 * 20 + 5))      # 20 full pages; the partial one is never stored
    assert len(keys) == 20
    assert pool.store([(k, content(k)) for k in keys[:12]]).result() == 12
    assert pool.store([(k, content(k)) for k in keys[:12]]).result() == 0     # already there
    lk = pool.lookup(keys)
    assert lk.pages == 12 and lk.per_tier() == {"cpu_dram": 12}
    bufs = [np.zeros(SPEC.page_bytes, np.uint8) for _ in range(12)]
    h = pool.load(keys[:12], lk.sources, bufs)
    for layer in range(SPEC.num_layers):
        assert h.wait_layer(layer, 5)
        for buf, k in zip(bufs, keys, strict=False):          # this layer is complete now
            assert bytes(SPEC.segment(memoryview(buf), layer)) == content(k)[layer].tobytes()
    assert h.wait(5) and h.failed == {}
    assert pool.stats.get("loaded_pages") == 12 and pool.stats.get("hit_pages", tier="cpu_dram") == 12


def test_corrupted_or_evicted_pages_are_reported_not_returned(pool: Pool) -> None:
    keys = pool.keys_for(np.arange(16 * 4))
    pool.store([(k, content(k)) for k in keys]).result()
    lk = pool.lookup(keys)
    tier = pool.tiers[0]
    ref = tier.find(keys[1])
    assert ref is not None
    tier.region[tier.slot_offset(ref.slot) + SPEC.segment_offset(2) + 7] ^= 0xFF     # a flipped bit
    tier.remove(keys[3])                                                              # evicted meanwhile
    bufs = [np.zeros(SPEC.page_bytes, np.uint8) for _ in range(4)]
    h = pool.load(keys, lk.sources, bufs)
    assert h.wait(5)
    assert h.failed == {1: "bad_checksum", 3: "evicted"}
    assert_pages(bufs, keys, skip={1, 3})
    assert pool.stats.get("load_failures") == 2


def test_eviction_demotes_then_withdraws(runtime_dir: str, namespace: bytes, shm_path: str) -> None:
    table = LocalTable()
    tiers = {"cpu_dram": {"size": 4 * 8192}, "cxl": {"path": shm_path, "size": "1MiB", "partitions": 2}}
    pool = Pool(cfg("a", runtime_dir, **tiers), SPEC, namespace, index=LocalIndex("a", table))
    reader = LocalIndex(None, table)
    try:
        dram, cxl = pool.tiers
        keys = pool.keys_for(np.arange(16 * (dram.capacity_slots + cxl.capacity_slots + 10)))
        wait_for(lambda: pool.index.nodes() != [])
        pool.store([(k, content(k)) for k in keys]).result()
        kept = dram.capacity_slots + cxl.capacity_slots
        lk = pool.lookup(keys)
        assert lk.pages == kept            # the chain's head stays; its tail was evicted first
        assert lk.per_tier() == {"cpu_dram": dram.capacity_slots, "cxl": cxl.capacity_slots}
        assert reader.longest_prefix(keys)["a"].pages == kept
        assert reader.longest_prefix(keys[kept:]) == {}            # evicted pages were withdrawn
        bufs, failed, n = load_all(pool, keys)
        assert failed == {} and n == kept
        assert_pages(bufs, keys)
        assert pool.stats.get("demoted_pages") > 0
    finally:
        pool.close()


def test_two_nodes_share_a_cxl_region_through_redis(runtime_dir: str, namespace: bytes, shm_path: str,
                                                    redis_server: RedisServer) -> None:
    tiers = {"cxl": {"path": shm_path, "size": "2MiB", "partitions": 4}}
    a = Pool(cfg("a", runtime_dir, redis_server.url, **tiers), SPEC, namespace)
    b = Pool(cfg("b", runtime_dir, redis_server.url, **tiers), SPEC, namespace)
    c = Pool(cfg("c", runtime_dir, redis_server.url, cpu_dram={"size": "1MiB"}), SPEC, namespace)
    try:
        keys = a.keys_for(np.arange(16 * 10))
        a.store([(k, content(k)) for k in keys[:7]]).result()
        c.store([(k, content(k)) for k in keys]).result()
        wait_for(lambda: b.lookup(keys).pages == 7)
        lk = b.lookup(keys)
        assert {s.node for s in lk.sources} == {"a"} and lk.elsewhere == {"c": 10}   # c's DRAM: not readable
        bufs, failed, n = load_all(b, keys)
        assert failed == {} and n == 7
        assert_pages(bufs, keys)
        # a evicts everything; b's plan made before that must fail validation, never return a page.
        for k in keys[:7]:
            a.tiers[0].remove(k)
        bufs2 = [np.zeros(SPEC.page_bytes, np.uint8) for _ in range(7)]
        h = b.load(keys[:7], lk.sources, bufs2)
        assert h.wait(5) and set(h.failed) == set(range(7))
    finally:
        for p in (a, b, c):
            p.close()


def test_a_node_short_of_room_gets_the_slots_its_neighbour_left_unused(runtime_dir: str, namespace: bytes,
                                                                        shm_path: str,
                                                                        redis_server: RedisServer) -> None:
    """Two nodes write one region: b's pages go unused while a evicts its own for room. On their
    heartbeats b gives a the slots of its coldest pages (withdrawing them from the index), so a
    holds more than its share; every page either node still finds loads byte for byte."""
    tiers = {"cxl": {"path": shm_path, "size": "2MiB", "partitions": 2}}
    a = Pool(cfg("a", runtime_dir, redis_server.url, **tiers), SPEC, namespace)
    b = Pool(cfg("b", runtime_dir, redis_server.url, **tiers), SPEC, namespace)
    try:
        share = a.tiers[0].capacity_slots
        cold = b.keys_for(np.arange(16 * share) + 1_000_000)
        b.store([(k, content(k)) for k in cold]).result()
        hot = a.keys_for(np.arange(16 * 4 * share))
        a.store([(k, content(k)) for k in hot[:share + 1]]).result()      # one more than its share: a evicts
        time.sleep(1.2)          # b's pages have gone unused past TRADE_MIN_UNUSED_S
        wait_for(lambda: a.stats.get("adopted_slots") > 0)
        for i in range(share + 1, 4 * share, 4):        # a keeps storing, and evicting when full
            a.store([(k, content(k)) for k in hot[i:i + 4]]).result()
        # b gives a step of slots a heartbeat for TRADE_SHORT_S after a's last eviction, down to its
        # floor: the checks below read a settled trade (on a loaded host a check between two steps
        # saw pages that b's next step dropped, and their loads fail, as after any eviction)
        floor = max(1, b.tiers[0].first_share // TRADE_FLOOR)
        wait_for(lambda: b.tiers[0].capacity_slots == floor, timeout=TRADE_SHORT_S)
        wait_for(lambda: b.stats.get("given_slots") == a.stats.get("adopted_slots"))
        given = int(b.stats.get("given_slots"))
        assert given == share - floor
        assert share < a.tiers[0].capacity_slots == share + given
        assert b.tiers[0].capacity_slots == share - given >= share // 4
        wait_for(lambda: a.lookup(cold).pages == b.tiers[0].used_slots)     # withdrawn as evicted
        bufs, failed, n = load_all(a, cold)
        assert failed == {} and n == b.tiers[0].used_slots
        assert_pages(bufs, cold)
        held = [k for k in hot if a.contains(k)]
        assert len(held) > share                 # more than a's share: some sit in slots b gave
        wait_for(lambda: all(b.lookup([k]).pages == 1 for k in held))
        sources = [b.lookup([k]).sources[0] for k in held]
        bufs = [np.zeros(SPEC.page_bytes, np.uint8) for _ in held]
        h = b.load(held, sources, bufs)
        assert h.wait(10) and h.failed == {}
        assert_pages(bufs, held)
    finally:
        a.close()
        b.close()


def test_a_page_stored_the_moment_a_node_starts_is_found_at_once(runtime_dir: str, namespace: bytes,
                                                                 shm_path: str, redis_server: RedisServer) -> None:
    """A node registers before its constructor returns. It did so on its heartbeat thread: until
    that ran, the node was missing from the node list and its publishes were dropped, so another
    node found nothing of what it had just stored (CI: an SGLang MLA rank found none of rank 0's
    pages on a busy host)."""
    tiers = {"cxl": {"path": shm_path, "size": "2MiB", "partitions": 4}}
    b = Pool(cfg("b", runtime_dir, redis_server.url, **tiers), SPEC, namespace)
    a = None
    try:
        for _ in range(5):
            a = Pool(cfg("a", runtime_dir, redis_server.url, **tiers), SPEC, namespace)
            assert "a" in {n.node_id for n in b.index.nodes()}
            keys = a.keys_for(np.random.default_rng().integers(0, 1000, 16 * 3))
            a.store([(k, content(k)) for k in keys]).result()
            assert b.lookup(keys).pages == 3
            a.close()
            a = None
    finally:
        for p in (a, b):
            if p is not None:
                p.close()


def test_a_chain_split_over_nodes_is_found_whole(runtime_dir: str, namespace: bytes, shm_path: str,
                                                redis_server: RedisServer) -> None:
    """a holds a prompt's head, b its tail (as after a spill, or an eviction on one node only):
    c's lookup finds all of it, and reads each part from its holder."""
    tiers = {"cxl": {"path": shm_path, "size": "2MiB", "partitions": 4}}
    a = Pool(cfg("a", runtime_dir, redis_server.url, **tiers), SPEC, namespace)
    b = Pool(cfg("b", runtime_dir, redis_server.url, **tiers), SPEC, namespace)
    c = Pool(cfg("c", runtime_dir, redis_server.url, **tiers), SPEC, namespace)
    try:
        keys = a.keys_for(np.arange(16 * 10))
        a.store([(k, content(k)) for k in keys[:4]]).result()
        b.store([(k, content(k)) for k in keys[4:8]]).result()
        wait_for(lambda: c.lookup(keys).pages == 8)
        lk = c.lookup(keys)
        assert [s.node for s in lk.sources] == ["a"] * 4 + ["b"] * 4
        bufs, failed, n = load_all(c, keys)
        assert failed == {} and n == 8
        assert_pages(bufs, keys)
        assert b.lookup(keys).pages == 8          # b too: a's head, then its own tail
        # Without the head nothing counts: a page is only of use after all pages before it.
        a.tiers[0].remove(keys[0])
        a.index.withdraw([(keys[0], lk.sources[0])])
        assert c.lookup(keys).pages == 0 and b.lookup(keys).pages == 0
    finally:
        for p in (a, b, c):
            p.close()


def test_a_peer_that_joined_after_the_last_node_refresh_is_readable_at_once(
        runtime_dir: str, namespace: bytes, shm_path: str, redis_server: RedisServer) -> None:
    """A scheduler plans a load from a peer it just learnt of; the worker's node list may be older
    (slow heartbeats): it must refresh rather than refuse the peer's pages as unreachable."""
    tiers = {"cxl": {"path": shm_path, "size": "2MiB", "partitions": 4}}
    slow = PofConfig.from_mapping({"node_id": "b", "index_url": redis_server.url, "runtime_dir": runtime_dir,
                                   "heartbeat_s": 30.0, "node_ttl_s": 60.0, "tiers": tiers})
    b = Pool(slow, SPEC, namespace)
    a = None
    try:
        b.lookup(b.keys_for(np.arange(16)))          # b's node list is fresh now, without a
        assert not b.finder.readable("a", "cxl")
        a = Pool(cfg("a", runtime_dir, redis_server.url, **tiers), SPEC, namespace)
        keys = a.keys_for(np.arange(16 * 4))
        a.store([(k, content(k)) for k in keys]).result()
        time.sleep(0.1)
        bufs, failed, n = load_all(b, keys)
        assert failed == {} and n == 4
        assert_pages(bufs, keys)
    finally:
        for p in (a, b):
            if p is not None:
                p.close()


def test_client_role_answers_for_its_worker(runtime_dir: str, namespace: bytes, redis_server: RedisServer) -> None:
    worker = Pool(cfg("n1", runtime_dir, redis_server.url), SPEC, namespace)
    client = Pool(cfg("n1", runtime_dir, redis_server.url), SPEC, namespace, role="client")
    try:
        keys = worker.keys_for(np.arange(16 * 5))
        worker.store([(k, content(k)) for k in keys]).result()
        wait_for(lambda: client.lookup(keys).pages == 5)
        lk = client.lookup(keys)
        bufs = [np.zeros(SPEC.page_bytes, np.uint8) for _ in range(5)]
        h = worker.load(keys, lk.sources, bufs)       # the plan crosses processes in adapters
        assert h.wait(5) and h.failed == {}
        assert_pages(bufs, keys)
        with pytest.raises(RuntimeError):
            client.store([])
    finally:
        worker.close()
        client.close()


def test_index_down_means_fewer_hits_never_errors(runtime_dir: str, namespace: bytes) -> None:
    url = f"unix://{runtime_dir}/absent.sock"
    pool = Pool(cfg("a", runtime_dir, url), SPEC, namespace)
    client = Pool(cfg("a", runtime_dir, url), SPEC, namespace, role="client")
    try:
        keys = pool.keys_for(np.arange(16 * 3))
        assert pool.store([(k, content(k)) for k in keys]).result() == 3
        assert pool.lookup(keys).pages == 3          # from its own books
        assert client.lookup(keys).pages == 0        # nothing known: the engine recomputes
        wait_for(lambda: pool.stats.get("index_errors") >= 1)
    finally:
        pool.close()
        client.close()


def test_a_removed_cxl_region_is_dropped_not_fatal(runtime_dir: str, namespace: bytes, shm_path: str,
                                                   redis_server: RedisServer) -> None:
    tiers = {"cxl": {"path": shm_path, "size": "1MiB", "partitions": 2}, "cpu_dram": {"size": "1MiB"}}
    pool = Pool(cfg("a", runtime_dir, redis_server.url, **tiers), SPEC, namespace)
    client = Pool(cfg("a", runtime_dir, redis_server.url), SPEC, namespace, role="client")
    try:
        keys = pool.keys_for(np.arange(16 * 4))
        pool.store([(k, content(k)) for k in keys[:2]]).result()
        wait_for(lambda: client.lookup(keys).pages == 2)
        plan = client.lookup(keys)
        os.unlink(shm_path)                                  # somebody removes the region file
        wait_for(lambda: pool.stats.get("tier_errors", tier="cxl") == 1)
        wait_for(lambda: client.lookup(keys).pages == 0)     # its pages left the index
        bufs = [np.zeros(SPEC.page_bytes, np.uint8) for _ in range(2)]
        h = pool.load(keys[:2], plan.sources, bufs)
        assert h.wait(5) and set(h.failed.values()) == {"unreachable"}
        assert pool.store([(k, content(k)) for k in keys]).result() == 4     # now into DRAM
        assert pool.lookup(keys).per_tier() == {"cpu_dram": 4}
        bufs, failed, n = load_all(pool, keys)
        assert failed == {} and n == 4
        assert_pages(bufs, keys)
    finally:
        pool.close()
        client.close()


def test_embedded_index_is_restarted_by_its_host(runtime_dir: str, namespace: bytes) -> None:
    from pof_connector.index.embedded import PIDFILE, stop_embedded

    pool = Pool(cfg("a", runtime_dir, "embedded"), SPEC, namespace)
    client = Pool(cfg("a", runtime_dir, "embedded"), SPEC, namespace, role="client")
    try:
        keys = pool.keys_for(np.arange(16 * 3))
        pool.store([(k, content(k)) for k in keys]).result()
        wait_for(lambda: client.lookup(keys).pages == 3)
        first_pid = (Path(runtime_dir) / PIDFILE).read_text().split()[0]
        assert stop_embedded(runtime_dir)                    # the index server dies
        wait_for(lambda: pool.stats.get("index_errors") >= 1, timeout=10)
        # The worker's heartbeat starts a new server and re-publishes what it holds.
        wait_for(lambda: client.lookup(keys).pages == 3, timeout=20)
        assert (Path(runtime_dir) / PIDFILE).read_text().split()[0] != first_pid
    finally:
        pool.close()
        client.close()
        stop_embedded(runtime_dir)


def test_corrupt_own_pages_are_dropped(pool: Pool) -> None:
    keys = pool.keys_for(np.arange(16 * 2))
    pool.store([(k, content(k)) for k in keys]).result()
    tier = pool.tiers[0]
    ref = tier.find(keys[0])
    assert ref is not None
    tier.region[tier.slot_offset(ref.slot) + SPEC.segment_offset(0)] ^= 1
    _, failed, _ = load_all(pool, keys)
    assert failed == {0: "bad_checksum"}
    assert tier.find(keys[0]) is None and pool.lookup(keys).pages == 0   # never offered again


def test_zero_copy_reader_checks_what_was_copied(pool: Pool) -> None:
    keys = pool.keys_for(np.arange(16 * 3))
    pool.store([(k, content(k)) for k in keys]).result()
    lk = pool.lookup(keys)
    reader = pool.open_read(keys, lk.sources)
    copies = {}
    for layer in range(SPEC.num_layers):
        for i in range(3):
            seg = reader.segment(i, layer)
            if seg is None:                      # a failed page offers no more segments
                assert i == 2 and layer > 1
                continue
            copies[(i, layer)] = seg.copy()
            if (i, layer) == (1, 1):
                tier = pool.tiers[0]
                victim = tier.find(keys[2])
                assert victim is not None
                tier.region[tier.slot_offset(victim.slot) + SPEC.segment_offset(layer) + 3] ^= 0xFF   # corrupt page 2
            ok = reader.check(i, layer, reader.landed_sum(i, copies[(i, layer)]))
            assert ok == (not (i == 2 and layer >= 1))
    assert reader.failed == {2: "bad_checksum"}
    for i in range(2):
        for layer in range(SPEC.num_layers):
            assert copies[(i, layer)].tobytes() == content(keys[i])[layer].tobytes()
    reader.close()
    assert pool.stats.get("loaded_pages") == 2 and pool.lookup(keys).pages == 2   # the corrupt page was dropped


def test_zero_copy_reader_reads_and_checks_a_whole_layer_at_once(pool: Pool) -> None:
    """``segments`` / ``check_all`` (a layer of every page per call, as the vLLM worker's fused
    copy uses them) give and check what ``segment`` / ``check`` do page by page."""
    from pof_connector.pages import page_sum
    keys = pool.keys_for(np.arange(16 * 4))
    pool.store([(k, content(k)) for k in keys]).result()
    reader = pool.open_read(keys, pool.lookup(keys).sources)
    tier = pool.tiers[0]
    for layer in range(SPEC.num_layers):
        segs = reader.segments(layer)
        assert [i for i, _ in segs] == [i for i in range(4) if i not in reader.failed]
        for i, seg in segs:
            assert seg.tobytes() == content(keys[i])[layer].tobytes()
            assert np.shares_memory(seg, tier.region)           # in place: zero-copy
        sums = [(i, page_sum.checksum(seg, reader.sum_seed(i))) for i, seg in segs]
        if layer == 1:
            sums[0] = (sums[0][0], sums[0][1] ^ 1)             # page 0's copy read other bytes
            victim = tier.find(keys[3])
            assert victim is not None
            tier._set_live_generation(victim.slot, 0)          # page 3's slot is being rewritten
        reader.check_all(layer, sums)
    assert reader.failed == {0: "bad_checksum", 3: "stale_generation"}
    reader.close()
    assert pool.stats.get("loaded_pages") == 2 and pool.stats.get("loaded_bytes") == 2 * SPEC.page_bytes


def test_a_segment_of_a_slot_outside_the_tier_is_refused(pool: Pool) -> None:
    from pof_connector.pages.layout import PageError
    tier = pool.tiers[0]
    for slot in (-1, tier.num_slots):
        with pytest.raises(PageError, match="bad_location"):
            tier.segment_view(SlotRef(slot, 1), 0)


def test_zero_copy_reader_rejects_a_slot_rewritten_mid_read(pool: Pool) -> None:
    keys = pool.keys_for(np.arange(16 * 2))
    pool.store([(k, content(k)) for k in keys[:1]]).result()
    reader = pool.open_read(keys[:1], pool.lookup(keys[:1]).sources)
    seg = reader.segment(0, 0)
    assert seg is not None
    tier = pool.tiers[0]
    ref = tier.find(keys[0])
    assert ref is not None
    landed = reader.landed_sum(0, seg.copy())
    tier._set_live_generation(ref.slot, 0)       # what a writer does first when it reuses the slot
    assert not reader.check(0, 0, landed) and reader.failed == {0: "stale_generation"}
    reader.close()


def test_a_page_pinned_while_it_is_evicted_is_not_reused_under_its_reader(runtime_dir: str, namespace: bytes) -> None:
    """Placement._make_room chooses an unpinned LRU victim, then removes it: a reader that pins it in
    between must read the page whole, and the store must make room elsewhere."""
    pool = Pool(cfg("a", runtime_dir, cpu_dram={"size": 2 * slot_bytes_for(SPEC)}), SPEC, namespace)
    try:
        tier = pool.tiers[0]
        keys = pool.keys_for(np.arange(16 * 3))
        pool.store([(k, content(k)) for k in keys[:2]]).result()
        choose = tier.lru_victim
        readers = []

        def victim_then_a_reader_pins_it(tenant: str = DEFAULT_TENANT) -> tuple[PageKey, SlotRef] | None:
            got = choose(tenant)
            if got is not None and not readers:      # the reader's open_read lands in the window
                k, ref = got
                readers.append((k, pool.open_read([k], [Location("a", tier.medium, ref.slot, ref.generation)])))
            return got

        tier.lru_victim = victim_then_a_reader_pins_it      # type: ignore[method-assign]
        assert pool.store([(keys[2], content(keys[2]))]).result() == 1
        ((victim, reader),) = readers
        for layer in range(SPEC.num_layers):
            seg = reader.segment(0, layer)
            assert seg is not None
            copy = seg.copy()
            assert reader.check(0, layer, reader.landed_sum(0, copy)), reader.failed
            assert copy.tobytes() == content(victim)[layer].tobytes()
        reader.close()
        assert reader.failed == {} and tier.find(keys[2]) is not None
        assert pool.lookup([victim]).pages == 0                     # evicted all the same
        assert tier.free_slots == 1                                 # its slot came back at the unpin
    finally:
        pool.close()


@contextlib.contextmanager
def lender_and_writer(runtime_dir: str, namespace: bytes) -> Iterator[tuple[Pool, LocalIndex]]:
    """Pool A, which lends slots, and B's index client, registered: B spills into A's slots."""
    table = LocalTable()
    a = Pool(cfg("a", runtime_dir), SPEC, namespace, index=LocalIndex("a", table))
    b = LocalIndex("b", table)
    try:
        wait_for(lambda: a.index.nodes() != [])
        b.heartbeat(NodeInfo("b"), 10)
        yield a, b
    finally:
        b.close()
        a.close()


def spill_into(a: Pool, b: LocalIndex, keys: list[PageKey], flip: int | None = None) -> list[SlotRef]:
    """What B's spill amounts to: A lends a slot per key, B writes its page there (a NIXL WRITE;
    page ``flip`` with a flipped bit) and publishes the slots as A's."""
    tier = a.tiers[0]
    refs = tier.lend(len(keys))
    for k, ref in zip(keys, refs, strict=True):
        tier.write(ref, k, content(k))
    if flip is not None:
        tier.region[tier.slot_offset(refs[flip].slot) + SPEC.segment_offset(1) + 5] ^= 0xFF
    b.publish([(k, Location("a", tier.medium, r.slot, r.generation)) for k, r in zip(keys, refs, strict=True)])
    return refs


def test_a_node_loads_pages_spilled_into_slots_it_lent(runtime_dir: str, namespace: bytes) -> None:
    """Node B spilled a chain into slots A lent it (fabric spill), publishing them as A's: A's own
    lookup offers them, and A must be able to load them (they are not in A's books)."""
    with lender_and_writer(runtime_dir, namespace) as (a, b):
        tier = a.tiers[0]
        keys = a.keys_for(np.arange(16 * 3))
        refs = spill_into(a, b, keys)
        assert a.lookup(keys).pages == 3
        bufs, failed, n = load_all(a, keys)
        assert failed == {} and n == 3
        assert_pages(bufs, keys)
        reader = a.open_read(keys, a.lookup(keys).sources)       # the zero-copy path too
        for layer in range(SPEC.num_layers):
            for i in range(3):
                seg = reader.segment(i, layer)
                assert seg is not None and seg.tobytes() == content(keys[i])[layer].tobytes()
                assert reader.check(i, layer, reader.landed_sum(i, seg.copy()))
        reader.close()
        assert reader.failed == {}
        assert tier.take_back(refs[0].slot)      # the lease ended: the page is gone, a miss, never wrong
        bufs, failed, _ = load_all(a, keys)
        assert set(failed) == {0} and failed[0] in ("evicted", "stale_generation"), failed
        assert_pages(bufs, keys, skip={0})


def test_two_processes_with_one_node_id_do_not_keep_re_registering(
        runtime_dir: str, namespace: bytes, redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    """E.g. two engine ranks configured with one node_id: the newer holds the registration and
    its pages stay findable; the older says why it publishes nothing, and neither takes a new
    incarnation (and re-publishes everything) every heartbeat."""
    first = Pool(cfg("a", runtime_dir, redis_server.url), SPEC, namespace)
    second: Pool | None = None
    reader = RedisIndex(redis_server.url, None)
    try:
        keys = first.keys_for(np.arange(16 * 4))
        first.store([(k, content(k)) for k in keys[:2]]).result()
        assert isinstance(first.index, RedisIndex)
        wait_for(lambda: first.index.incarnation is not None)     # type: ignore[attr-defined]
        second = Pool(cfg("a", runtime_dir, redis_server.url), SPEC, namespace)
        assert isinstance(second.index, RedisIndex)
        second.store([(k, content(k)) for k in keys]).result()
        wait_for(lambda: "a" in reader.longest_prefix(keys) and reader.longest_prefix(keys)["a"].pages == 4)
        inc = second.index.incarnation
        time.sleep(0.5)                                            # ten heartbeats of each
        assert second.index.incarnation == inc and reader.longest_prefix(keys)["a"].pages == 4
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert any("node id 'a'" in m and "node_id" in m for m in errors), errors
        assert not any("heartbeat failed" in m for m in errors), errors
        assert first.lookup(keys).pages >= 2                       # its own pages it still serves itself
    finally:
        reader.close()
        if second is not None:
            second.close()
        first.close()


def test_a_restarted_node_is_not_offered_its_former_pages(runtime_dir: str, namespace: bytes,
                                                          redis_server: RedisServer) -> None:
    """Node a dies without leaving the index and starts again, empty: its former incarnation's
    entries point into memory that is gone and must not be offered (until then: a miss each)."""
    old = Pool(cfg("a", runtime_dir, redis_server.url), SPEC, namespace)
    reader = RedisIndex(redis_server.url, None)
    new: Pool | None = None
    try:
        keys = old.keys_for(np.arange(16 * 3))
        old.store([(k, content(k)) for k in keys]).result()
        wait_for(lambda: "a" in reader.longest_prefix(keys))
        old.index.leave = lambda: None            # type: ignore[method-assign]  # a crash: no leave
        old.close()
        new = Pool(cfg("a", runtime_dir, redis_server.url), SPEC, namespace)
        assert isinstance(new.index, RedisIndex)
        wait_for(lambda: new.index.incarnation is not None)      # type: ignore[union-attr]
        assert reader.longest_prefix(keys) == {} and new.lookup(keys).pages == 0
    finally:
        reader.close()
        if new is not None:
            new.close()


def test_a_corrupt_page_in_a_lent_slot_is_no_longer_offered(runtime_dir: str, namespace: bytes) -> None:
    """A page B spilled into a slot A lent fails its checksum on A: its entry (published as A's)
    would only lead every later lookup to a miss, so A withdraws it."""
    with lender_and_writer(runtime_dir, namespace) as (a, b):
        tier = a.tiers[0]
        keys = a.keys_for(np.arange(16 * 2))
        refs = spill_into(a, b, keys, flip=1)
        bufs, failed, n = load_all(a, keys)
        assert n == 2 and failed == {1: "bad_checksum"}
        assert_pages(bufs, keys, skip={1})
        assert a.lookup(keys).pages == 1 and tier.is_lent(refs[1].slot)    # withdrawn; the lease is B's


@pytest.mark.parametrize("native", ["avx2", None])
def test_a_worker_says_which_kernel_copies_its_pages(runtime_dir: str, namespace: bytes,
                                                     monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                                     native: str | None) -> None:
    """A build without the native kernel still works, but at a fraction of memcpy speed: the first
    worker of a process says so in a warning that names where the package came from and how to
    build it (a checkout without build_ext on sys.path shadows an installed build silently)."""
    monkeypatch.setattr(page_sum, "NATIVE", native)
    monkeypatch.setattr(pool_module, "_kernel_logged", False)
    caplog.set_level(logging.INFO, logger="pof_connector.pool")
    for node in ("a", "b"):                                  # once per process, not per pool
        Pool(cfg(node, runtime_dir), SPEC, namespace).close()
    lines = [r for r in caplog.records if "kernel" in r.getMessage()]
    assert len(lines) == 1
    if native is None:
        assert lines[0].levelno == logging.WARNING
        assert "numpy" in lines[0].getMessage() and "pip install" in lines[0].getMessage()
        assert os.path.dirname(os.path.dirname(os.path.dirname(page_sum.__file__))) in lines[0].getMessage()
    else:
        assert lines[0].levelno == logging.INFO and "native kernel (avx2)" in lines[0].getMessage()


def test_pages_stored_held_stay_invisible_until_released(pool: Pool) -> None:
    """Two-phase stores (an engine's step stores its pages before it knows whether the step computed
    on valid KV): held pages are in their slots but neither found nor published until release says
    publish; a dropped page's slot is invalidated and freed; close drops what is still held."""
    keys = pool.keys_for(np.arange(16 * 3))
    assert pool.store([(k, content(k)) for k in keys[:2]], hold=("step", 1)).result() == 2
    assert pool.store([(keys[2], content(keys[2]))], hold=("step", 2)).result() == 1
    assert pool.lookup(keys).pages == 0 and pool.stats.get("stored_pages") == 0
    assert all(pool.contains(k) for k in keys)                  # not stored again meanwhile
    tier = pool.tiers[0]
    assert pool.release(("step", 1), publish=True).result() == 2
    assert pool.lookup(keys).pages == 2
    wait_for(lambda: pool.index.longest_prefix(keys[:2]) != {})
    slot = tier._books.pending_slot(keys[2])
    assert slot is not None
    pool.release(("step", 2), publish=False).result()
    assert not pool.contains(keys[2]) and tier.live_generation(slot) == 0
    assert pool.stats.get("dropped_pages") == 1 and pool.stats.get("stored_pages") == 2
    assert tier.free_slots == tier.capacity_slots - 2
    pool.store([(keys[2], content(keys[2]))], hold=("step", 3)).result()
    assert pool.release_now(("step", 3)) == 1 and pool.lookup(keys).pages == 3     # readable on return


def test_close_drops_held_pages(runtime_dir: str, namespace: bytes) -> None:
    p = Pool(cfg("a", runtime_dir), SPEC, namespace)
    keys = p.keys_for(np.arange(16 * 2))
    p.store([(k, content(k)) for k in keys], hold="never released").result()
    p.close()
    assert p.stats.get("dropped_pages") == 2
