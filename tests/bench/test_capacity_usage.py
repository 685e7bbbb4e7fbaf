"""Each server's KV usage over a trial (:class:`~pof_connector.bench.capacity_fleet.UsageSampler`)
and its panels in ``pof bench capacity --plot``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from pof_connector.bench.capacity_fleet import UsageSampler
from pof_connector.bench.capacity_report import draw


class ScriptedFleet:
    """Stands in for a running :class:`~pof_connector.bench.capacity_fleet.Fleet` (two vLLM servers'
    ``/metrics``): its scrapes, one after another, the last repeated."""

    def __init__(self, scrapes: list[list[tuple[float, int, float, float]]]) -> None:
        self.scrapes = scrapes

    def occupancy(self) -> list[tuple[float, int, float, float]]:
        if len(self.scrapes) > 1:
            return self.scrapes.pop(0)
        return self.scrapes[0]


def test_the_sampler_keeps_each_servers_usage_over_time() -> None:
    fleet: Any = ScriptedFleet([[(0.9, 3, 0.0, 0.0), (0.1, 1, 0.0, 0.0)],
                                [(0.95, 4, 0.0, 0.0), (0.0, 0, 0.0, 0.0)]])
    with UsageSampler(fleet, interval_s=0.02) as sampler:
        time.sleep(0.2)
    series = sampler.figures()["kv_usage"]
    n = len(series["t_s"])
    assert n >= 3 and series["t_s"] == sorted(series["t_s"]) and series["t_s"][0] > 0
    first, second = series["by_server"]
    assert first[:2] == [0.9, 0.95] and second[:2] == [0.1, 0.0] and len(first) == len(second) == n
    assert sampler.figures()["spread_mean"] > 0.8           # the same samples as the spread


def test_a_sampler_that_saw_nothing_has_an_empty_series() -> None:
    fleet: Any = ScriptedFleet([[(0.5, 1, 0.0, 0.0)]])
    sampler = UsageSampler(fleet, interval_s=10.0)
    assert sampler.figures()["kv_usage"] == {"t_s": [], "by_server": []}


@pytest.mark.vllm        # matplotlib (the `plot` extra) is in the vLLM venv, where --plot runs
def test_the_plot_adds_a_kv_usage_panel_per_setup_that_sampled_it(tmp_path: Path) -> None:
    import matplotlib.image

    def row(usage: dict[str, Any] | None) -> dict[str, Any]:
        trial = {"factor": 1.0, "offered_rps": 1.0, "passed": True, "p90_ttft_s": 0.2}
        return {"trials": [trial], "at_reference_load": {**trial, **({"kv_usage": usage} if usage else {})}}

    usage = {"t_s": [0.5, 1.0, 1.5], "by_server": [[0.9, 0.95, 1.0], [0.1, 0.0, 0.05]]}
    draw({"static": row(usage), "pof": row(usage)}, 0.5, tmp_path / "with.png")
    draw({"static": row(None), "pof": row(None)}, 0.5, tmp_path / "without.png")
    with_panels = matplotlib.image.imread(tmp_path / "with.png").shape
    without = matplotlib.image.imread(tmp_path / "without.png").shape
    assert with_panels[0] > without[0] * 1.5           # 7.5 in against 4.5 in tall
