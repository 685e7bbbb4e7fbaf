"""KV-capacity-aware routing: the router's rule, on a real Redis-protocol index and real pool nodes
(a and b share one CXL region, so b's pool loads what a stored). The engines' readings are the
values their ``/metrics`` would give (vLLM and SGLang names are parsed in
tests/locality/test_engine_load.py; here they are recorded on the backends directly, as the
router's metrics loop does)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from pof_connector.index.server import RedisServer
from pof_connector.locality.engine_load import EngineLoad, parse_engine_load
from pof_connector.pool import Pool
from pof_connector.router.kv_admission import KvAdmission, NodePressure
from pof_connector.router.router import Router
from pof_connector.router.router_config import CapacityConfig, RouterConfig
from tests.locality.test_engine_load import SGLANG_KV, VLLM_KV
from tests.router.pool_pair import pool_pair

PREFIX = list(range(5000, 5000 + 16 * 8))          # 8 pages of 16 tokens, stored by a
CAPACITY = 64 * 16                                  # tokens of KV each engine holds
ROOMY = EngineLoad(running=1, waiting=0, kv_usage=0.10, kv_capacity_tokens=CAPACITY, block_tokens=16, preemptions=0)
FULL = EngineLoad(running=6, waiting=3, kv_usage=0.97, kv_capacity_tokens=CAPACITY, block_tokens=16, preemptions=4)


@pytest.fixture
def cluster(redis_server: RedisServer, runtime_dir: str, shm_path: str) -> Iterator[tuple[Router, Pool, Pool]]:
    with pool_pair(redis_server.url, runtime_dir, shm_path, PREFIX, timeout_s=5) as got:
        yield got


def backend(router: Router, name: str) -> Any:
    return next(x for x in router.backends if x.name == name)


def test_unsaturated_holder_keeps_its_prefix(cluster: tuple[Router, Pool, Pool]) -> None:
    router, _, _ = cluster
    backend(router, "a").record_load(ROOMY)
    backend(router, "b").record_load(ROOMY)
    d = router.choose([*PREFIX, 1, 2, 3], max_tokens=64)
    assert (d.backend.name, d.route, d.holder, d.saturated) == ("a", "prefix-holder", "a", ())
    assert d.admission is not None and not d.admission.saturated
    assert d.admission.need_blocks == -(-(len(PREFIX) + 3 + 64) // 16)           # prompt + max_tokens, in blocks
    assert d.admission.free_blocks == int(0.9 * 64)


def test_saturated_holder_sends_the_request_where_the_pool_supplies_the_prefix(
        cluster: tuple[Router, Pool, Pool]) -> None:
    router, _, _ = cluster
    backend(router, "a").record_load(FULL)
    backend(router, "b").record_load(ROOMY)
    d = router.choose([*PREFIX, 1, 2, 3], max_tokens=64)
    assert (d.backend.name, d.route, d.holder, d.saturated) == ("b", "holder-saturated:pool", "a", ("a",))
    assert d.pool_tokens == len(PREFIX)                 # b loads a's 8 pages from the shared region
    assert d.estimate is not None and d.estimate.recompute_tokens == 3
    # a prompt nobody holds goes to the node with room as well
    fresh = router.choose(list(range(90000, 90100)), max_tokens=64)
    assert (fresh.backend.name, fresh.route) == ("b", "no-prefix")


def test_a_request_too_big_for_the_holders_free_blocks_moves_even_without_a_queue(
        cluster: tuple[Router, Pool, Pool]) -> None:
    router, _, _ = cluster
    half = EngineLoad(running=2, waiting=0, kv_usage=0.5, kv_capacity_tokens=CAPACITY, block_tokens=16, preemptions=0)
    backend(router, "a").record_load(half)
    backend(router, "b").record_load(ROOMY)
    small = router.choose([*PREFIX, 1], max_tokens=16)            # fits in a's 32 free blocks
    assert (small.backend.name, small.route) == ("a", "prefix-holder")
    big = router.choose([*PREFIX, 1], max_tokens=400)             # 34 blocks: does not
    assert (big.backend.name, big.route) == ("b", "holder-saturated:pool")
    assert big.saturated == ("a",)


def test_blocks_sent_since_the_last_reading_count_against_the_node(cluster: tuple[Router, Pool, Pool]) -> None:
    router, _, _ = cluster
    a, b = backend(router, "a"), backend(router, "b")
    a.record_load(ROOMY)
    b.record_load(ROOMY)
    tickets = []
    for _ in range(3):                       # 3 x 15 of its 57 free blocks sent before its gauge shows them
        d = router.choose([*PREFIX, 1], max_tokens=100)
        assert d.backend is a and d.kv_blocks == 15
        tickets.append(a.admit(d.prefill_tokens, d.kv_blocks))
        a.first_token(tickets[-1])
        b.first_token(b.admit(0))            # b as busy in requests, but without KV need
    d = router.choose([*PREFIX, 1], max_tokens=100)
    assert (d.backend.name, d.route) == ("b", "holder-saturated:pool")
    for t in tickets:
        a.finish(t)
    assert router.choose([*PREFIX, 1], max_tokens=100).backend is a


def test_requests_still_queued_at_a_reading_stay_counted(cluster: tuple[Router, Pool, Pool]) -> None:
    router, _, _ = cluster
    a = backend(router, "a")
    a.record_load(ROOMY)
    started, queued = a.admit(100, 10), a.admit(100, 20)
    assert a.pressure(5.0).pending_blocks == 30
    a.first_token(started)
    a.record_load(ROOMY)                 # the engine's gauge holds the started one; the queued one not yet
    assert a.pressure(5.0).pending_blocks == 20
    a.finish(started)
    assert a.pressure(5.0).pending_blocks == 20
    a.finish(queued)
    assert a.pressure(5.0).pending_blocks == 0


def test_all_saturated_picks_the_least_admission_cost(cluster: tuple[Router, Pool, Pool]) -> None:
    router, _, _ = cluster
    backend(router, "a").record_load(FULL)
    backend(router, "b").record_load(FULL)
    d = router.choose([*PREFIX, 1], max_tokens=64)
    assert d.route == "all-saturated" and set(d.saturated) == {"a", "b"}
    assert d.backend.name == "a"        # same pressure on both: the holder computes least


def test_missing_metrics_route_as_before(cluster: tuple[Router, Pool, Pool]) -> None:
    router, _, _ = cluster
    d = router.choose([*PREFIX, 1], max_tokens=64)            # no reading at all
    assert (d.backend.name, d.route, d.saturated) == ("a", "prefix-holder", ())
    assert d.admission is not None and d.admission.why == "no-metrics" and d.admission.free_blocks is None
    # an engine exporting only its request gauges (no KV usage) is never called saturated
    backend(router, "a").record_load(EngineLoad(running=9, waiting=9))
    assert router.choose([*PREFIX, 1], max_tokens=64).backend.name == "a"
    # nor is a stale reading used
    stale = RouterConfig.from_mapping({**router.config.model_dump(), "capacity": {"stale_after_s": 0.01}})
    r2 = Router(stale, router.locator)
    r2.backends[0].record_load(FULL)
    time.sleep(0.05)
    assert r2.choose([*PREFIX, 1], max_tokens=64).backend.name == "a"
    # and with capacity off the full holder keeps it
    off = Router(RouterConfig.from_mapping({**router.config.model_dump(), "capacity": {"enabled": False}}),
                 router.locator)
    off.backends[0].record_load(FULL)
    assert off.choose([*PREFIX, 1], max_tokens=64).backend.name == "a"


def test_sticky_session_moves_off_a_saturated_node(cluster: tuple[Router, Pool, Pool]) -> None:
    router, _, _ = cluster
    a, b = backend(router, "a"), backend(router, "b")
    a.record_load(ROOMY)
    b.record_load(ROOMY)
    first = router.choose([*PREFIX, 1], session="s1", max_tokens=32)
    assert first.backend is a
    assert router.choose([*PREFIX, 1, 7], session="s1", max_tokens=32).reason == "sticky"
    a.record_load(FULL)
    moved = router.choose([*PREFIX, 1, 7, 8], session="s1", max_tokens=32)
    assert (moved.backend.name, moved.route) == ("b", "sticky-saturated:pool")
    again = router.choose([*PREFIX, 1, 7, 8, 9], session="s1", max_tokens=32)
    assert (again.backend.name, again.reason) == ("b", "sticky")          # the session lives on b now


@pytest.mark.parametrize("text,block", [(VLLM_KV, 128), (SGLANG_KV, 16)])
def test_admission_from_either_engines_metrics(text: str, block: int) -> None:
    """vLLM's block size comes from cache_config_info; SGLang exports none: the config's is used."""
    load = parse_engine_load(text)
    assert load is not None
    kv = KvAdmission(CapacityConfig(block_tokens=16, high_watermark=0.9))
    adm = kv.assess(NodePressure(load), 1000, s_per_token=1e-3, overhead_s=0.01)
    assert adm.need_blocks == -(-1000 // block)
    free = int((1 - load.kv_usage) * load.kv_capacity_tokens / block)     # type: ignore[operator]
    assert adm.free_blocks == free and adm.saturated == (adm.need_blocks > free)
    growing = kv.assess(NodePressure(load, preempting=True), 1, s_per_token=1e-3, overhead_s=0.01)
    assert not growing.saturated                        # preempting, but usage is under the watermark
    hot = EngineLoad(load.running, 1, 0.95, load.kv_capacity_tokens, load.block_tokens, load.preemptions)
    assert kv.assess(NodePressure(hot), 1, s_per_token=1e-3, overhead_s=0.01).why == "pressure"


def test_preemption_counter_growth_marks_the_node(cluster: tuple[Router, Pool, Pool]) -> None:
    router, _, _ = cluster
    a = backend(router, "a")
    busy = EngineLoad(running=4, waiting=0, kv_usage=0.92, kv_capacity_tokens=CAPACITY * 4, block_tokens=16,
                      preemptions=1)
    a.record_load(busy)
    backend(router, "b").record_load(ROOMY)
    assert router.choose([*PREFIX, 1], max_tokens=8).backend is a          # full-ish, but nothing preempted since
    a.record_load(EngineLoad(4, 0, 0.92, CAPACITY * 4, 16, preemptions=3))
    assert a.preempting
    d = router.choose([*PREFIX, 1], max_tokens=8)
    assert (d.backend.name, d.route) == ("b", "holder-saturated:pool")
