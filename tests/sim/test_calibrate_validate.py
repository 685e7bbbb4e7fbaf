"""``pof sim calibrate`` / ``validate`` / ``sweep`` and ``--plot`` on small CPU runs. The bench run is
a real ``pof bench capacity --json --quick`` output of this host (data/capbench-quick.json: 2 vLLM
CPU servers, set-ups static and pof, 2 trials each; per-trial backend counts trimmed)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest

from pof_connector.bench import nearest_rank
from pof_connector.bench.capacity import bounded_search, prompt_sizes
from pof_connector.bench.capacity_trace import Mix, fragmenting_trace, summary, write_trace
from pof_connector.cli import main
from pof_connector.config import ConfigError
from pof_connector.sim.bench_run import load_bench
from pof_connector.sim.calibrate import fit
from pof_connector.sim.profile import Profile, load_profile
from pof_connector.sim.sim_run import unloaded_ttft
from pof_connector.sim.validate import bracket_error, measured_bracket

BENCH = Path(__file__).parent / "data" / "capbench-quick.json"
PNG = b"\x89PNG\r\n\x1a\n"


def test_bounded_search_is_the_benchs() -> None:
    seen: list[float] = []

    def trial(f: float) -> bool:
        seen.append(f)
        return f <= 3.0
    assert bounded_search(trial, 5) == pytest.approx(math.sqrt(8))       # 1, 2, 4 (fails), 2.83, 3.36 (fails)
    assert seen == pytest.approx([1.0, 2.0, 4.0, math.sqrt(8), math.sqrt(math.sqrt(8) * 4)])
    assert bounded_search(lambda f: False, 10) == 0.0
    assert bounded_search(lambda f: True, 10) == 512.0                     # no ceiling: 1, 2, ... 512


def test_bench_trace_is_rebuilt(tmp_path: Path) -> None:
    run = load_bench(BENCH)
    recorded = json.loads(BENCH.read_text())["trace"]
    assert summary(run.trace)["requests"] == recorded["requests"] == 40    # the --quick mix of its seed
    assert summary(run.trace)["max_context_tokens"] == recorded["max_context_tokens"]
    assert run.servers == 2 and run.max_trials == 2

    raw = json.loads(BENCH.read_text())
    mix = Mix(span_s=30.0, long_sessions=2, long_turns=3)
    want = fragmenting_trace(1, mix)
    raw["trace"] = {**summary(want), "source": "seeded fragmenting mix (seed 1)", "mix": asdict(mix), "quick": False}
    (tmp_path / "mix.json").write_text(json.dumps(raw))
    assert load_bench(tmp_path / "mix.json").trace == want                 # trace.mix wins

    write_trace(want, tmp_path / "t.jsonl")
    raw["trace"] = {"source": str(tmp_path / "t.jsonl")}
    (tmp_path / "file.json").write_text(json.dumps(raw))
    assert load_bench(tmp_path / "file.json").trace == want                # a trace file

    raw["trace"] = {"source": "seeded fragmenting mix (seed 1)", "mix": {"nope": 1}}
    (tmp_path / "bad.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"trace\.mix\.nope"):
        load_bench(tmp_path / "bad.json")


def test_calibrate_keeps_the_bench_cluster_and_unloaded_ttft(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    run = load_bench(BENCH)
    f = fit(run)
    p = f.profile
    assert p.kv_blocks * p.block_tokens == run.cluster["kv_tokens_per_server"] and p.max_running == 8
    assert unloaded_ttft(p, run.trace) == pytest.approx(run.unloaded_p90_s, rel=1e-6)
    out = tmp_path / "host.yaml"
    assert main(["sim", "calibrate", "--from", str(BENCH), "-o", str(out), "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    back = load_profile(str(out))                     # the YAML is a loadable profile, with its sources
    assert back.name == "host" and back.kv_blocks == p.kv_blocks
    assert back.prefill_s_per_token == pytest.approx(p.prefill_s_per_token, rel=1e-3)
    assert str(BENCH) in out.read_text().splitlines()[0] and j["fitted_on"] == ["static"]
    assert main(["sim", "calibrate", "--from", str(out)]) == 1           # not a bench JSON
    assert "not a readable JSON" in capsys.readouterr().err


def test_validate_reports_each_setup(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "validate", "--bench", str(BENCH), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    run = load_bench(BENCH)
    assert set(out["setups"]) == {"static", "pof"}
    errors = []
    for name, row in out["setups"].items():
        assert row["measured_goodput_rps"] == json.loads(BENCH.read_text())["setups"][name]["goodput_rps"]
        assert row["simulated_goodput_rps"] == pytest.approx(row["simulated_factor"] * run.base_rps, rel=1e-3)
        assert 1 <= len(row["trials"]) <= run.max_trials and row["trials"][0]["factor"] == 1.0
        errors.append(abs(row["simulated_goodput_rps"] - row["measured_goodput_rps"]) / row["measured_goodput_rps"])
    assert out["max_rel_error"] == pytest.approx(max(errors), abs=1e-3)
    assert isinstance(out["same_ordering"], bool) and out["calibration"]["fitted_on"] == ["static"]
    for name, row in out["setups"].items():
        low, high = measured_bracket(json.loads(BENCH.read_text())["setups"][name]["trials"])
        assert row["measured_bracket"] == [pytest.approx(low, abs=1e-3), None if math.isinf(high) else
                                           pytest.approx(high, abs=1e-3)]
        assert row["bracket_error"] == pytest.approx(bracket_error(row["simulated_fine_factor"], low, high), abs=1e-3)
    assert out["max_bracket_error"] == max(r["bracket_error"] for r in out["setups"].values())
    assert isinstance(out["same_ordering_bracket"], bool)


def test_the_measured_goodput_is_an_interval_and_the_error_is_the_distance_to_it() -> None:
    trials = [{"factor": 1.0, "passed": False}, {"factor": 0.5, "passed": True},
              {"factor": 0.7071, "passed": False}, {"factor": 0.5946, "passed": False}]
    assert measured_bracket(trials) == (0.5, 0.5946)
    assert measured_bracket([{"factor": 1.0, "passed": True}, {"factor": 2.0, "passed": True}]) == (2.0, math.inf)
    assert measured_bracket([{"factor": 1.0, "passed": False}, {"factor": 0.5, "passed": False}]) == (0.0, 0.5)
    assert bracket_error(0.55, 0.5, 0.5946) == 0.0
    assert bracket_error(0.45, 0.5, 0.5946) == pytest.approx(0.1)          # below: relative to the pass
    assert bracket_error(0.7, 0.5, 0.5946) == pytest.approx(0.7 / 0.5946 - 1)   # above: to the failure
    assert bracket_error(100.0, 2.0, math.inf) == 0.0


def has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_sweep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "sweep.png"
    args = ["sim", "sweep", "--json", "--mix", "uniform,long-context", "--nodes", "2", "--long-share", "0.05,0.3",
            "--requests-per-node", "30"]
    assert main(args + (["--plot", str(plot)] if has_matplotlib() else [])) == 0
    out = json.loads(capsys.readouterr().out)
    points = [(p["mix"], p["nodes"], p["long_share"]) for p in out["points"]]
    assert points == [("uniform", 2, None), ("long-context", 2, 0.05), ("long-context", 2, 0.3)]
    for p in out["points"]:
        g = p["goodput_rps"]
        assert set(g) == {"static", "pof"}
        assert p["ratio"] == (round(g["pof"] / g["static"], 3) if g["static"] else None) or \
            p["ratio"] == pytest.approx(g["pof"] / g["static"], rel=2e-3)
    if has_matplotlib():
        assert plot.read_bytes()[:8] == PNG
    assert main(["sim", "sweep", "--mix", "uniform", "--long-share", "0.1", "--nodes", "2"]) == 1
    assert "only mix long-context" in capsys.readouterr().err


def test_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    load = tmp_path / "load.png"
    args = ["sim", "--json", "--mix", "uniform", "--nodes", "2", "--requests", "40", "--policies", "static,pof",
            "--plot", str(load)]
    if not has_matplotlib():                          # the core venv: refused before the run, naming the fix
        assert main(args) == 1
        assert "matplotlib is not installed" in capsys.readouterr().err
        return

    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["plot"] == str(load) and load.read_bytes()[:8] == PNG


def test_calibrate_fits_attentions_growth_from_the_benchs_cold_samples(tmp_path: Path) -> None:
    run = load_bench(BENCH)
    flat = fit(run).profile
    assert run.unloaded_samples == () and flat.prefill_s_per_token_ctx == 0.0      # an older run: a flat cost
    # Cold TTFTs that grow with the square of the prompt (attention over a long context), the p90
    # prompt's being the run's unloaded p90, as the bench's own samples would be.
    n90 = int(nearest_rank(sorted(prompt_sizes(run.trace)), 0.9))
    sizes = [n90 // 8, n90 // 4, n90 // 2, n90]
    cold = [0.02 + (run.unloaded_p90_s - 0.02) * (n / n90) ** 2 for n in sizes]
    raw = json.loads(BENCH.read_text())
    raw["unloaded_samples"] = [[n, t] for n, t in zip(sizes, cold, strict=True)]
    (tmp_path / "quad.json").write_text(json.dumps(raw))
    quad = load_bench(tmp_path / "quad.json")
    p = fit(quad).profile
    assert p.prefill_s_per_token_ctx > 0
    assert unloaded_ttft(p, quad.trace) == pytest.approx(run.unloaded_p90_s, rel=1e-6)

    def error(profile: Profile) -> float:
        return sum(math.log(profile.cold_ttft_s(n) / t) ** 2 for n, t in zip(sizes, cold, strict=True))
    assert error(p) < 0.5 * error(flat)           # the growth is fitted, not only the p90 point

    raw["unloaded_samples"] = [[512, "fast"]]
    (tmp_path / "bad.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="unloaded_samples"):
        load_bench(tmp_path / "bad.json")


def test_calibrate_measures_the_costs_when_the_bench_timed_decode_steps(tmp_path: Path) -> None:
    # samples made from known costs, as the bench records them: the fit must give the costs back
    want = {"decode_step_s": 0.02, "decode_s_per_seq": 0.004, "decode_s_per_ctx_token": 2e-7,
            "request_latency_s": 0.03, "prefill_s_per_token": 4e-5, "prefill_s_per_token_ctx": 7e-8}

    def step(b: int, n: int, steps: int) -> float:
        per_ctx = want["decode_s_per_ctx_token"]
        return want["decode_step_s"] + b * want["decode_s_per_seq"] + b * (n + steps / 2) * per_ctx
    sizes = [1000, 1200, 4000, 9000, 16000]
    raw = json.loads(BENCH.read_text())
    raw["unloaded_samples"] = [[n, want["request_latency_s"] + want["decode_step_s"]
                                + n * (want["prefill_s_per_token"] + want["prefill_s_per_token_ctx"] * n / 2)]
                               for n in sizes]
    raw["decode_samples"] = [[1, n, step(1, n, 16)] for n in sizes] + [[b, 32, step(b, 32, 32)] for b in (4, 8)]
    raw["host_samples"] = [[9000, 2.0, 2.8]]                 # both servers at once: 1.4x as long
    (tmp_path / "timed.json").write_text(json.dumps(raw))
    f = fit(load_bench(tmp_path / "timed.json"))
    for key, value in {**want, "host_slowdown": 0.4}.items():
        assert getattr(f.profile, key) == pytest.approx(value, rel=1e-3), key
    assert "decode samples" in " ".join(f.notes) and f.fitted_on == ("static",)

    raw["decode_samples"] = [[0, 32, 0.1]]                                  # a batch of none
    (tmp_path / "bad.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="decode_samples"):
        load_bench(tmp_path / "bad.json")
