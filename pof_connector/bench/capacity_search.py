"""The goodput search of ``pof bench capacity``: the highest load factor at which a set-up still meets
the SLO, bounded by time rather than by a factor.

From factor 1 the search doubles while trials pass (halves while they fail), then bisects
geometrically between the highest pass and the lowest failure above it, until the two are within
``resolution`` of each other. A fixed ceiling made every set-up that reached it tie (ratios of 1.0
that said nothing), so there is none: the search stops when its time budget is spent (no trial
starts after that; the running one completes), after ``max_trials`` trials if given, or at the
safety cap (:data:`SAFETY_CAP`, a factor no CPU host reaches; hit, it is reported like a budget).
A set-up cut while still passing is *at a bound*: its goodput is at least the factor found, and
any ratio taken from it is a bound too (:func:`ratio_bound`).

A search keeps its state, so :meth:`GoodputSearch.run` may be called again with more budget (on a
freshly started fleet) and picks up where it stopped.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

SAFETY_CAP = 1024.0
"""The largest factor tried (and 1 / it the smallest)."""
RESOLUTION = 0.1
"""Bisection stops once the lowest failing factor is within this share above the highest passing one."""
RESOLVED = "resolved"
TIME_BUDGET = "time budget"
CAP = "safety cap"
BURST = "burst"
"""Stop reason of a search capped where the whole trace arrives within one SLO (see
:func:`burst_factor`): the trace can load the fleet no more, so passing there says only that the
fleet drains all of it in time."""
MAX_TRIALS = "max trials"

Clock = Callable[[], float]


class GoodputSearch:
    """One set-up's search: its trials so far and why it stopped."""

    def __init__(self, *, max_trials: int | None = None, resolution: float = RESOLUTION,
                 cap: float = SAFETY_CAP, cap_reason: str = CAP) -> None:
        self.max_trials = max_trials
        self.resolution = resolution
        self.cap = cap
        self.cap_reason = cap_reason
        self.passed = 0.0
        """The highest passing factor (0: none yet)."""
        self.failed = math.inf
        """The lowest failing factor above :attr:`passed` (inf: none yet)."""
        self.trials: list[tuple[float, bool]] = []
        """(factor, passed) in the order they ran."""
        self.stop: str | None = None
        self.spent_s = 0.0

    def next_factor(self) -> float | None:
        """The factor to try next; ``None`` (and :attr:`stop` set) when the search is over whatever
        the time left."""
        if self.max_trials is not None and len(self.trials) >= self.max_trials:
            return self._over(MAX_TRIALS)
        if not self.trials:
            return 1.0
        if math.isinf(self.failed):
            return self._over(self.cap_reason) if self.passed * 2 > self.cap else self.passed * 2
        if self.passed == 0.0:
            return self._over(CAP) if self.failed / 2 < 1 / self.cap else self.failed / 2
        mid = math.sqrt(self.passed * self.failed)
        # a resolution of 0 bisects until the floats meet
        if self.failed <= self.passed * (1 + self.resolution) or mid in (self.passed, self.failed):
            return self._over(RESOLVED)
        return mid

    def _over(self, why: str) -> float | None:
        """``None``: the search is over, for ``why``."""
        self.stop = why
        return None

    def record(self, factor: float, passed: bool) -> None:
        self.trials.append((factor, passed))
        if passed:
            self.passed = max(self.passed, factor)
        else:
            self.failed = min(self.failed, factor)

    def step(self, trial: Callable[[float], bool], budget_s: float | None = None,
             clock: Clock = time.monotonic) -> bool:
        """The next factor's trial; False, with :attr:`stop` set, when the search is over or its
        trials have taken ``budget_s`` seconds in all (:attr:`spent_s`; ``None``: no limit). An
        interleaved bench runs one set-up's step, then another's (:func:`take_turns`)."""
        start = clock()
        self.stop = None
        f = self.next_factor()
        if f is None:
            return False
        if budget_s is not None and self.spent_s >= budget_s:
            self.stop = TIME_BUDGET
            return False
        self.record(f, trial(f))
        self.spent_s += clock() - start
        return True

    def run(self, trial: Callable[[float], bool], budget_s: float | None, clock: Clock = time.monotonic
            ) -> GoodputSearch:
        """Trials until the search is over or ``budget_s`` seconds (``None``: no limit) of them have
        passed in this call; a trial that starts before the budget is spent runs to its end."""
        until = None if budget_s is None else self.spent_s + budget_s
        while self.step(trial, until, clock):
            pass
        return self

    @property
    def at_bound(self) -> bool:
        """Cut while still passing: the goodput is at least :attr:`passed`, how much more unknown."""
        return self.passed > 0 and math.isinf(self.failed)

    @property
    def resumable(self) -> bool:
        """Cut by time while still passing: more time would measure it further."""
        return self.at_bound and self.stop == TIME_BUDGET

    def summary(self) -> dict[str, Any]:
        """What the bench's JSON says about this search."""
        return {"goodput_factor": round(self.passed, 4),
                "failed_at_factor": None if math.isinf(self.failed) else round(self.failed, 4),
                "at_bound": self.at_bound, "bound_reason": self.stop if self.at_bound else None,
                "search": {"stop": self.stop, "spent_s": round(self.spent_s, 1),
                           "order": [[round(f, 4), ok] for f, ok in self.trials]}}


def burst_factor(span_s: float, slo_s: float) -> float:
    """The factor past which a trace of ``span_s`` seconds arrives within one SLO (at most
    :data:`SAFETY_CAP`): beyond it a faster replay loads the fleet no more."""
    return min(SAFETY_CAP, max(1.0, span_s / slo_s))


def take_turns(searches: dict[str, tuple[GoodputSearch, Callable[[float], bool]]], budget_s: float | None,
               clock: Clock = time.monotonic) -> list[str]:
    """Carry several searches on side by side (each with its own trial, a fleet of its own): one
    factor of each in turn, the order rotated by one each round (AB, BA, AB, ... for two), until
    each is over or has spent ``budget_s`` seconds (``None``: no limit) of trials. On a host whose
    speed drifts, every search meets the drift alike. Returns the keys in the order their factors
    ran."""
    order: list[str] = []
    active = list(searches)
    turn = 0
    while active:
        k = turn % len(active)
        for key in active[k:] + active[:k]:
            search, trial = searches[key]
            if search.step(trial, budget_s, clock):
                order.append(key)
            else:
                active.remove(key)
        turn += 1
    return order


def bounded_search(trial: Callable[[float], bool], max_trials: int) -> float:
    """The bench's search run for ``max_trials`` trials, bisecting to the last one: the highest
    passing factor (0: none passed). ``pof sim validate`` replays a bench with it."""
    return GoodputSearch(max_trials=max_trials, resolution=0.0).run(trial, None).passed


def ratio_bound(numerator_at_bound: bool, denominator_at_bound: bool) -> str | None:
    """What a ratio of two goodputs is, given which of them is only a lower bound: ``"lower"``
    (the true ratio is at least it), ``"upper"`` (at most), ``"unknown"`` (both are lower bounds:
    the ratio could be anything) or ``None`` (a measured ratio, within the search's resolution)."""
    if numerator_at_bound and denominator_at_bound:
        return "unknown"
    if numerator_at_bound:
        return "lower"
    return "upper" if denominator_at_bound else None


__all__ = ["BURST", "CAP", "MAX_TRIALS", "RESOLUTION", "RESOLVED", "SAFETY_CAP", "TIME_BUDGET", "GoodputSearch",
           "bounded_search", "burst_factor", "ratio_bound"]
