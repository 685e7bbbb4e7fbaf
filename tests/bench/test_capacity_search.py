"""``pof bench capacity``'s goodput search without a factor ceiling, driven by a model of trials and
a fake clock: a set-up that keeps passing stops at its time budget and is reported at a bound, one
that fails is bracketed and bisected, ratios taken from a bound say so."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest

from pof_connector.bench.capacity_fleet import FleetSpec
from pof_connector.bench.capacity_report import report, setup_row
from pof_connector.bench.capacity_search import (
    BURST,
    CAP,
    MAX_TRIALS,
    RESOLVED,
    SAFETY_CAP,
    TIME_BUDGET,
    GoodputSearch,
    burst_factor,
    ratio_bound,
    take_turns,
)


class Model:
    """Trials that pass up to ``goodput`` and take the trace's span at that pace plus a drain, on
    a clock of their own."""

    def __init__(self, goodput: float, span_s: float = 120.0, drain_s: float = 20.0) -> None:
        self.goodput, self.span_s, self.drain_s = goodput, span_s, drain_s
        self.now = 0.0
        self.seen: list[float] = []

    def clock(self) -> float:
        return self.now

    def trial(self, factor: float) -> bool:
        self.seen.append(factor)
        self.now += self.span_s / factor + self.drain_s
        return factor <= self.goodput


def search(model: Model, budget_s: float | None, **kw: float | int | None) -> GoodputSearch:
    return GoodputSearch(**kw).run(model.trial, budget_s, model.clock)  # type: ignore[arg-type]


def test_a_setup_that_passes_everything_stops_at_its_time_budget_and_is_at_a_bound() -> None:
    m = Model(goodput=math.inf)
    s = search(m, 350.0)
    # x16 ends at 332.5 s, x32 starts before 350 s and runs to its end (356.25 s), no trial after it
    assert m.seen == [1, 2, 4, 8, 16, 32]
    assert s.stop == TIME_BUDGET and s.at_bound and s.resumable and s.passed == 32
    summary = s.summary()
    assert summary["at_bound"] is True and summary["bound_reason"] == "time budget"
    assert summary["goodput_factor"] == 32 and summary["failed_at_factor"] is None
    assert summary["search"]["order"][-1] == [32, True] and summary["search"]["spent_s"] >= 350


def test_the_search_picks_up_where_its_budget_cut_it() -> None:
    m = Model(goodput=100.0)
    s = search(m, 300.0)
    assert s.stop == TIME_BUDGET and s.passed == 8 and m.seen == [1, 2, 4, 8]
    s.run(m.trial, 1000.0, m.clock)                          # more time, on a fresh fleet
    assert m.seen[:8] == [1, 2, 4, 8, 16, 32, 64, 128]         # on from x16: no factor tried twice
    assert s.stop == RESOLVED and not s.at_bound and s.passed <= 100 < s.failed


def test_a_setup_that_fails_is_bracketed_and_bisected_to_the_resolution() -> None:
    m = Model(goodput=5.0)
    s = search(m, None)
    assert m.seen[:4] == [1, 2, 4, 8]                         # doubling until the first failure
    assert m.seen[4] == pytest.approx(math.sqrt(32))          # then geometric bisection inside [4, 8]
    assert s.stop == RESOLVED and not s.at_bound and s.summary()["bound_reason"] is None
    assert s.passed <= 5 < s.failed <= s.passed * 1.1
    assert all(4 < f < 8 for f in m.seen[4:])                 # every bisection inside the first bracket


def test_a_setup_that_fails_at_once_is_halved_then_bisected() -> None:
    m = Model(goodput=0.3)
    s = search(m, None, resolution=0.2)
    assert m.seen[:3] == [1, 0.5, 0.25]
    assert s.stop == RESOLVED and 0.25 <= s.passed <= 0.3 < s.failed <= s.passed * 1.2


def test_past_the_burst_factor_the_search_stops_at_a_bound() -> None:
    """A 116 s trace under a 2.96 s SLO arrives within one SLO from x39 on: a set-up that drains
    the whole trace in time passes there, and a faster replay would only say so again (a run on
    the long-context trace went on to x790)."""
    cap = burst_factor(116.2, 2.96)
    assert 39 < cap < 40 and burst_factor(1.0, 10.0) == 1.0 and burst_factor(1e9, 1.0) == SAFETY_CAP
    s = GoodputSearch(cap=cap, cap_reason=BURST).run(lambda f: True, budget_s=None)
    assert s.stop == BURST and s.passed == 32 and s.at_bound and not s.resumable
    assert s.summary()["bound_reason"] == BURST
    t = GoodputSearch(cap=cap, cap_reason=BURST).run(lambda f: f < 20, budget_s=None)
    assert t.stop == RESOLVED and not t.at_bound          # a set-up that fails below it is measured


def test_the_safety_cap_is_reported_as_a_bound_and_the_trial_limit_too() -> None:
    up = search(Model(goodput=math.inf), None)
    assert up.stop == CAP and up.passed == SAFETY_CAP and up.at_bound and not up.resumable
    assert up.summary()["bound_reason"] == "safety cap"
    down = search(Model(goodput=0.0), None)
    assert down.stop == CAP and down.passed == 0 and not down.at_bound and down.failed == 1 / SAFETY_CAP
    few = search(Model(goodput=math.inf), None, max_trials=3)
    assert few.stop == MAX_TRIALS and few.passed == 4 and few.summary()["bound_reason"] == "max trials"


def row(goodput: float, failed: float | None, at_bound: bool) -> dict[str, object]:
    return {"goodput_rps": goodput, "failed_at_rps": failed, "at_bound": at_bound, "at_reference_load": None,
            "trials": []}


def summarize(rows: dict[str, dict[str, object]]) -> dict[str, object]:
    return report(rows, {}, {"requests": 20}, 1.0, 0.25, FleetSpec(2, 10, 16, 256, 4), 1, None, Path("m"),
                  search={"time_budget_s_per_setup": 300.0})


@pytest.mark.parametrize(("pof", "static", "bound"), [(True, False, "lower"), (False, True, "upper"),
                                                      (True, True, "unknown"), (False, False, None)])
def test_a_ratio_taken_from_a_setup_at_a_bound_is_flagged(pof: bool, static: bool, bound: str | None) -> None:
    assert ratio_bound(pof, static) == bound
    out = summarize({"static": row(2.0, None if static else 3.0, static), "pof": row(8.0, None if pof else 9.0, pof)})
    assert out["ratio"] == 4.0 and out["ratio_bound"] == bound
    assert out["ratio_vs_best_bound"] == bound and out["best_other"] == "static"
    assert out["at_bound"] == [n for n, b in (("pof", pof), ("static", static)) if b]
    assert out["search"] == {"time_budget_s_per_setup": 300.0}


def test_the_best_other_at_a_bound_makes_ratio_vs_best_an_upper_bound() -> None:
    out = summarize({"static": row(1.0, 2.0, False), "round_robin": row(4.0, None, True),
                     "pof": row(4.0, 5.0, False)})
    assert out["ratio_bound"] is None and out["best_other"] == "round_robin"
    assert out["ratio_vs_best"] == 1.0 and out["ratio_vs_best_bound"] == "upper"


def test_a_setup_row_holds_the_trials_around_its_goodput() -> None:
    m = Model(goodput=5.0)
    s = search(m, None)
    trials = [{"factor": round(f, 4), "passed": ok} for f, ok in s.trials]
    r = setup_row(s, trials, base_rps=0.5)
    assert r["goodput_factor"] == round(s.passed, 4) and r["failed_at_factor"] == round(s.failed, 4)
    assert r["goodput_rps"] == round(s.passed * 0.5, 4) and r["at_goodput"] == {"factor": round(s.passed, 4),
                                                                                "passed": True}
    assert r["at_reference_load"] == {"factor": 1.0, "passed": True} and r["at_bound"] is False
    assert [t["factor"] for t in r["trials"]] == sorted(t["factor"] for t in trials)



class Host:
    """One clock for several set-ups' trials, and a host that slows down as it runs (``slowdown``
    per second: what a VM whose burst ends, or a busier neighbour, does to a bench): a set-up's
    capacity at time t is ``goodput / (1 + slowdown * t)``."""

    def __init__(self, slowdown: float = 0.0) -> None:
        self.now, self.slowdown = 0.0, slowdown
        self.ran: list[tuple[str, float]] = []

    def clock(self) -> float:
        return self.now

    def setup(self, name: str, goodput: float) -> Callable[[float], bool]:
        def trial(factor: float) -> bool:
            ok = factor <= goodput / (1 + self.slowdown * self.now)
            self.ran.append((name, factor))
            self.now += 120.0 / factor + 20.0
            return ok
        return trial


def test_side_by_side_searches_take_turns_in_rotated_order_and_end_as_they_would_alone() -> None:
    host = Host()
    a, b = GoodputSearch(), GoodputSearch()
    order = take_turns({"a": (a, host.setup("a", 5.0)), "b": (b, host.setup("b", 3.0))}, None, host.clock)
    # round 0: a then b; round 1: b then a; ... while both run
    assert order[:6] == ["a", "b", "b", "a", "a", "b"]
    assert order == [name for name, _ in host.ran]
    alone_a, alone_b = search(Model(5.0), None), search(Model(3.0), None)
    assert (a.passed, a.failed, a.stop) == (alone_a.passed, alone_a.failed, alone_a.stop)
    assert (b.passed, b.failed, b.stop) == (alone_b.passed, alone_b.failed, alone_b.stop)
    assert order.count("a") == len(a.trials) and order.count("b") == len(b.trials)


def test_side_by_side_each_search_keeps_its_own_time_budget() -> None:
    host = Host()
    fast, slow = GoodputSearch(), GoodputSearch()
    take_turns({"fast": (fast, host.setup("fast", math.inf)), "slow": (slow, host.setup("slow", 1.5))}, 300.0,
               host.clock)
    # each stops once its own trials took 300 s (the last one, begun before, runs to its end)
    assert fast.stop == TIME_BUDGET and fast.resumable and fast.passed == 8 and 300.0 <= fast.spent_s < 340.0
    assert slow.stop == TIME_BUDGET and not slow.resumable and slow.passed <= 1.5 < slow.failed
    assert 300.0 <= slow.spent_s < 340.0 and host.now == fast.spent_s + slow.spent_s


def test_on_a_host_that_slows_down_side_by_side_ranks_two_equal_setups_equal_and_one_after_another_does_not(
        ) -> None:
    """The order effect stop 57 measured (the second fleet of a run lost a sixth of its goodput,
    whichever it was), in the model: two equal set-ups one after another come out apart; side by
    side they come out within one bisection step of each other."""
    seq = Host(slowdown=1 / 1500)
    first = GoodputSearch().run(seq.setup("first", 4.0), None, seq.clock)
    second = GoodputSearch().run(seq.setup("second", 4.0), None, seq.clock)
    assert second.passed < first.passed / 1.2
    host = Host(slowdown=1 / 1500)
    a, b = GoodputSearch(), GoodputSearch()
    take_turns({"a": (a, host.setup("a", 4.0)), "b": (b, host.setup("b", 4.0))}, None, host.clock)
    assert max(a.passed, b.passed) / min(a.passed, b.passed) <= 1 + 2 * a.resolution
