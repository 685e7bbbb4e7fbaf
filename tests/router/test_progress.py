"""A node partway through what it was sent: the router counts the prefill work a node still owes,
not the whole of every request without a first token. Counted whole, a node about to finish one
prompt looked like one that had just begun another, and on a dear-prefill workload the router
queued a new tenant behind a fresh prefill as readily as behind an almost done one (issue 42:
request 3 of every pass waited two prefills). The clock is the router's own (``clock=``), so the
tests set the time."""

from __future__ import annotations

from pof_connector.locality.locator import Locality
from pof_connector.router.router import STICKY_TTL_S, Router
from pof_connector.router.router_config import RouterConfig
from tests.sim.test_policies import job, pof_cluster

PAGE = 16
S_PER_TOKEN = 1e-3


class NowhereLocator:
    """The index holds nothing of any prompt (new tenants)."""

    def locate(self, tokens: list[int], model: str | None = None, cache_salt: str | None = None) -> Locality:
        return Locality("m", len(tokens), PAGE, {})


def two_nodes() -> tuple[Router, list[float]]:
    clock = [0.0]
    router = Router(RouterConfig.from_mapping({
        "policy": "pof", "backends": [{"name": "a", "url": "http://a.invalid"}, {"name": "b", "url": "http://b.invalid"}],
        "cost": {"prefill_s_per_token": S_PER_TOKEN, "request_overhead_s": 0.02, "learn": False}}),
        NowhereLocator(), clock=lambda: clock[0])
    return router, clock


def test_a_node_about_to_finish_wins_over_one_that_just_began() -> None:
    router, clock = two_nodes()
    a, b = router.backends
    a.admit(1283)                     # a: 1,283 tokens since t=0, done at about 1.28 s
    clock[0] = 1.1
    b.admit(1248)                     # b: 1,248 tokens since t=1.1
    clock[0] = 1.2
    # counted whole, b (1,248 tokens) looked lighter than a (1,283)
    assert (a.tokens_left(clock[0], S_PER_TOKEN), b.tokens_left(clock[0], S_PER_TOKEN)) == (83, 1148)
    d = router.choose(list(range(1200)))
    assert d.backend is a, d
    assert d.estimate is not None and d.estimate.queued_tokens == 83
    # 0.02 x 2 requests + 1e-3 x (83 queued + 1,200 its own)
    assert abs(d.estimate.ttft_s - (0.04 + S_PER_TOKEN * 1283)) < 1e-9


def test_progress_counts_from_the_last_first_token_and_stops_at_nothing_left() -> None:
    router, clock = two_nodes()
    a = router.backends[0]
    assert a.tokens_left(5.0, S_PER_TOKEN) == 0                # nothing waiting
    first, _ = a.admit(1000), a.admit(1000)
    clock[0] = 0.9
    assert a.tokens_left(clock[0], S_PER_TOKEN) == 1100
    a.first_token(first)
    # what the node did meanwhile for the second is unknown: its progress counts from now
    assert a.busy_since == 0.9 and a.tokens_left(1.0, S_PER_TOKEN) == 900
    assert a.tokens_left(10.0, S_PER_TOKEN) == 0               # overdue: nothing left, not less
    a.finish(first)                   # it had its first token: nothing changes
    assert a.busy_since == 0.9


def test_a_request_ending_before_its_first_token_restarts_the_count() -> None:
    router, clock = two_nodes()
    a = router.backends[0]
    gone, _ = a.admit(500), a.admit(700)
    clock[0] = 0.3
    a.finish(gone)                    # cancelled or failed while waiting
    assert (a.waiting, a.waiting_tokens, a.busy_since) == (1, 700, 0.3)
    assert a.tokens_left(0.4, S_PER_TOKEN) == 600


def test_the_simulated_router_reads_simulated_time() -> None:
    """`pof sim` drives the real router: a node's progress counts in simulated seconds, not in the
    wall-clock microseconds the simulation takes."""
    p, sim = pof_cluster()
    assert p.router is not None
    p.tick(40.0)
    j = job(0, "new", 0, 8)                       # 8 tokens no node holds
    p.choose(j, list(sim.nodes), 40.0)
    b, s = j.ticket.backend, p.router.cost.s_per_token
    assert b.busy_since == 40.0 and b.waiting_tokens == 8
    p.tick(40.0 + 2.5 * s)                        # the time 2.5 of its tokens take
    assert b.tokens_left(p.router._clock(), s) == 5


def test_the_fallback_weighs_what_a_node_still_owes_too() -> None:
    """Without the index (or with policy ``least_loaded``) the least loaded backend is the one with
    the least prefill left, as in the weighing, not the fewest tokens sent."""
    router, clock = two_nodes()
    a, b = router.backends
    a.admit(1283)
    clock[0] = 1.1
    b.admit(1248)
    clock[0] = 1.2
    d = router.choose(None)                       # no tokens: the least loaded backend
    assert d.reason == "fallback:no_tokens" and d.backend is a, d


def test_a_session_sticks_for_its_time_by_the_routers_clock() -> None:
    """A session's node is kept for STICKY_TTL_S by the router's clock: `pof sim` counts it in
    simulated seconds, as it counts everything else."""
    router, clock = two_nodes()
    first = router.choose(list(range(100)), session="s")
    clock[0] = STICKY_TTL_S - 1
    assert router.choose(list(range(100)), session="s").reason == "sticky"
    first.backend.admit(5000)                     # its node is now the busier by far
    clock[0] = STICKY_TTL_S + 1
    later = router.choose(list(range(100)), session="s")
    assert later.reason == "pof" and later.backend is not first.backend, later
