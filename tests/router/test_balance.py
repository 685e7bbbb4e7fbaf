"""Routing for load when locality is worth less than the estimates can tell: the router takes the
least loaded backend with KV room unless the lowest estimate beats it by more than the cost
model's measured error (``cost.balance_within_error``). The index's answer is given directly (a
fixed locality), so the rule is judged on its own; tests/router/test_weighing.py checks it
against a written-out reference on random clusters."""

from __future__ import annotations

from pof_connector.index.base import NodeInfo
from pof_connector.locality.locator import Locality, NodeLocality
from pof_connector.router.cost_model import Candidate
from pof_connector.router.router import Router
from pof_connector.router.router_config import RouterConfig

PAGE = 16
INFO = NodeInfo("x", meta={"page_bytes": str(PAGE * 1024), "model": "m"})
PROMPT = 2048


class FixedLocator:
    def __init__(self, answer: Locality) -> None:
        self.answer = answer

    def locate(self, tokens: list[int], model: str | None = None, cache_salt: str | None = None) -> Locality:
        return self.answer


def router_with(nodes: dict[str, NodeLocality], *, balance: bool = True) -> Router:
    cfg = RouterConfig.from_mapping({
        "policy": "pof", "backends": [{"name": "a", "url": "http://a.invalid"}, {"name": "b", "url": "http://b.invalid"}],
        "cost": {"balance_within_error": balance, "learn": False}})
    return Router(cfg, FixedLocator(Locality("m", PROMPT, PAGE, nodes)))


def shared_pool() -> dict[str, NodeLocality]:
    """a holds the prompt in its engine cache; b can load it from a pool both read."""
    return {"a": NodeLocality("a", PAGE, {}, PROMPT, {"cxl": PROMPT}, 0, None, INFO),
            "b": NodeLocality("b", PAGE, {}, 0, {"cxl": PROMPT}, 0, None, INFO)}


def miss_by(router: Router, seconds: float) -> None:
    """Have the cost model observe estimates off by ``seconds``."""
    est = router.cost.estimate(Candidate("a", 100))
    for _ in range(20):
        router.cost.observe(est, est.ttft_s + seconds)


def busy(router: Router, name: str) -> None:
    b = next(x for x in router.backends if x.name == name)
    b.first_token(b.admit(0))         # decoding: running, nothing waiting
    b.admit(0)


def test_before_any_observation_the_lowest_estimate_decides() -> None:
    router = router_with(shared_pool())
    chosen = {router.choose(list(range(PROMPT))).route for _ in range(4)}
    assert router.cost.error_s == 0.0       # no TTFT observed: nothing to balance within
    assert chosen == {"prefix-holder"}


def test_a_gain_within_the_measured_error_goes_to_the_least_loaded() -> None:
    for busier, least in (("a", "b"), ("b", "a")):
        router = router_with(shared_pool())
        miss_by(router, 0.5)
        busy(router, busier)
        d = router.choose(list(range(PROMPT)))
        assert d.backend.name == least, (busier, d)
        assert d.balance is not None and d.balance[1] > 0.4


def test_idle_equals_take_turns_rather_than_all_going_to_the_holder() -> None:
    router = router_with(shared_pool())
    miss_by(router, 0.05)             # b's pool load costs less than the estimates' error
    chosen = [router.choose(list(range(PROMPT))).backend.name for _ in range(8)]
    assert sorted(set(chosen)) == ["a", "b"], chosen
    assert chosen.count("b") >= 3, chosen
    off = router_with(shared_pool(), balance=False)
    miss_by(off, 0.05)
    assert {off.choose(list(range(PROMPT))).backend.name for _ in range(8)} == {"a"}


def test_a_gain_larger_than_the_error_keeps_the_holder() -> None:
    # no pool: b would recompute 2,048 tokens (0.4 s at the start value), a computes one
    private = {"a": NodeLocality("a", PAGE, {"cpu_dram": PROMPT}, PROMPT, {"cpu_dram": PROMPT}, PROMPT, None, INFO)}
    router = router_with(private)
    miss_by(router, 0.05)
    busy(router, "a")                 # the least loaded is b, which would recompute the prompt
    chosen = {router.choose(list(range(PROMPT))).backend.name for _ in range(8)}
    assert chosen == {"a"}
    d = router.choose(list(range(PROMPT)))
    assert d.route == "prefix-holder" and d.balance is not None and d.balance[0] > d.balance[1]
