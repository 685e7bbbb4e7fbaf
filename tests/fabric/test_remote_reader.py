"""Remote page reads over NIXL between pool nodes in separate processes (UCX over TCP).

Node A stores pages; node B finds them through a real Redis-protocol index and reads them with
NIXL READs. The faults: A reuses the slots B planned to read, A stalls (SIGSTOP), A dies
(SIGKILL). In every case B gets misses, never a wrong page, and nothing hangs.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import numpy as np
import pytest

from pof_connector.config import PofConfig
from pof_connector.fabric import nixl_installed
from pof_connector.index.server import RedisServer
from pof_connector.pool import Pool
from tests.fabric.harness import TIMEOUT_S, NodeProc, node_config, wait_for
from tests.fabric.node_proc import NAMESPACE, SPEC, content

pytestmark = [pytest.mark.nixl,
              pytest.mark.skipif(not nixl_installed(),
                                 reason="NIXL is not installed (pip install --no-deps nixl-cu13==1.5.1)")]

FAILURES = {"remote_error", "peer_down", "timeout"}


@pytest.fixture
def pair(redis_server: RedisServer, runtime_dir: str) -> Iterator[tuple[NodeProc, NodeProc]]:
    nodes: list[NodeProc] = []
    try:
        for name in ("a", "b"):
            nodes.append(NodeProc(node_config(name, redis_server.url, runtime_dir)))
        yield nodes[0], nodes[1]
    finally:
        for n in nodes:
            n.close()


def plan_from_a(b: NodeProc, seed: int, pages: int, save: str) -> dict[str, object]:
    def found() -> bool:
        r = b.call("lookup", seed=seed, pages=pages, save=save)
        return bool(r["pages"] == pages and r["nodes"] == ["a"])
    wait_for(found, what="B's lookup of A's pages")
    return b.call("lookup", seed=seed, pages=pages, save=save)


def test_remote_reads_exact_then_reused_slots_and_a_dead_owner_are_misses(pair: tuple[NodeProc, NodeProc]) -> None:
    a, b = pair
    assert a.ready["meta"]["fabric.agent"].startswith("pof/a/")
    assert a.call("store", seed=1, pages=8) == {"stored": 8}
    plan = plan_from_a(b, 1, 8, "first")
    for zero_copy in (False, True):           # Pool.load (I/O thread) and Pool.open_read (adapters)
        r = b.call("load", seed=1, pages=8, saved="first", zero_copy=zero_copy)
        assert r["pages"] == 8 and r["failed"] == {} and r["exact"], r
    assert b.call("peers")["peers"] == ["a"]

    # A drops the first 4 pages and stores others: they land in the same slots, with new generations.
    assert a.call("remove", seed=1, pages=4)["removed"] == 4
    assert a.call("store", seed=2, pages=4) == {"stored": 4}
    assert sorted(a.call("lookup", seed=2, pages=4)["slots"]) == sorted(plan["slots"][:4])  # type: ignore[index]
    r = b.call("load", seed=1, pages=8, saved="first")
    assert set(r["failed"]) == {"0", "1", "2", "3"}, r
    assert set(r["failed"].values()) <= {"wrong_key", "stale_generation", "bad_header"}, r
    assert r["exact"], "the pages that were not reused must still be byte-exact"

    # A dies: B's reads fail fast (no hang, no wrong page), and B keeps working.
    a.kill()
    for _ in range(2):
        r = b.call("load", seed=1, pages=8, saved="first")
        assert set(r["failed"]) == {str(i) for i in range(8)} and set(r["failed"].values()) <= FAILURES, r
        assert r["seconds"] < TIMEOUT_S, r
    assert b.call("store", seed=3, pages=4) == {"stored": 4}
    r = b.call("load", seed=3, pages=4)
    assert r["pages"] == 4 and r["failed"] == {} and r["exact"], r
    # Once A's heartbeat expired its pages are no longer offered and its connection is gone.
    wait_for(lambda: b.call("lookup", seed=1, pages=8)["pages"] == 0, what="A's expiry")
    wait_for(lambda: b.call("peers")["peers"] == [], what="A's connection dropped")


def test_a_stalled_owner_gives_timeouts_not_a_hang(pair: tuple[NodeProc, NodeProc]) -> None:
    a, b = pair
    assert a.call("store", seed=1, pages=8) == {"stored": 8}
    plan_from_a(b, 1, 8, "first")
    assert b.call("load", seed=1, pages=8, saved="first")["failed"] == {}
    a.stop()         # alive but silent: over TCP, UCX never notices this by itself
    try:
        r = b.call("load", seed=1, pages=8, saved="first")
        assert set(r["failed"].values()) == {"timeout"} and len(r["failed"]) == 8, r
        assert TIMEOUT_S * 0.9 <= r["seconds"] < TIMEOUT_S + 1.0, r
        # The cancelled READ may still land later: its staging stays out of use.
        assert b.call("peers")["quarantined"] == 8
        # A stalled peer is not offered to lookups for a while; its reads fail at once.
        assert b.call("lookup", seed=1, pages=8)["pages"] == 0
        r = b.call("load", seed=1, pages=8, saved="first")
        assert set(r["failed"].values()) == {"peer_down"} and r["seconds"] < 0.5, r
    finally:
        a.signal(signal.SIGCONT)


def test_a_slot_rewritten_between_data_and_generation_read_is_rejected(
        redis_server: RedisServer, runtime_dir: str) -> None:
    """The seqlock check, made deterministic: the owner starts rewriting each slot after B's data
    READ completed but before B's generation READ; the data B holds is self-consistent (header and
    checksums pass), only the live generation shows the reuse."""
    a = Pool(PofConfig.from_mapping(node_config("a", redis_server.url, runtime_dir)), SPEC, NAMESPACE)
    b = Pool(PofConfig.from_mapping(node_config("b", redis_server.url, runtime_dir)), SPEC, NAMESPACE)
    try:
        keys = a.keys_for(np.arange(16 * 4))
        a.store([(k, content(k)) for k in keys]).result()
        wait_for(lambda: b.lookup(keys).pages == 4)
        lk = b.lookup(keys)
        assert b.fabric is not None
        agent = b.fabric.agent
        post = agent.post_read
        n = b.fabric.staging.num_slots

        def post_then_rewrite(*args):  # type: ignore[no-untyped-def]
            # Local descriptors [n, 2n) are generation words: the generation READ, posted after
            # every part of the data arrived. A writer zeroes the live generation first.
            if n <= args[1][0] < 2 * n:
                for s in lk.sources:
                    a.tiers[0]._set_live_generation(s.slot, 0)
            return post(*args)

        agent.post_read = post_then_rewrite  # type: ignore[method-assign]
        bufs = [np.zeros(SPEC.page_bytes, np.uint8) for _ in keys]
        h = b.load(keys, lk.sources, bufs)
        assert h.wait(10) and h.failed == {i: "stale_generation" for i in range(4)}
        agent.post_read = post  # type: ignore[method-assign]
        for s in lk.sources:           # the writer never happened: the same plan reads fine again
            a.tiers[0]._set_live_generation(s.slot, s.generation)
        h = b.load(keys, lk.sources, bufs)
        assert h.wait(10) and h.failed == {}
        for buf, k in zip(bufs, keys, strict=True):
            assert all(bytes(SPEC.segment(memoryview(buf), i)) == d.tobytes() for i, d in enumerate(content(k)))
    finally:
        b.close()
        a.close()


def test_a_peers_cxl_region_that_is_not_shared_is_read_over_the_fabric(
        redis_server: RedisServer, runtime_dir: str, shm_path: str) -> None:
    """A's CXL region is not mapped by B (another host's device): B reads it with NIXL instead."""
    a_cfg = node_config("a", redis_server.url, runtime_dir)
    a_cfg["tiers"] = {"cxl": {"path": shm_path, "size": "2MiB", "partitions": 2}}
    a = Pool(PofConfig.from_mapping(a_cfg), SPEC, NAMESPACE)
    b = Pool(PofConfig.from_mapping(node_config("b", redis_server.url, runtime_dir)), SPEC, NAMESPACE)
    try:
        keys = a.keys_for(np.arange(16 * 5))
        a.store([(k, content(k)) for k in keys]).result()
        wait_for(lambda: b.lookup(keys).pages == 5)
        lk = b.lookup(keys)
        assert {(s.node, s.medium) for s in lk.sources} == {("a", "cxl")}
        reader = b.open_read(keys, lk.sources)
        try:
            for i, k in enumerate(keys):
                for layer, data in enumerate(content(k)):
                    seg = reader.segment(i, layer)
                    assert seg is not None and seg.tobytes() == data.tobytes()
                    assert reader.check(i, layer, reader.landed_sum(i, seg.copy()))
            assert reader.failed == {}
        finally:
            reader.close()
        assert b.stats.get("loaded_pages", tier="remote:cxl") == 5
    finally:
        b.close()
        a.close()


def test_a_load_larger_than_staging_misses_the_excess_and_staging_is_reused(
        redis_server: RedisServer, runtime_dir: str) -> None:
    def config(node: str) -> PofConfig:
        cfg = node_config(node, redis_server.url, runtime_dir)
        cfg["fabric"]["timeout_s"] = 10.0           # a deadline missed on a busy machine would quarantine slots
        return PofConfig.from_mapping(cfg)

    a, b = Pool(config("a"), SPEC, NAMESPACE), Pool(config("b"), SPEC, NAMESPACE)
    try:
        assert b.fabric is not None
        room = b.fabric.staging.num_slots          # 256KiB of 6KiB pages
        keys = a.keys_for(np.arange(16 * (room + 3)))
        a.store([(k, content(k)) for k in keys]).result()
        wait_for(lambda: b.lookup(keys).pages == len(keys))
        lk = b.lookup(keys)
        for _ in range(2):                          # the second time: every slot came back
            bufs = [np.zeros(SPEC.page_bytes, np.uint8) for _ in keys]
            h = b.load(keys, lk.sources, bufs)
            assert h.wait(10)
            assert sorted(h.failed.values()) == ["no_staging"] * 3
        assert len(b.fabric.staging.take(room + 1)) == room and b.fabric.staging.quarantined_slots == 0
    finally:
        b.close()
        a.close()
