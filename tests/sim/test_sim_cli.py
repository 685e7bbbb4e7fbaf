"""`pof sim` end to end on small runs, and the goodput search on a known threshold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pof_connector.cli import main
from pof_connector.sim.counters import Counters
from pof_connector.sim.goodput_search import search
from pof_connector.sim.trial_result import TrialResult


def fake(factor: float, passed: bool) -> TrialResult:
    return TrialResult("x", factor, 1, 1.0, 0.1, 0.1, 0, passed, False, Counters(), 0.0, 0.0, 0.0, 0.0)


def test_goodput_search_brackets_the_threshold() -> None:
    seen: list[float] = []

    def trial(f: float) -> TrialResult:
        seen.append(f)
        return fake(f, f <= 3.0)
    g = search(trial)
    assert 2.8 < g.factor <= 3.0 and seen[:3] == [1.0, 2.0, 4.0]
    low = search(lambda f: fake(f, f <= 0.3))
    assert 0.28 < low.factor <= 0.3
    assert search(lambda f: fake(f, False)).factor == 0.0


def test_pof_sim_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--json", "--mix", "prefix-heavy", "--nodes", "2", "--requests", "80",
                 "--profile", "h200", "--seed", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["policies"]) == {"static", "round_robin", "cache_aware", "pof"}
    assert out["slo_ttft_s"] > 0 and out["speed"]["requests_simulated"] > 0
    for p in out["policies"].values():
        assert p["goodput_factor"] > 0 and p["at_goodput"]["passed"]
    assert out["ratio"] == pytest.approx(out["policies"]["pof"]["goodput_factor"]
                                         / out["policies"]["static"]["goodput_factor"], rel=1e-2)


def test_pof_sim_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--mix", "uniform", "--profile", "nope"]) == 1
    assert "no shipped profile" in capsys.readouterr().err
    assert main(["sim", "--mix", "uniform", "--nodes", "0"]) == 1


def test_pof_sim_replays_a_capacity_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [{"at": i * 0.5, "session": f"s{i % 3}", "tenant": "t1", "system_tokens": 1500, "turn_tokens": 300,
              "max_tokens": 64} for i in range(12)]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["sim", "--json", "--trace", str(trace), "--nodes", "2", "--profile", "cpu-bench",
                 "--factor", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 12
