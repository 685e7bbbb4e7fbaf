"""A move is priced for what it displaces (``cost.displacement_weight``): the node without the
prefix allocates what the holder has cached, evicting as much of other conversations' context. A
holder with a short queue keeps the request a weight-0 router would move to an idle node that loads
the prefix; a long queue still moves it, and the price shows in the decision."""

from __future__ import annotations

import pytest

from pof_connector.index.base import NodeInfo
from pof_connector.locality.locator import Locality, NodeLocality
from pof_connector.router.router import Decision, Router
from pof_connector.router.router_config import RouterConfig

PAGE = 16
PROMPT = 4096
HELD = 4000
FETCH_S = 0.2
"""Seconds the idle node takes to load the holder's 4,000 tokens at the remote tier's 3 GB/s."""
INFO = NodeInfo("x", meta={"page_bytes": str(int(FETCH_S * 3e9 / HELD * PAGE)), "model": "m"})


class FixedLocator:
    def __init__(self, answer: Locality) -> None:
        self.answer = answer

    def locate(self, tokens: list[int], model: str | None = None, cache_salt: str | None = None) -> Locality:
        return self.answer


def decide(weight: float, queued_tokens: int, *, pool: bool = True) -> Decision:
    """The choice between ``holder`` (its engine caches 4,000 of the prompt's 4,096 tokens, one
    request of ``queued_tokens`` waits there) and ``idle`` (nothing cached; its pool loads the
    4,000 tokens when ``pool``, else it recomputes them), learning off: the start coefficients
    (0.02 s a request, 2e-4 s a token)."""
    config = RouterConfig.from_mapping({
        "policy": "pof", "backends": [{"name": "holder", "url": "http://h.invalid"},
                                      {"name": "idle", "url": "http://i.invalid"}],
        "cost": {"learn": False, "displacement_weight": weight}})
    nodes = {"holder": NodeLocality("holder", PAGE, {}, HELD, {}, 0, None, INFO),
             "idle": NodeLocality("idle", PAGE, {}, 0, {"remote": HELD} if pool else {}, 0, None, INFO)}
    # a clock that stands still: the queued request has computed none of its tokens yet
    router = Router(config, FixedLocator(Locality("m", PROMPT, PAGE, nodes)), clock=lambda: 0.0)
    router.backends[0].admit(queued_tokens)
    return router.choose(list(range(PROMPT)), max_tokens=16)


def test_without_the_price_a_short_queue_moves_the_request_to_a_node_that_loads_the_prefix() -> None:
    # holder: 0.02 x 2 + 2e-4 x (1,000 + 96) = 0.259 s; idle: 0.02 + 2e-4 x 96 + 0.2 = 0.239 s
    d = decide(0.0, 1000)
    assert (d.backend.name, d.route, d.displacement_s) == ("idle", "lower-cost", 0.0)


def test_priced_for_what_it_evicts_the_same_move_stays_on_the_holder() -> None:
    d = decide(1.0, 1000)
    assert (d.backend.name, d.route, d.displacement_s) == ("holder", "prefix-holder", 0.0)
    assert d.estimate is not None and d.estimate.ttft_s == pytest.approx(0.2592)   # the estimate is unchanged


def test_a_long_queue_still_moves_it_and_the_decision_carries_the_price() -> None:
    # holder: 0.04 + 2e-4 x 3,096 = 0.659 s; idle: 0.239 s + the displaced 0.2 s
    d = decide(1.0, 3000)
    assert (d.backend.name, d.route) == ("idle", "lower-cost")
    assert d.displacement_s == pytest.approx(FETCH_S, rel=1e-3)
    assert d.estimate is not None and d.estimate.ttft_s == pytest.approx(0.2392, rel=1e-3)


def test_without_a_pool_the_price_is_the_recompute() -> None:
    # idle recomputes the 4,000 tokens (0.8 s more): the move displaces as much again
    assert decide(0.0, 4500, pool=False).backend.name == "idle"          # 0.96 s against 0.84 s
    d = decide(1.0, 4500, pool=False)
    assert d.backend.name == "holder"
    assert decide(1.0, 9000, pool=False).displacement_s == pytest.approx(HELD * 2e-4)
