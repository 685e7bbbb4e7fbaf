"""Goodput of one policy: the highest rate factor at which p90 TTFT stays within the SLO and no
request fails, found as ``pof bench capacity`` does: doubling (or halving) from 1 until the
outcome flips, then bisecting the factor geometrically; bounded in both directions."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from pof_connector.sim.trial_result import TrialResult

MAX_FACTOR, MIN_FACTOR = 256.0, 1 / 256


@dataclass(frozen=True)
class Goodput:
    factor: float
    """The highest passing factor (0: none passed down to the lower bound)."""
    best: TrialResult | None
    """The run at that factor (``None``: none passed)."""
    trials: list[TrialResult]


def search(trial: Callable[[float], TrialResult], refine: int = 5) -> Goodput:
    """``trial(factor)`` runs the workload at ``factor`` times its rate."""
    trials: list[TrialResult] = []

    def at(f: float) -> TrialResult:
        r = trial(f)
        trials.append(r)
        return r

    first = at(1.0)
    good: TrialResult | None = first if first.passed else None
    bad_f = math.inf if first.passed else 1.0
    f = 1.0
    while good is not None and f < MAX_FACTOR and bad_f == math.inf:
        f *= 2
        r = at(f)
        if r.passed:
            good = r
        else:
            bad_f = f
    while good is None and f > MIN_FACTOR:
        f /= 2
        r = at(f)
        if r.passed:
            good = r
        else:
            bad_f = f
    if good is None:
        return Goodput(0.0, None, trials)
    for _ in range(refine if bad_f != math.inf else 0):
        mid = math.sqrt(good.factor * bad_f)
        r = at(mid)
        if r.passed:
            good = r
        else:
            bad_f = mid
    return Goodput(good.factor, good, trials)
