"""The paired bootstrap behind `pof bench router`'s interval, on TTFTs given as numbers."""

from __future__ import annotations

import random

from pof_connector.bench.router_stats import goal_verdict, ratio_interval

STOCK = ("round_robin", "power_of_two")


def _round(pof: list[float], rr: list[float], p2: list[float]) -> dict[str, list[float]]:
    return {"pof": pof, "round_robin": rr, "power_of_two": p2}


def test_noise_that_pairs_cancels_and_noise_that_does_not_widens_the_interval() -> None:
    rnd = random.Random(1)
    costs = [rnd.expovariate(5) for _ in range(80)]
    paired = _round([c * 0.9 for c in costs], [c * 1.3 for c in costs], costs)
    lo, hi = ratio_interval([paired], STOCK)
    assert 0.89 <= lo <= hi <= 0.91
    # the same means, each router's requests shuffled: nothing pairs any more
    shuffled = _round(rnd.sample(paired["pof"], 80), paired["round_robin"], rnd.sample(costs, 80))
    lo2, hi2 = ratio_interval([shuffled], STOCK)
    assert lo2 < 0.85 and hi2 > 0.95 and lo2 < 0.9 < hi2


def test_the_best_stock_router_is_chosen_in_each_resample_and_rounds_are_pooled() -> None:
    # round_robin and power_of_two trade places between rounds; pooled they tie at 0.2
    a = _round([0.1] * 20, [0.1] * 20, [0.3] * 20)
    b = _round([0.1] * 20, [0.3] * 20, [0.1] * 20)
    assert ratio_interval([a, b], STOCK) == (0.5, 0.5)
    assert ratio_interval([a], STOCK) == (1.0, 1.0)


def test_the_verdict_needs_the_whole_interval_on_one_side_of_the_goal() -> None:
    assert goal_verdict((0.70, 0.79), 0.8) == "met"
    assert goal_verdict((0.70, 0.80), 0.8) == "met"
    assert goal_verdict((0.75, 0.85), 0.8) == "undecided"
    assert goal_verdict((0.81, 0.90), 0.8) == "not met"
