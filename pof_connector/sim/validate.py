"""``pof sim validate``: replay a ``pof bench capacity --json`` run in the simulator and compare, per
set-up, simulated and measured goodput (and p90 TTFT at goodput).

Each set-up is simulated on as many nodes as the bench had servers, with the bench's trace, SLO
(``slo_s``) and goodput search (:func:`~pof_connector.bench.capacity_search.bounded_search`, as many
trials as the bench ran per set-up), so both goodputs come from the same discrete factors.
``max_rel_error`` = the largest |simulated - measured| / measured goodput; ``same_ordering``: every
pair of set-ups compares the same way (higher, lower or equal) in both.

On a grid that coarse, a simulated p90 a few percent over the SLO where the bench's was a few
percent under it is a whole step (19-41 %) of error, and a far miss within one step is none. So
each set-up is also simulated with a finer search (``FINE_TRIALS`` more bisections), and compared
with what the bench measured, which is an interval: its goodput lies between its highest passing
factor and the lowest failing one above it (``measured_bracket``; no failure: unbounded above).
``bracket_error`` is the simulated goodput's distance to that interval relative to the nearer end
(0: inside it); ``max_bracket_error`` the largest over the set-ups; ``same_ordering_bracket``:
every pair of set-ups whose intervals do not overlap (the pairs the bench orders) compares the
same way in the finer simulation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import combinations
from typing import Any

from pof_connector.bench.capacity_search import bounded_search
from pof_connector.sim.bench_run import BENCH_SETUPS, BenchRun, replay_trial
from pof_connector.sim.profile import Profile
from pof_connector.sim.trial_result import TrialResult

TOLERANCE = 0.20
"""The issue's bar: every set-up's simulated goodput within 20 % of the measured."""
FINE_TRIALS = 4
"""Bisections the finer simulated search runs beyond the bench's trials (each halves the step)."""


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def validate(run: BenchRun, profile: Profile) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {}
    intervals: dict[str, tuple[float, float]] = {}
    skipped = []
    for name, measured in run.setups.items():
        if name not in BENCH_SETUPS:
            skipped.append(name)
            continue
        # factor -> its simulated trial: the finer search starts with the bench's own trials, and
        # a simulation is deterministic, so those are run once
        done: dict[float, TrialResult] = {}

        def at_factor(f: float, name: str = name, done: dict[float, TrialResult] = done) -> TrialResult:
            if f not in done:
                done[f] = replay_trial(run, profile, name, f, give_up=True)
            return done[f]
        trials: list[TrialResult] = []

        def trial(f: float, at_factor: Callable[[float], TrialResult] = at_factor,
                  trials: list[TrialResult] = trials) -> bool:
            trials.append(at_factor(f))
            return trials[-1].passed
        factor = bounded_search(trial, run.max_trials)
        at = next((t for t in trials if t.passed and t.factor == factor), None)

        def finer(f: float, at_factor: Callable[[float], TrialResult] = at_factor) -> bool:
            return at_factor(f).passed
        fine = bounded_search(finer, run.max_trials + FINE_TRIALS)
        # a factor's verdict, where it ran several trials (one trial that passed at a factor whose
        # majority failed is no pass)
        low, high = intervals[name] = measured_bracket(measured.get("factors") or measured.get("trials") or [])
        sim_rps = factor * run.base_rps
        meas_rps = float(measured["goodput_rps"])
        meas_at = measured.get("at_goodput") or {}
        rows[name] = {
            "measured_goodput_rps": round(meas_rps, 4), "simulated_goodput_rps": round(sim_rps, 4),
            "measured_factor": measured.get("goodput_factor"), "simulated_factor": round(factor, 4),
            "rel_error": round(abs(sim_rps - meas_rps) / meas_rps, 4) if meas_rps > 0 else
            (0.0 if sim_rps == 0 else None),
            "measured_bracket": [round(low, 4), None if math.isinf(high) else round(high, 4)],
            "simulated_fine_factor": round(fine, 4),
            "bracket_error": round(bracket_error(fine, low, high), 4),
            "measured_p90_ttft_s": meas_at.get("p90_ttft_s"),
            "simulated_p90_ttft_s": None if at is None or math.isinf(at.p90_ttft_s) else round(at.p90_ttft_s, 4),
            "trials": [{"factor": round(t.factor, 4), "passed": t.passed,
                        "p90_ttft_s": None if math.isinf(t.p90_ttft_s) else round(t.p90_ttft_s, 4),
                        "mean_ttft_s": None if math.isinf(t.mean_ttft_s) else round(t.mean_ttft_s, 4)}
                       for t in trials],
        }
    errors = [r["rel_error"] for r in rows.values()]
    brackets = [r["bracket_error"] for r in rows.values()]
    max_bracket = max(brackets) if brackets else None
    # the measurement orders two set-ups only where their intervals do not overlap
    fine_order = all(_sign(rows[a]["simulated_fine_factor"] - rows[b]["simulated_fine_factor"]) == _sign(la - lb)
                     for a, b in combinations(rows, 2)
                     for (la, ha), (lb, hb) in [(intervals[a], intervals[b])]
                     if ha <= lb or hb <= la)
    max_err = None if not errors or any(e is None for e in errors) else max(errors)
    same = all(_sign(rows[a]["simulated_goodput_rps"] - rows[b]["simulated_goodput_rps"])
               == _sign(rows[a]["measured_goodput_rps"] - rows[b]["measured_goodput_rps"])
               for a, b in combinations(rows, 2))

    def order(key: str) -> list[str]:
        return sorted(rows, key=lambda n: -rows[n][key])
    return {"bench": run.source, "profile": profile.name, "servers": run.servers, "slo_s": run.slo_s,
            "max_trials": run.max_trials, "setups": rows, "skipped": skipped, "max_rel_error": max_err,
            "within_tolerance": max_err is not None and max_err <= TOLERANCE, "tolerance": TOLERANCE,
            "max_bracket_error": max_bracket,
            "within_tolerance_bracket": max_bracket is not None and max_bracket <= TOLERANCE,
            "same_ordering_bracket": fine_order,
            "same_ordering": same, "measured_order": order("measured_goodput_rps"),
            "simulated_order": order("simulated_goodput_rps")}


def measured_bracket(trials: list[dict[str, Any]]) -> tuple[float, float]:
    """(highest passing factor, lowest failing factor above it) of a bench set-up's trials, or of its
    factors' verdicts (its ``factors``: one entry per factor, ``passed`` by the bench's pass rule);
    (0, the lowest failure) when none passed, (the highest pass, inf) when none above it failed."""
    passed = [float(t["factor"]) for t in trials if t.get("passed")]
    low = max(passed, default=0.0)
    high = min((float(t["factor"]) for t in trials if not t.get("passed") and float(t["factor"]) > low),
               default=math.inf)
    return low, high


def bracket_error(factor: float, low: float, high: float) -> float:
    """How far ``factor`` lies outside [low, high), relative to the nearer end (0: inside)."""
    if factor < low:
        return (low - factor) / low
    if factor > high:
        return (factor - high) / high
    return 0.0
