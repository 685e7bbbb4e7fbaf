"""``pof sim``: goodput of each policy on one workload and profile, the capacity ratio pof / static,
and how fast the simulator ran."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pof_connector.bench import nearest_rank
from pof_connector.sim.goodput_search import Goodput, search
from pof_connector.sim.policies import POLICIES, policy_factory
from pof_connector.sim.profile import Profile
from pof_connector.sim.sim_config import SimConfig
from pof_connector.sim.simulator import Simulator
from pof_connector.sim.trial_result import TrialResult
from pof_connector.sim.workload import SimRequest


def unloaded_ttft(profile: Profile, requests: list[SimRequest]) -> float:
    """p90 over the workload's prompts of a cold prefill on an idle node (as the bench measures
    its SLO base: cold prompts, one at a time)."""
    history: dict[str, int] = {}
    ttfts = []
    for r in requests:
        prompt = history.get(r.session, r.system_tokens) + r.turn_tokens
        history[r.session] = prompt + r.max_tokens
        ttfts.append(profile.cold_ttft_s(prompt))
    ttfts.sort()
    return nearest_rank(ttfts, 0.9)


@dataclass(frozen=True)
class SimReport:
    profile: str
    nodes: int
    requests: int
    span_s: float
    slo_s: float
    goodput: dict[str, Goodput]
    simulated: int
    """Requests simulated over all trials."""
    wall_s: float
    cpu_s: float
    """CPU seconds of this process over the trials (the wall clock counts other loads of a shared host)."""

    @property
    def base_rps(self) -> float:
        return self.requests / self.span_s if self.span_s > 0 else 0.0

    def ratio(self, over: str = "static") -> float | None:
        base = self.goodput.get(over)
        pof = self.goodput.get("pof")
        if base is None or pof is None or base.factor <= 0:
            return None
        return pof.factor / base.factor

    def ratio_vs_best(self) -> float | None:
        others = [g.factor for name, g in self.goodput.items() if name != "pof"]
        pof = self.goodput.get("pof")
        if pof is None or not others or max(others) <= 0:
            return None
        return pof.factor / max(others)

    def to_json(self) -> dict[str, Any]:
        return {
            "profile": self.profile, "nodes": self.nodes, "requests": self.requests, "span_s": round(self.span_s, 3),
            "slo_ttft_s": round(self.slo_s, 4), "base_rps": round(self.base_rps, 3),
            "ratio": _r(self.ratio()), "ratio_vs_best": _r(self.ratio_vs_best()),
            "policies": {name: {"goodput_factor": round(g.factor, 4), "goodput_rps": round(g.factor * self.base_rps, 3),
                                "at_goodput": g.best.to_json() if g.best else None, "trials": len(g.trials)}
                         for name, g in self.goodput.items()},
            "speed": {"requests_simulated": self.simulated, "wall_s": round(self.wall_s, 3),
                      "cpu_s": round(self.cpu_s, 3),
                      "requests_per_s": round(self.simulated / self.wall_s, 1) if self.wall_s > 0 else None,
                      "requests_per_cpu_s": round(self.simulated / self.cpu_s, 1) if self.cpu_s > 0 else None},
        }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def run_sim(profile: Profile, requests: list[SimRequest], *, nodes: int, policies: tuple[str, ...] = POLICIES,
            factor: float | None = None, progress: Callable[[str], None] = lambda _: None) -> SimReport:
    """Goodput per policy; with ``factor``, one run per policy at that rate factor instead of the
    search (its 'goodput' is that factor if the run passed, else 0)."""
    slo = profile.slo_multiple * unloaded_ttft(profile, requests)
    span = max(r.at for r in requests) - min(r.at for r in requests)
    started, cpu = time.perf_counter(), time.process_time()
    simulated = 0
    results: dict[str, Goodput] = {}
    for name in policies:
        make = policy_factory(name, profile, requests)

        def trial(f: float, make: Callable[..., Any] = make, name: str = name) -> TrialResult:
            nonlocal simulated
            config = SimConfig(nodes=nodes, rate_factor=f, slo_s=slo, give_up=factor is None)
            r = Simulator(profile, make(), config).run(requests)
            simulated += r.arrived
            progress(f"{name} x{f:.3g}: p90 TTFT {r.p90_ttft_s:.3g} s (SLO {slo:.3g} s), failed {r.failed}, "
                     f"{'pass' if r.passed else 'fail'} ({r.wall_s:.1f} s)")
            return r
        if factor is None:
            results[name] = search(trial)
        else:
            once = trial(factor)
            results[name] = Goodput(factor if once.passed else 0.0, once if once.passed else None, [once])
    return SimReport(profile.name, nodes, len(requests), span, slo, results, simulated,
                     time.perf_counter() - started, time.process_time() - cpu)
