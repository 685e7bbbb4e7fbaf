"""Spill over NIXL between pool nodes in separate processes (UCX over TCP loopback).

Writer B has room for 4 pages and ``fabric.spill`` on; memory node M is a ``pof memd`` process;
reader A only reads. B stores a chain, then another: the first is evicted from B's only tier and
spilled into slots M granted, and A (and B) read it back from M. The faults: B stops renewing its
leases (SIGSTOP) so M reclaims the slots — readers miss, never get a wrong page; B dies right after
spilling — M still withdraws what B published; M dies — B's spills fail within the fabric timeout
and B keeps storing and serving; M is full — no grant, the pages are dropped.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pof_connector.fabric import nixl_installed
from pof_connector.index import NodeInfo
from pof_connector.index.redis import RedisIndex
from pof_connector.index.server import RedisServer
from pof_connector.tiers.base import slot_bytes_for
from tests.fabric.harness import LEASE_S, TIMEOUT_S, MemdProc, NodeProc, node_config, wait_for
from tests.fabric.node_proc import SPEC

pytestmark = [pytest.mark.nixl, pytest.mark.slow,
              pytest.mark.skipif(not nixl_installed(),
                                 reason="NIXL is not installed (pip install --no-deps nixl-cu13==1.5.1)")]

SLOT = slot_bytes_for(SPEC)
INVALID = {"stale_generation", "wrong_key", "bad_header", "bad_checksum"}
"""Why a read of a reclaimed (invalidated, maybe re-granted) slot fails."""


def live_nodes(url: str) -> dict[str, NodeInfo]:
    index = RedisIndex(url, None)
    try:
        return {n.node_id: n for n in index.nodes()}
    finally:
        index.close()


def m_lent(url: str) -> int:
    """Slots M has lent now, as its heartbeat reports them (-1: M is not alive)."""
    info = live_nodes(url).get("m")
    return -1 if info is None else int(json.loads(info.meta["fabric.lent"])["cpu_dram"][0])


@pytest.fixture
def cluster(redis_server: RedisServer, runtime_dir: str, shm_path: str,
            request: pytest.FixtureRequest) -> Iterator[tuple[NodeProc, NodeProc, MemdProc]]:
    """(A, B, M). The indirect parameter, a dict: ``m_slots``, M's capacity in slots (default 64);
    ``b_heartbeat_s``, B's heartbeat period (default the harness's); ``b_cxl``: B has a CXL tier
    (a file at ``shm_path``, about 4 slots) below its DRAM."""
    param: dict[str, float] = getattr(request, "param", {})
    m_slots = int(param.get("m_slots", 64))
    procs: list[NodeProc | MemdProc] = []
    try:
        m_conf = node_config("m", redis_server.url, runtime_dir, dram=str(m_slots * SLOT))
        m_conf["fabric"]["max_lent_fraction_per_writer"] = 1.0     # B is M's only writer: all of M is its
        m = MemdProc(m_conf, Path(runtime_dir) / "m.json", SLOT)
        procs.append(m)
        a = NodeProc(node_config("a", redis_server.url, runtime_dir))
        procs.append(a)
        b_conf = node_config("b", redis_server.url, runtime_dir, spill=True, dram=str(4 * SLOT))
        if param.get("b_cxl"):
            b_conf["tiers"]["cxl"] = {"path": shm_path, "size": str(4 * SLOT), "partitions": 1}
        if "b_heartbeat_s" in param:
            b_conf.update(heartbeat_s=param["b_heartbeat_s"], node_ttl_s=2 * param["b_heartbeat_s"])
        b = NodeProc(b_conf)
        procs.append(b)
        wait_for(lambda: "m" in live_nodes(redis_server.url), 30, "the memory node's registration")
        yield a, b, m
    finally:
        for p in reversed(procs):        # writers first: they give their slots back to M
            p.close()


def spill_first_chain(b: NodeProc) -> None:
    """B stores chain 1, then chain 2: chain 1 leaves B's only tier."""
    assert b.call("store", seed=1, pages=4) == {"stored": 4}
    assert b.call("store", seed=2, pages=4) == {"stored": 4}


