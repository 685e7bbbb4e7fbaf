"""``pof sim sweep``: the capacity ratio pof / static across node counts and long-request shares.

Each point is one :func:`~pof_connector.sim.sim_run.run_sim` (the goodput search per policy) on a
built-in mix made for that node count, with ``requests_per_node`` requests per node, so every
point covers the same simulated span at the reference load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pof_connector.sim.mixes import make_mix
from pof_connector.sim.profile import Profile
from pof_connector.sim.sim_run import SimReport, run_sim


@dataclass(frozen=True)
class SweepPoint:
    mix: str
    nodes: int
    long_share: float | None
    """``None``: the mix's own (or it has no long sessions)."""
    report: SimReport

    def to_json(self) -> dict[str, Any]:
        r = self.report
        return {"mix": self.mix, "nodes": self.nodes, "long_share": self.long_share, "ratio": _r(r.ratio()),
                "ratio_vs_best": _r(r.ratio_vs_best()),
                "goodput_rps": {name: round(g.factor * r.base_rps, 3) for name, g in r.goodput.items()},
                "requests": r.requests, "wall_s": round(r.wall_s, 2)}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def run_sweep(profile: Profile, *, mixes: list[str], nodes: list[int], long_shares: list[float | None],
              policies: tuple[str, ...], requests_per_node: int, seed: int,
              progress: Callable[[str], None] = lambda _: None) -> list[SweepPoint]:
    """Every (mix, node count, long share) point; a long share applies to ``long-context`` only
    (the other mixes are run once per node count)."""
    points = []
    for mix in mixes:
        shares = long_shares if mix == "long-context" else [None]
        for n in nodes:
            for share in shares:
                requests = make_mix(mix, nodes=n, requests=requests_per_node * n, seed=seed,
                                    kv_tokens=profile.kv_tokens, long_share=share)
                progress(f"sweep: {mix} on {n} nodes" + (f", long share {share:g}" if share is not None else ""))
                report = run_sim(profile, requests, nodes=n, policies=policies, progress=progress)
                points.append(SweepPoint(mix, n, share, report))
                ratio = report.ratio()
                progress(f"sweep: {mix} x{n}: ratio pof/static " + (f"{ratio:.2f}" if ratio is not None else "n/a"))
    return points
