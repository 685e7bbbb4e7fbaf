"""Each policy's choice on a tiny hand-made state (the toy profile of test_engine_core: 10 blocks
of 4 tokens per node). Policy pof is the real router: its route reasons are the router's."""

from __future__ import annotations

from pof_connector.sim.cache_aware import CacheAware
from pof_connector.sim.job import Job
from pof_connector.sim.pof_policy import PofPolicy
from pof_connector.sim.round_robin import RoundRobin
from pof_connector.sim.sim_config import SimConfig
from pof_connector.sim.simulator import Simulator
from pof_connector.sim.static_affinity import StaticAffinity, stable_hash
from pof_connector.sim.workload import SimRequest
from tests.sim.test_engine_core import toy


def job(i: int, session: str, history: int, turn: int, tenant: str = "t", max_tokens: int = 2) -> Job:
    return Job(i, SimRequest(0.0, session, tenant, 0, turn, max_tokens), 0.0, history, history + turn)


def cached(sim: Simulator, node: int, key: str, tokens: int) -> None:
    """``node``'s engine caches ``key``'s first ``tokens`` (a finished request left them)."""
    sim.nodes[node].cache.pin(key, tokens)
    sim.nodes[node].cache.unpin(key, tokens)


def test_static_places_conversations_by_session_and_one_offs_by_tenant() -> None:
    p = StaticAffinity({"conv"})
    sim = Simulator(toy(), p, SimConfig(nodes=5))
    views = list(sim.nodes)
    assert p.choose(job(0, "conv", 0, 4), views, 0.0) == stable_hash("conv") % 5
    assert p.choose(job(1, "once", 0, 4, tenant="acme"), views, 0.0) == stable_hash("acme") % 5


def test_round_robin_cycles() -> None:
    p = RoundRobin()
    views = list(Simulator(toy(), p, SimConfig(nodes=3)).nodes)
    assert [p.choose(job(i, f"s{i}", 0, 4), views, 0.0) for i in range(4)] == [0, 1, 2, 0]


def test_cache_aware_goes_where_it_sent_the_prefix_unless_the_load_is_imbalanced() -> None:
    p = CacheAware()
    sim = Simulator(toy(), p, SimConfig(nodes=3))
    views = list(sim.nodes)
    home = p.choose(job(0, "conv", 0, 16), views, 0.0)                # nothing sent yet: the least loaded
    sim.nodes[home].waiting.append(job(9, "other", 0, 1))              # home is not the least loaded now
    # the router's tree holds the 16 prompt tokens it sent home (not the answer; no engine cache asked)
    assert p.matched(job(1, "conv", 18, 4), home) == 16
    assert p.choose(job(1, "conv", 18, 4), views, 0.0) == home        # 16 of 22 tokens
    assert p.choose(job(2, "conv", 40, 4), views, 0.0) != home        # 16 of 44: under the threshold
    sim.nodes[home].waiting.extend(job(10 + i, f"q{i}", 0, 1) for i in range(40))
    assert p.choose(job(3, "conv", 18, 4), views, 0.0) != home        # 41 queued there: least loaded


def pof_cluster() -> tuple[PofPolicy, Simulator]:
    p = PofPolicy(toy(), learn=False)
    sim = Simulator(toy(), p, SimConfig(nodes=2))
    assert sim.pool is not None
    p.bind(list(sim.nodes), sim.pool)
    cached(sim, 0, "s:conv", 16)              # node 0 served the session's first turn...
    sim.pool.store(0, "s:conv", 16)           # ...and its pool stored the pages
    return p, sim


def test_pof_keeps_a_session_on_its_holder_with_room() -> None:
    p, sim = pof_cluster()
    p.tick(0.0)
    j = job(0, "conv", 16, 4)
    assert p.choose(j, list(sim.nodes), 0.0) == 0
    assert (j.decision.reason, j.decision.route) == ("pof", "prefix-holder")
    assert j.decision.admission.need_blocks == 6                       # ceil((20 + 2) / 4)


def test_pof_moves_a_session_off_its_saturated_home_and_the_pool_supplies_its_context() -> None:
    p, sim = pof_cluster()
    p.tick(0.0)
    first = job(0, "conv", 16, 4)
    assert p.choose(first, list(sim.nodes), 0.0) == 0                  # the session's home is node 0
    p.finished(first, 0.1)
    sim.nodes[0].used = 8                                              # 2 blocks free: 6 do not fit
    p.tick(0.5)
    j = job(1, "conv", 16, 4)
    assert p.choose(j, list(sim.nodes), 0.5) == 1
    d = j.decision
    assert d.route == "sticky-saturated:pool" and d.saturated == ("n0",)
    assert d.pool_tokens == 16 and d.estimate.recompute_tokens == 4    # node 1 loads 16 from node 0's pool