def test_spill_to_memory_node_read_back_and_renewed(cluster: tuple[NodeProc, NodeProc, MemdProc],
                                                   redis_server: RedisServer) -> None:
    a, b, m = cluster
    spill_first_chain(b)
    stats = b.call("stats")["stats"]
    assert stats.get("spilled_pages{tier=cpu_dram}") == 4 and not stats.get("spill_failures"), stats
    assert b.call("spill")["spilled"] == 4
    wait_for(lambda: a.call("lookup", seed=1, pages=4)["nodes"] == ["m"], what="A finds chain 1 on M")
    for reader in (a, b):
        r = reader.call("load", seed=1, pages=4)
        assert r["pages"] == 4 and r["failed"] == {} and r["exact"], r
    # 4 written, the rest of the grant in B's reserve (as M's next heartbeat reports it).
    wait_for(lambda: m_lent(redis_server.url) >= 4, 5, "M's report of the leases")
    # Past the lease: B renewed it, so the pages are still there and exact.
    time.sleep(LEASE_S + TIMEOUT_S + 0.5)
    r = a.call("load", seed=1, pages=4)
    assert r["pages"] == 4 and r["failed"] == {} and r["exact"], r
    assert "slots lent to 1 writer" in m.log()

    # M dies: B's next spills fail within the fabric timeout, B keeps storing and serving.
    m.kill()
    t0 = time.monotonic()
    assert b.call("store", seed=3, pages=4) == {"stored": 4}
    assert time.monotonic() - t0 < 2 * TIMEOUT_S + 1.0
    stats = b.call("stats")["stats"]
    assert stats.get("spill_failures", 0) >= 1 and stats.get("spilled_pages") == 4, stats
    r = b.call("load", seed=3, pages=4)
    assert r["pages"] == 4 and r["failed"] == {} and r["exact"], r
    t0 = time.monotonic()
    assert b.call("store", seed=4, pages=4) == {"stored": 4}     # M backed off / expired: no waiting
    assert time.monotonic() - t0 < TIMEOUT_S
    r = a.call("load", seed=1, pages=4)                          # chain 1 died with M: a miss, no hang
    assert r["failed"] == {} or set(r["failed"].values()) <= {"remote_error", "peer_down", "timeout"}, r


@pytest.mark.parametrize("cluster", [{"b_cxl": 1}], indirect=True)
def test_a_lost_last_tier_makes_the_one_above_spill(cluster: tuple[NodeProc, NodeProc, MemdProc],
                                                    shm_path: str) -> None:
    """B's CXL region (its last tier) is removed: B's DRAM becomes its last live tier, and its LRU
    pages spill to M rather than being dropped."""
    a, b, _ = cluster
    Path(shm_path).unlink()
    wait_for(lambda: b.call("stats")["stats"].get("tier_errors{tier=cxl}") == 1, 5, "B's notice of the lost region")
    spill_first_chain(b)
    stats = b.call("stats")["stats"]
    assert stats.get("spilled_pages{tier=cpu_dram}") == 4 and not stats.get("spill_failures"), stats
    wait_for(lambda: a.call("lookup", seed=1, pages=4)["nodes"] == ["m"], what="A finds chain 1 on M")
    r = a.call("load", seed=1, pages=4)
    assert r["pages"] == 4 and r["failed"] == {} and r["exact"], r


def test_lease_expiry_reclaims_and_readers_miss(
        cluster: tuple[NodeProc, NodeProc, MemdProc], redis_server: RedisServer) -> None:
    a, b, _ = cluster
    spill_first_chain(b)
    wait_for(lambda: a.call("lookup", seed=1, pages=4, save="plan")["nodes"] == ["m"], what="A finds chain 1")
    assert a.call("load", seed=1, pages=4, saved="plan")["exact"]
    # M's heartbeat reports the leases (else "0 lent" below could be the report from before them).
    wait_for(lambda: m_lent(redis_server.url) >= 4, 5, "M's report of the leases")
    # B stops (no renewals): M reclaims the slots when the lease and its grace are over.
    b.stop()
    try:
        wait_for(lambda: m_lent(redis_server.url) == 0, LEASE_S + 3 * TIMEOUT_S + 2, "M's reclaim")
        r = a.call("load", seed=1, pages=4, saved="plan")
        assert set(r["failed"]) == {"0", "1", "2", "3"} and set(r["failed"].values()) <= INVALID, r
        # M withdrew the entries B published for it (B is still stopped: it could not).
        wait_for(lambda: a.call("lookup", seed=1, pages=4)["pages"] == 0, 3, "M's withdrawal")
    finally:
        b.signal(signal.SIGCONT)
    # B notices its leases ended and withdraws the entries.
    wait_for(lambda: b.call("spill")["spilled"] == 0, 5, "B's withdrawal")
    wait_for(lambda: a.call("lookup", seed=1, pages=4)["pages"] == 0, 5, "chain 1 gone from the index")


