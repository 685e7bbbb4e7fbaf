"""``pof bench capacity --quick --json`` on real vLLM CPU servers (what CI runs): its JSON has every
field the issue asks for, filled for each set-up it ran. Figures are not checked: they are the
bench's to report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pof_connector.bench.front_door import can_use_rr

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TRIAL_FIELDS = {"factor", "offered_rps", "passed", "gave_up", "requests", "failed", "late", "mean_ttft_s",
                "p90_ttft_s", "preemptions", "tokens_computed", "tokens_recomputed", "spread_mean", "spread_p90",
                "spread_floor_mean", "spread_floor_p90",
                "pool_hit_tokens", "engine_hit_tokens", "backends", "errors", "sessions", "one_off", "ttft_parts_s",
                "router_decision_mean_s", "engine_first_tokens"}


def test_quick_capacity_json_has_its_fields(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    plot = tmp_path / "capacity.png"
    args = [sys.executable, "-m", "pof_connector.cli", "bench", "capacity", "--quick", "--json"]
    try:
        import matplotlib  # noqa: F401
        args += ["--plot", str(plot)]
    except ImportError:
        plot = None  # type: ignore[assignment]
    done = subprocess.run(args, capture_output=True, text=True, timeout=1500, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-12000:]
    check_quick_json(json.loads(done.stdout), done.stderr)
    if plot is not None:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def check_quick_json(out: dict[str, Any], stderr: str) -> None:
    """What ``--quick --json`` must hold (also run on a saved run's output by hand)."""
    assert out["bench"] == "capacity"
    for key in ("ratio", "ratio_vs_best", "ratio_range", "best_other", "slo_s", "slo_multiple",
                "unloaded_p90_ttft_s", "fragmentation", "trace", "cluster", "setups", "goals"):
        assert key in out, key
    assert set(out["setups"]) == {"static", "pof"}
    assert out["slo_s"] == pytest.approx(out["slo_multiple"] * out["unloaded_p90_ttft_s"], rel=1e-2)
    # the cold samples the SLO came from, for `pof sim calibrate`: its p90 is theirs
    samples = out["unloaded_samples"]
    assert len(samples) == 6 and all(n > 0 and t > 0 for n, t in samples), samples
    assert sorted(n for n, _ in samples) == [n for n, _ in samples]                 # quantiles, in order
    assert out["unloaded_p90_ttft_s"] in [t for _, t in samples]
    # the step times `pof sim calibrate` takes the decode cost from: each cold sample's pace alone
    # (batch 1 at its prompt size), then short requests decoding 4 and 8 at once
    steps = out["decode_samples"]
    assert [(b, n) for b, n, _ in steps] == [(1, n) for n, _ in samples] + [(4, 32), (8, 32)], steps
    assert all(t > 0 for _, _, t in steps), steps
    # the servers share this host's cores: a p90-size cold prompt alone, then on both at once
    (host,) = out["host_samples"]
    assert host[0] in [n for n, _ in samples] and host[1] > 0 and host[2] > 0, host
    for name, row in out["setups"].items():
        assert {"goodput_rps", "goodput_factor", "at_goodput", "at_reference_load", "trials"} <= set(row), name
        assert row["trials"] and row["at_reference_load"] is not None, name
        for trial in row["trials"]:
            assert set(trial) >= TRIAL_FIELDS, (name, TRIAL_FIELDS - set(trial))
        parts = row["at_reference_load"]["ttft_parts_s"]     # vLLM exports the histograms they come from
        assert parts["engine"] is not None and parts["queue"] is not None and parts["prefill"] is not None, name
        assert parts["queue"] + parts["prefill"] <= parts["engine"] * 1.05 + 0.01, (name, parts)
    assert out["setups"]["static"]["at_reference_load"]["pool_hit_tokens"] == 0      # no pool: never loads
    # the router runs ahead of the engines (root may lower a niceness; others keep their own)
    assert out["cluster"]["router_nice"] == -10 and out["setups"]["static"]["router_nice"] is None
    ahead = -10 if os.geteuid() == 0 else os.getpriority(os.PRIO_PROCESS, 0)
    assert out["setups"]["pof"]["router_nice"] == ahead and out["setups"]["pof"]["index_nice"] == ahead
    assert out["setups"]["static"]["index_nice"] is None
    # the front door in SCHED_RR where this user may (--router-sched auto), every set-up with one alike
    rr = "rr" if can_use_rr() else "nice"
    assert out["cluster"]["router_sched"] == rr and out["setups"]["pof"]["front_door_sched"] == rr
    assert out["setups"]["static"]["front_door_sched"] is None
    pof_ref, static_ref = out["setups"]["pof"]["at_reference_load"], out["setups"]["static"]["at_reference_load"]
    for ref in (pof_ref, static_ref):    # the engines' own count of who served what, one entry per server
        assert set(ref["engine_first_tokens"]) == {"n0", "n1"}, ref
        assert sum(ref["engine_first_tokens"].values()) >= ref["requests"] - ref["failed"], ref
    # the pof router's own time before sending on comes back in a header; static has no router
    assert static_ref["router_decision_mean_s"] is None
    assert pof_ref["router_decision_mean_s"] is not None and pof_ref["router_decision_mean_s"] >= 0
    assert pof_ref["router_decision_mean_s"] <= (pof_ref["mean_ttft_s"] or float("inf")), pof_ref
    assert {"requests", "sessions", "tenants", "span_s", "max_context_tokens", "mix", "seed"} <= set(out["trace"])
    assert out["trace"]["mix"]["long_sessions"] >= 2          # enough for `pof sim validate` to rebuild the trace
    assert "pof_spread_mean" in out["fragmentation"] and "static_spread_mean" in out["fragmentation"]
    assert "pof_floor_vs_static" in out["fragmentation"]
    for ref in (pof_ref, static_ref):    # the floor is the least spread a placement could have: never above it
        if ref["spread_mean"] is not None:
            assert ref["spread_floor_mean"] <= ref["spread_mean"], ref
    assert "unloaded p90 TTFT" in stderr and "pof: goodput" in stderr        # progress lines
