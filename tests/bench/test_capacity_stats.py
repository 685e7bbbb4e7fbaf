"""``pof bench capacity``'s statistics without servers: how many trials a factor runs and when it
passes, goodput ratios as intervals with ``>=`` when a side never failed, static's spread."""

from __future__ import annotations

import pytest

from pof_connector.bench.capacity_search import GoodputSearch
from pof_connector.bench.capacity_stats import (
    interval_of,
    median_row,
    needed,
    ratio_interval,
    recompute_headroom,
    repeated,
    spread,
    verdict,
)


def test_majority_of_three_is_decided_as_soon_as_it_is_certain() -> None:
    assert needed(3, "majority") == 2 and needed(4, "majority") == 3 and needed(1, "majority") == 1
    assert verdict([], 3, "majority") is None
    assert verdict([True], 3, "majority") is None
    assert verdict([True, True], 3, "majority") is True             # the third cannot change it
    assert verdict([False, False], 3, "majority") is False
    assert verdict([True, False], 3, "majority") is None
    assert verdict([True, False, True], 3, "majority") is True
    assert verdict([False, True, False], 3, "majority") is False


def test_all_fails_at_the_first_miss() -> None:
    assert needed(3, "all") == 3
    assert verdict([True, True], 3, "all") is None
    assert verdict([True, True, True], 3, "all") is True
    assert verdict([False], 3, "all") is False


def test_bad_rules_and_counts_are_refused_before_a_trial_runs() -> None:
    with pytest.raises(ValueError, match="pass rule"):
        repeated(lambda f: True, 3, "most")
    with pytest.raises(ValueError, match="at least 1"):
        needed(0, "majority")


def test_repeated_trials_run_until_the_verdict_and_report_it() -> None:
    outcomes = iter([True, False, True, False, False, True, True])
    seen: list[tuple[float, list[bool], bool]] = []
    ran: list[float] = []

    def one(f: float) -> bool:
        ran.append(f)
        return next(outcomes)

    factor = repeated(one, 3, "majority", on_verdict=lambda f, r, ok: seen.append((f, r, ok)))
    assert factor(1.0) is True and factor(2.0) is False and factor(4.0) is True
    assert ran == [1.0] * 3 + [2.0] * 2 + [4.0] * 2
    assert seen == [(1.0, [True, False, True], True), (2.0, [False, False], False), (4.0, [True, True], True)]


def test_one_trial_per_factor_is_the_plain_search() -> None:
    ran: list[float] = []
    factor = repeated(lambda f: ran.append(f) or f <= 2, 1, "majority")
    search = GoodputSearch(max_trials=4).run(factor, None)
    assert ran == [1.0, 2.0, 4.0, pytest.approx(2 ** 1.5)] and search.passed == 2.0


def test_the_search_counts_factors_not_trials() -> None:
    ran: list[float] = []
    factor = repeated(lambda f: ran.append(f) or f <= 2, 3, "majority")
    search = GoodputSearch(max_trials=3).run(factor, None)
    assert [f for f, _ in search.trials] == [1.0, 2.0, 4.0] and len(ran) == 6       # two alike decide each


def test_ratio_intervals_from_the_brackets() -> None:
    assert ratio_interval(2.0, 2.5, 1.0, 1.25) == {"low": 1.6, "high": 2.5, "text": "[1.6, 2.5]"}
    # A never failed: its goodput is only a lower bound, so is the ratio
    assert ratio_interval(4.0, None, 1.0, 2.0) == {"low": 2.0, "high": None, "text": ">= 2"}
    # B never failed: the ratio is at most A failed / B passed
    assert ratio_interval(1.0, 2.0, 4.0, None) == {"low": None, "high": 0.5, "text": "<= 0.5"}
    assert ratio_interval(4.0, None, 4.0, None)["text"] == "unknown"
    # B passed nothing: no upper bound; A passed nothing: the lower bound is 0
    assert ratio_interval(1.0, 2.0, 0.0, 0.5)["text"] == ">= 2"
    assert ratio_interval(0.0, 0.5, 1.0, 2.0) == {"low": 0.0, "high": 0.5, "text": "[0, 0.5]"}
    rows = {"goodput_rps": 3.0, "failed_at_rps": None}, {"goodput_rps": 1.0, "failed_at_rps": 1.5}
    assert interval_of(*rows)["text"] == ">= 2"


def test_static_namings_spread_and_the_median_naming() -> None:
    rows = {"static": {"goodput_rps": 1.0, "failed_at_rps": 1.2}, "static@2": {"goodput_rps": 0.5},
            "static@3": {"goodput_rps": 2.0, "failed_at_rps": 2.4}}
    assert spread([r["goodput_rps"] for r in rows.values()]) == {"min": 0.5, "median": 1.0, "max": 2.0}
    assert median_row(rows) == "static" and spread([]) is None
    assert median_row({"a": {"goodput_rps": 1.0}, "b": {"goodput_rps": 2.0}}) == "a"      # the lower middle


def _trial(factor: float, computed: int, recomputed: int) -> dict[str, object]:
    return {"factor": factor, "tokens_computed": computed, "tokens_recomputed": recomputed}


def test_headroom_is_the_recomputed_share_where_the_set_up_failed() -> None:
    row = {"goodput_factor": 2.0, "failed_at_factor": 2.8284,
           "trials": [_trial(1.0, 1000, 900), _trial(2.0, 1000, 500),
                      _trial(2.8284, 1000, 200), _trial(2.8284, 3000, 200)]}
    h = recompute_headroom(row)
    assert h is not None
    # only the failing factor's two trials count: 400 of 4,000 tokens were computed again
    assert (h["factor"], h["trials"], h["recomputed_share"]) == (2.8284, 2, 0.1)
    assert h["ceiling"] == pytest.approx(1 / 0.9, abs=1e-4)


def test_headroom_of_a_set_up_that_never_failed_is_taken_at_its_goodput() -> None:
    row = {"goodput_factor": 4.0, "failed_at_factor": None,
           "trials": [_trial(2.0, 1000, 1000), _trial(4.0, 2000, 0)]}
    h = recompute_headroom(row)
    assert h is not None and h["ceiling"] == 1.0 and h["factor"] == 4.0
    assert recompute_headroom({"goodput_factor": 0.0, "failed_at_factor": None, "trials": []}) is None
