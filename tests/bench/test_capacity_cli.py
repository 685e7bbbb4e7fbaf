"""``pof bench capacity`` and ``pof bench router`` at argument time: a missing package stops them
before anything starts, naming it and how to install it; the result JSON leaves before any table or
plot, so a plot that fails loses nothing. ``capacity.run`` is replaced: no server starts here."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from pof_connector.bench import capacity, router
from pof_connector.bench.capacity_fleet import FleetSpec
from pof_connector.bench.capacity_report import report, setup_row
from pof_connector.bench.capacity_search import GoodputSearch
from pof_connector.cli import main

REAL_FIND_SPEC = importlib.util.find_spec


def installed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *, missing: set[str]) -> None:
    """Every package but ``missing`` (module or binary names) installed; this Python in ``tmp_path``."""
    def find_spec(name: str, *args: Any) -> object:
        return None if name in missing else REAL_FIND_SPEC("json")
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr("shutil.which", lambda name, *a, **k: None if name in missing else f"/usr/bin/{name}")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "bin" / "python"))


def never(*_: object, **__: object) -> Any:
    raise AssertionError("started something")


def result() -> dict[str, Any]:
    rows = {}
    for name, goodput in (("static", 3.0), ("pof", float("inf"))):
        s = GoodputSearch().run(lambda f, g=goodput: f <= g, budget_s=None)      # pof: up to the safety cap
        trials = [{"factor": round(f, 4), "passed": ok, "offered_rps": f, "p90_ttft_s": 0.1} for f, ok in s.trials]
        rows[name] = setup_row(s, trials, base_rps=1.0)
    return report(rows, {}, {"requests": 20, "sessions": 4}, 1.0, 0.25, FleetSpec(2, 10, 16, 256, 4), 1, None,
                  Path("m"), search={"time_budget_s_per_setup": 300.0})


@pytest.mark.parametrize(("args", "missing", "named"), [
    (["--plot", "p.png", "--setups", "static,pof"], {"matplotlib"}, "matplotlib (for --plot)"),
    ([], {"vllm-router"}, "vllm-router (for the cache_aware and kv_aware set-ups)"),
    (["--setups", "static"], {"vllm"}, "vllm (for the vLLM servers)"),
])
def test_a_missing_package_stops_the_bench_before_anything_starts(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        args: list[str], missing: set[str], named: str) -> None:
    installed(monkeypatch, tmp_path, missing=missing)
    for name in ("Fleet", "build_model", "model_dir", "fragmenting_trace"):
        monkeypatch.setattr(capacity, name, never)
    assert main(["bench", "capacity", "--json", *args]) == 1
    err = capsys.readouterr().err
    assert "missing package, nothing started" in err and named in err
    assert f"{tmp_path}/venv/bin/python -m pip install" in err           # into the Python that runs the bench


def test_without_cache_aware_setups_vllm_router_is_not_needed(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    installed(monkeypatch, tmp_path, missing={"vllm-router"})
    assert [n.package for n in capacity.needs(["static", "pof"], plot=False)] == ["vllm"]
    assert "vllm-router==0.1.17" in [n.package for n in capacity.needs(["kv_aware"], plot=True)]
    capacity.check(capacity.needs(["static", "pof"], plot=False), "capacity")


def test_the_router_bench_checks_vllm_and_vllm_router_first(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    installed(monkeypatch, tmp_path, missing={"vllm", "vllm-router"})
    monkeypatch.setattr(router, "build_model", never)
    monkeypatch.setattr(router, "VllmServer", never)
    assert main(["bench", "router", "--json"]) == 1
    err = capsys.readouterr().err
    assert "missing packages, nothing started" in err
    assert "vllm (for the vLLM servers)" in err and "vllm-router (for the stock routers)" in err


def test_the_json_leaves_before_a_plot_that_fails(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    installed(monkeypatch, tmp_path, missing=set())
    monkeypatch.setattr(capacity, "run", lambda **kw: result())
    printed: list[str] = []

    def draw(*_: object) -> None:
        printed.append(capsys.readouterr().out)          # what was out when the plot began
        raise OSError("No space left on device")
    monkeypatch.setattr(capacity, "draw", draw)
    out = tmp_path / "runs" / "capacity.json"
    code = main(["bench", "capacity", "--json", "--plot", str(tmp_path / "p.png"), "--out", str(out)])
    assert code == 1
    (line,) = printed[0].splitlines()
    got = json.loads(line)
    assert got == json.loads(out.read_text()) and got["plot"] == str(tmp_path / "p.png")
    assert got["setups"]["pof"]["at_bound"] and got["ratio_bound"] == "lower"
    err = capsys.readouterr().err
    assert re.search(r"pof: --plot .*p\.png: OSError: No space left on device \(the result above is complete\)", err)


def test_the_table_comes_after_the_json_is_saved(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    installed(monkeypatch, tmp_path, missing=set())
    monkeypatch.setattr(capacity, "run", lambda **kw: result())
    assert main(["bench", "capacity", "--setups", "static,pof"]) == 0
    captured = capsys.readouterr()
    saved = Path(re.search(r"result JSON: (\S+)", captured.err).group(1))      # type: ignore[union-attr]
    try:
        assert json.loads(saved.read_text())["ratio_bound"] == "lower"
    finally:
        saved.unlink()
    assert "(at least: a set-up at a bound)" in captured.out and "(>=, safety cap)" in captured.out


def test_the_table_warns_when_the_servers_share_the_hosts_cores_and_shows_the_routers_stages(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    installed(monkeypatch, tmp_path, missing=set())
    shared = result()
    shared["host_samples"] = [[2068, 0.06, 0.19], [2068, 0.05, 0.17]]
    shared["host_sharing_slowdown"] = capacity.sharing_slowdown([(n, a, t) for n, a, t in shared["host_samples"]])
    shared["setups"]["pof"]["at_goodput"] = {"router_decision_mean_s": 0.0031,
                                             "router_stage_mean_s": {"lookup": 0.0011, "choose": 0.0009}}
    monkeypatch.setattr(capacity, "run", lambda **kw: shared)
    assert main(["bench", "capacity", "--setups", "static,pof", "--out", str(tmp_path / "c.json")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert shared["host_sharing_slowdown"] == 3.28          # median of 3.17 and 3.4
    assert "took 3.28x as long as on one alone" in out
    assert "pof: pof router's own time before sending, mean at goodput 0.0031 s (lookup 0.0011, choose 0.0009)" in out
    alone = result()
    alone["host_sharing_slowdown"] = capacity.sharing_slowdown([(2068, 0.06, 0.07)])
    monkeypatch.setattr(capacity, "run", lambda **kw: alone)
    assert main(["bench", "capacity", "--setups", "static,pof", "--out", str(tmp_path / "d.json")]) == 0
    assert "as long as on one alone" not in capsys.readouterr().out


def test_the_report_and_table_say_how_far_saved_work_could_lift_the_best_other(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    installed(monkeypatch, tmp_path, missing=set())
    counted = result()
    static = counted["setups"]["static"]
    for t in static["trials"]:          # a fifth of the work at static's failing load was done again
        t["tokens_computed"], t["tokens_recomputed"] = 5000, (1000 if t["factor"] == static["failed_at_factor"] else 0)
    again = report(counted["setups"], {}, {"requests": 20, "sessions": 4}, 1.0, 0.25, FleetSpec(2, 10, 16, 256, 4), 1,
                   None, Path("m"))
    assert again["headroom"]["static"]["recomputed_share"] == 0.2 and again["ratio_vs_best_ceiling"] == 1.25
    monkeypatch.setattr(capacity, "run", lambda **kw: again)
    assert main(["bench", "capacity", "--setups", "static,pof", "--out", str(tmp_path / "h.json")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "static recomputed 20.0% of its engines' tokens" in out and "about 1.25x at most" in out


def test_pof_cost_variants_reach_the_run_and_the_pof_routers_config(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    from pof_connector.bench.capacity_fleet import pof_router

    installed(monkeypatch, tmp_path, missing=set())
    seen: dict[str, Any] = {}

    def run(**kw: Any) -> dict[str, Any]:
        seen.update(kw)
        return result()
    monkeypatch.setattr(capacity, "run", run)
    assert main(["bench", "capacity", "--setups", "pof", "--out", str(tmp_path / "c.json"),
                 "--pof-cost", "displacement_weight=0", "--pof-cost", "displacement_weight=2,learn_range=10"]) == 0
    assert seen["pof_costs"] == ((("displacement_weight", 0.0),),
                                 (("displacement_weight", 2.0), ("learn_range", 10.0)))
    router = pof_router(tmp_path, "redis://x", Path("m"), [("n0", "http://n0")], seen["pof_costs"][0])
    written = (tmp_path / "pof-router.yaml").read_text()
    assert "cost:\n  displacement_weight: 0.0" in written and router.port > 0
    pof_router(tmp_path, "redis://x", Path("m"), [("n0", "http://n0")])
    assert "cost" not in (tmp_path / "pof-router.yaml").read_text()          # the defaults: no section


def test_side_by_side_reaches_the_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    installed(monkeypatch, tmp_path, missing=set())
    seen: list[bool] = []

    def run(**kw: Any) -> dict[str, Any]:
        seen.append(kw["interleave"])
        return result()
    monkeypatch.setattr(capacity, "run", run)
    for flags, want in (([], False), (["--side-by-side"], True)):
        assert main(["bench", "capacity", "--setups", "pof", "--out", str(tmp_path / "c.json"), *flags]) == 0
        assert seen[-1] is want


def test_fixed_shares_reach_the_run_and_the_table(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    installed(monkeypatch, tmp_path, missing=set())
    seen: list[bool] = []

    def run(**kw: Any) -> dict[str, Any]:
        seen.append(kw["fixed_shares"])
        out = result()
        out["pof_cost_variants"] = {capacity.FIXED_SHARES: {**out["setups"]["pof"], "vs_pof": 0.9,
                                                              "vs_pof_bound": None}}
        return out
    monkeypatch.setattr(capacity, "run", run)
    assert main(["bench", "capacity", "--setups", "pof", "--pof-fixed-shares", "--out", str(tmp_path / "c.json")]) == 0
    assert seen == [True]
    out = " ".join(capsys.readouterr().out.split())
    assert "pof with fixed shares of the region (tiers.cxl.trade: false): goodput" in out and "0.9 of pof" in out


@pytest.mark.parametrize(("value", "says"), [
    ("displacement_weight=-1", "displacement_weight: Input should be greater than or equal to 0"),
    ("tier_gbps=3", "KEY one of prefill_s_per_token, request_overhead_s"),
    ("displacement_weight", "is not KEY=VALUE"),
    ("displacement_weight=x", "'x' is not a number")])
def test_a_bad_pof_cost_stops_at_argument_time_naming_the_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str], value: str,
                                                               says: str) -> None:
    installed(monkeypatch, tmp_path, missing=set())
    monkeypatch.setattr(capacity, "run", lambda **kw: pytest.fail("the run started"))
    assert main(["bench", "capacity", "--pof-cost", value]) == 2
    assert says in capsys.readouterr().err


def test_the_plot_draws_each_pof_cost_variant_beside_the_setups(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    from pof_connector.bench.capacity_cli import plot

    drawn: list[str] = []
    monkeypatch.setattr(capacity, "draw", lambda rows, slo_s, path: drawn.extend(rows))
    out = result()
    out["pof_cost_variants"] = {"displacement_weight=0": {**out["setups"]["pof"], "vs_pof": 0.84}}
    plot(out, tmp_path / "p.png")
    assert drawn == ["static", "pof", "pof (displacement_weight=0)"]
