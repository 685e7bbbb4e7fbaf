"""The statistics of ``pof bench capacity``: repeated trials per load factor and the rule that makes a
factor pass, goodput ratios as intervals, and the spread of ``static`` over several namings.

**Trials per factor.** One trial on a shared 2-core host is a noisy sample (the OS, the other
server, a compile): a factor is tried ``trials`` times (each with fresh token content) and passes
by ``rule``:

- ``majority`` (the default): more than half of its trials meet the SLO. One unlucky trial neither
  sinks a set-up nor lifts it, and a factor is decided as soon as the outcome is certain (2 of 3
  alike): a factor that clearly passes or clearly fails costs 2 trials, not 3.
- ``all``: every trial meets it (stops at the first miss): the stricter reading, "sustains".

**Intervals.** The search brackets a set-up's goodput: at least its highest passing load, below the
lowest failing one (none: it never failed, the goodput is only a lower bound). A ratio of two
set-ups' goodputs is then an interval, [A passed / B failed, A failed / B passed]; a side that
never failed opens it: ``>= x`` when A never failed (or B passed nothing), ``<= y`` when B never
failed.

**Headroom.** On a fleet whose limit is its engines' throughput, a pool raises capacity only by
the work it saves: the tokens a set-up computed again. A set-up that recomputed a share ``s`` of
its engines' tokens at the load where it failed would, with all of them saved, need ``1 - s`` of
the work per request, so no pool lifts its goodput by more than about ``1 / (1 - s)``. Tokens are
not seconds (a long prompt's tokens cost more than a short one's, a decode step more than a prefill
token in a batch), so this is a guide to what could be won, not a proof.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

PASS_RULES = ("majority", "all")
TRIALS_PER_FACTOR = 3


def needed(trials: int, rule: str) -> int:
    """Trials of a factor that must pass for it to pass."""
    if rule not in PASS_RULES:
        raise ValueError(f"pass rule {rule!r}; allowed: {', '.join(PASS_RULES)}")
    if trials < 1:
        raise ValueError(f"trials per factor must be at least 1, got {trials}")
    return trials if rule == "all" else trials // 2 + 1


def verdict(results: list[bool], trials: int, rule: str) -> bool | None:
    """Whether a factor with these trial ``results`` passes; ``None``: not decided yet (the trials
    still to run could go either way)."""
    need = needed(trials, rule)
    passes = sum(results)
    fails = len(results) - passes
    if passes >= need:
        return True
    if fails > trials - need:
        return False
    return None


def repeated(trial: Callable[[float], bool], trials: int, rule: str,
             on_verdict: Callable[[float, list[bool], bool], None] | None = None) -> Callable[[float], bool]:
    """``trial`` (one run at a factor: did it meet the SLO?) as a factor's verdict: run until
    :func:`verdict` decides. ``on_verdict(factor, results, passed)``: told each verdict."""
    needed(trials, rule)          # a bad rule fails here, before any trial runs

    def factor(f: float) -> bool:
        results: list[bool] = []
        while (decided := verdict(results, trials, rule)) is None:
            results.append(trial(f))
        if on_verdict is not None:
            on_verdict(f, results, decided)
        return decided
    return factor


def ratio_interval(a_passed: float, a_failed: float | None, b_passed: float,
                   b_failed: float | None) -> dict[str, Any]:
    """Where goodput A / goodput B lies, from each one's search bracket (``*_passed``: its highest
    passing load, 0 when none passed; ``*_failed``: its lowest failing load, ``None`` when it never
    failed). ``low`` / ``high``: the bounds (``None``: open that side); ``text``: ``[x, y]``,
    ``>= x``, ``<= y`` or ``unknown``."""
    low = round(a_passed / b_failed, 4) if b_failed else None
    high = round(a_failed / b_passed, 4) if a_failed is not None and b_passed > 0 else None
    if low is not None and high is not None:
        text = f"[{low:g}, {high:g}]"
    elif low is not None:
        text = f">= {low:g}"
    elif high is not None:
        text = f"<= {high:g}"
    else:
        text = "unknown"
    return {"low": low, "high": high, "text": text}


def interval_of(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """:func:`ratio_interval` of two set-ups' rows (``goodput_rps``, ``failed_at_rps``)."""
    return ratio_interval(a["goodput_rps"], a.get("failed_at_rps"), b["goodput_rps"], b.get("failed_at_rps"))


def spread(values: list[float]) -> dict[str, float] | None:
    """min / median / max of ``values`` (``None``: none)."""
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def median_row(rows: dict[str, dict[str, Any]]) -> str:
    """The name of the row whose goodput is the median (the lower middle one of an even count;
    ties broken by the failing load, then the name): the one that stands for them all."""
    ordered = sorted(rows, key=lambda n: (rows[n]["goodput_rps"], rows[n].get("failed_at_rps") or float("inf"), n))
    return ordered[(len(ordered) - 1) // 2]


def recompute_headroom(row: dict[str, Any]) -> dict[str, Any] | None:
    """What saving every recomputed token could add to a set-up's goodput (see the module's
    docstring), from its ``row``'s trials at its lowest failing factor, or at its goodput's when it
    never failed. ``None``: no trial there counted the engines' tokens."""
    factor = row.get("failed_at_factor") or row.get("goodput_factor")
    if not factor:
        return None
    trials = [t for t in row.get("trials", []) if t["factor"] == round(factor, 4) and t.get("tokens_computed")]
    computed = sum(t["tokens_computed"] for t in trials)
    if computed <= 0:
        return None
    recomputed = sum(t["tokens_recomputed"] for t in trials)
    share = min(recomputed / computed, 0.99)
    return {"factor": round(factor, 4), "trials": len(trials), "tokens_computed": computed,
            "tokens_recomputed": recomputed, "recomputed_share": round(share, 4),
            "ceiling": round(1.0 / (1.0 - share), 4)}


__all__ = ["PASS_RULES", "TRIALS_PER_FACTOR", "interval_of", "median_row", "needed", "ratio_interval",
           "recompute_headroom", "repeated", "spread", "verdict"]