# No heartbeat of B's after its first: nothing but the spill itself can have told M what its slots hold.
@pytest.mark.parametrize("cluster", [{"b_heartbeat_s": 60.0}], indirect=True)
def test_writer_dead_right_after_spilling_leaves_no_entry(
        cluster: tuple[NodeProc, NodeProc, MemdProc], redis_server: RedisServer) -> None:
    a, b, _ = cluster
    spill_first_chain(b)
    b.kill()
    assert a.call("lookup", seed=1, pages=4)["nodes"] == ["m"]      # B published it before dying
    wait_for(lambda: m_lent(redis_server.url) >= 4, 5, "M's report of the leases")
    wait_for(lambda: m_lent(redis_server.url) == 0, LEASE_S + 3 * TIMEOUT_S + 2, "M's reclaim")
    wait_for(lambda: a.call("lookup", seed=1, pages=4)["pages"] == 0, 3, "M's withdrawal")


@pytest.mark.parametrize("cluster", [{"m_slots": 2}], indirect=True)
def test_full_memory_node_grants_nothing(cluster: tuple[NodeProc, NodeProc, MemdProc],
                                         redis_server: RedisServer) -> None:
    a, b, _ = cluster
    spill_first_chain(b)
    stats = b.call("stats")["stats"]
    assert stats.get("spilled_pages") == 2, stats                  # M had room for 2
    assert stats.get("spill_failures", 0) == 2, stats              # the other 2 were dropped
    wait_for(lambda: m_lent(redis_server.url) == 2, what="M reports 2 slots lent")
    wait_for(lambda: live_nodes(redis_server.url)["m"].tiers["cpu_dram"].free_bytes == 0, what="M reports full")
    t0 = time.monotonic()
    assert b.call("store", seed=3, pages=4) == {"stored": 4}        # M is full: not even asked
    assert time.monotonic() - t0 < TIMEOUT_S
    assert b.call("stats")["stats"].get("spill_failures{reason=no_target}", 0) >= 1
    r = b.call("load", seed=3, pages=4)
    assert r["failed"] == {} and r["exact"], r
    assert a.call("lookup", seed=3, pages=4)["nodes"] == ["b"]


def test_a_lender_loads_pages_spilled_into_its_own_slots(redis_server: RedisServer, runtime_dir: str) -> None:
    """No memory node: B spills into slots pool node A lends. The index names A as their holder,
    so A's lookup offers them, and A must load them (they are not in A's books)."""
    procs: list[NodeProc] = []
    try:
        a = NodeProc(node_config("a", redis_server.url, runtime_dir, spill=True, dram=str(64 * SLOT)))
        procs.append(a)
        b = NodeProc(node_config("b", redis_server.url, runtime_dir, spill=True, dram=str(4 * SLOT)))
        procs.append(b)
        wait_for(lambda: {"a", "b"} <= set(live_nodes(redis_server.url)), 30, "both registrations")
        spill_first_chain(b)
        assert b.call("spill")["spilled"] == 4
        wait_for(lambda: a.call("lookup", seed=1, pages=4)["nodes"] == ["a"], what="A finds chain 1 as its own")
        for zero_copy in (False, True):
            r = a.call("load", seed=1, pages=4, zero_copy=zero_copy)
            assert r["pages"] == 4 and r["failed"] == {} and r["exact"], r
        r = b.call("load", seed=1, pages=4)                       # and the writer reads it from A
        assert r["pages"] == 4 and r["failed"] == {} and r["exact"], r
    finally:
        for p in reversed(procs):
            p.close()
