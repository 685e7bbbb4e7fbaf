"""How one simulated run is set up."""

from __future__ import annotations

from dataclasses import dataclass

TIERS = ("none", "private", "shared")


@dataclass(frozen=True)
class SimConfig:
    nodes: int
    rate_factor: float = 1.0
    """Arrival times are the trace's divided by this (2: twice the load)."""
    slo_s: float | None = None
    """p90 TTFT bound; ``None``: no SLO (the run is never given up early)."""
    drain_s: float = 120.0
    """Simulated seconds after the last arrival before requests still without a first token fail."""
    samples: int = 200
    """KV-usage samples over the arrivals' span (the fragmentation spread)."""
    metrics_interval_s: float = 0.5
    """How often the policy is told to read the nodes' metrics (the router's ``metrics_interval_s``)."""
    give_up: bool = True
    """Stop a run that has failed the SLO (a failure, or too many late first tokens); off for
    speed checks, which must simulate every request."""
    late_share: float = 0.1
    """Give up once more than this share of requests got their first token later than the SLO."""
    tiers: str | None = None
    """The nodes' tier memory: ``none``, ``private`` (each node loads only what it stored) or
    ``shared`` (the pool); ``None``: the policy's own (``shared`` for pof, else ``none``)."""

    def __post_init__(self) -> None:
        if self.tiers not in (None, *TIERS):
            raise ValueError(f"tiers: {self.tiers!r}; allowed: {', '.join(TIERS)}")

