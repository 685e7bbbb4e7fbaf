"""The figures of one simulated run at one rate factor."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pof_connector.sim.counters import Counters


@dataclass(frozen=True)
class TrialResult:
    policy: str
    factor: float
    requests: int
    offered_rps: float
    """Arrival rate of the run (requests / s of simulated time)."""
    p90_ttft_s: float
    """``inf`` when over a tenth of the requests got no first token."""
    mean_ttft_s: float
    """Over the requests that got a first token."""
    failed: int
    passed: bool
    """p90 TTFT within the SLO and no request failed."""
    aborted: bool
    """Stopped early: a failure, or enough late first tokens that p90 cannot meet the SLO."""
    counters: Counters
    spread_mean: float
    """Mean over time of max - min KV usage across nodes (0..1)."""
    spread_p90: float
    idle_busiest: float
    """Mean free KV fraction of the fullest node (0..1)."""
    idle_idlest: float
    """Mean free KV fraction of the emptiest node."""
    loaded_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes loaded from the pool, per tier."""
    stored_bytes: int = 0
    events: int = 0
    arrived: int = 0
    """Requests that arrived before the run ended (all of them unless it was given up)."""
    wall_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        c = self.counters
        return {"factor": round(self.factor, 4), "offered_rps": round(self.offered_rps, 3),
                "p90_ttft_s": _r(self.p90_ttft_s), "mean_ttft_s": _r(self.mean_ttft_s), "failed": self.failed,
                "passed": self.passed, "aborted": self.aborted, "preemptions": c.preemptions,
                "computed_tokens": c.computed_tokens, "recomputed_tokens": c.recomputed_tokens,
                "loaded_tokens": c.loaded_tokens, "cache_hit_tokens": c.cache_hit_tokens,
                "spread_mean": round(self.spread_mean, 4), "spread_p90": round(self.spread_p90, 4),
                "idle_busiest": round(self.idle_busiest, 4), "idle_idlest": round(self.idle_idlest, 4),
                "loaded_bytes": self.loaded_bytes, "stored_bytes": self.stored_bytes}


def _r(x: float) -> float | None:
    return None if x == float("inf") else round(x, 4)
