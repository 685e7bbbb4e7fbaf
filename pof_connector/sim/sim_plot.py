"""The simulator's plots (matplotlib, as ``pof bench capacity --plot`` draws the bench's)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pof_connector.bench.capacity import draw as draw_bench
from pof_connector.config import ConfigError

if TYPE_CHECKING:
    from pof_connector.sim.sim_run import SimReport
    from pof_connector.sim.sweep import SweepPoint


def require_matplotlib() -> None:
    """Fail before a long run, not after it, when ``--plot`` cannot draw."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot: matplotlib is not installed in this Python (pip install 'pof-connector[plot]')") \
            from None


def draw_load(report: SimReport, path: Path) -> None:
    """p90 TTFT against offered load per policy, the SLO dashed (the bench's own plot, fed the
    simulated trials)."""
    results: dict[str, dict[str, Any]] = {
        name: {"trials": [{"offered_rps": t.offered_rps,
                           "p90_ttft_s": None if math.isinf(t.p90_ttft_s) or t.aborted else t.p90_ttft_s,
                           "passed": t.passed} for t in sorted(g.trials, key=lambda t: t.offered_rps)]}
        for name, g in report.goodput.items()}
    draw_bench(results, report.slo_s, path, title=f"pof sim: {report.nodes} x {report.profile}, "
                                                  "p90 TTFT vs offered load")


def draw_sweep(points: list[SweepPoint], path: Path) -> None:
    """Capacity ratio pof / static against node count (one line per mix and long share) and, for
    ``long-context`` with several long shares, against the long share (one line per node count)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shares = sorted({p.long_share for p in points if p.long_share is not None})
    panels = 2 if len(shares) > 1 else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.5), squeeze=False)
    ax = axes[0][0]
    lines: dict[str, list[tuple[int, float]]] = {}
    for p in points:
        ratio = p.report.ratio()
        if ratio is not None:
            label = p.mix + (f" (long {p.long_share:g})" if p.long_share is not None else "")
            lines.setdefault(label, []).append((p.nodes, ratio))
    for label, by_n in lines.items():
        ax.plot(*zip(*sorted(by_n), strict=True), marker="o", label=label)
    ax.axhline(1.0, linestyle=":", color="lightgrey")
    ax.axhline(2.0, linestyle="--", color="grey", label="2x")
    ax.set_xscale("log", base=2)
    counts = sorted({p.nodes for p in points})
    ax.set_xticks(counts, [str(n) for n in counts])
    ax.set_xlabel("nodes")
    ax.set_ylabel("capacity ratio pof / static")
    ax.set_title("what the pool buys, by cluster size")
    ax.legend(fontsize=8)
    if panels == 2:
        ax = axes[0][1]
        by_nodes: dict[int, list[tuple[float, float]]] = {}
        for p in points:
            ratio = p.report.ratio()
            if p.long_share is not None and ratio is not None:
                by_nodes.setdefault(p.nodes, []).append((p.long_share, ratio))
        for n, by_share in sorted(by_nodes.items()):
            ax.plot(*zip(*sorted(by_share), strict=True), marker="o", label=f"{n} nodes")
        ax.axhline(2.0, linestyle="--", color="grey")
        ax.set_xlabel("share of requests from long sessions")
        ax.set_ylabel("capacity ratio pof / static")
        ax.set_title("long-context: by long-request share")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
