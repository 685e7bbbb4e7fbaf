"""Issue 47's equal memory in the simulator: every baseline of ``pof bench capacity`` has a private
tier per server, pof one shared region of the same total. ``pof sim validate`` replays each set-up
with the tiers it had, and the set-ups the simulator has no policy of its own for (``kv_aware``,
``pof_private``) with the nearest one it has."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pof_connector.cli import main
from pof_connector.config import ConfigError
from pof_connector.sim.bench_run import load_bench, setup_tiers
from pof_connector.sim.calibrate import fit
from pof_connector.sim.kv_pool import KvPool
from pof_connector.sim.profile import load_profile
from pof_connector.sim.round_robin import RoundRobin
from pof_connector.sim.sim_config import SimConfig
from pof_connector.sim.simulator import Simulator

BENCH = Path(__file__).parent / "data" / "capbench-quick.json"
TIER_BYTES = 12 * 2**20


def test_a_private_pool_loads_only_what_its_node_stored() -> None:
    p = load_profile("cpu-bench")
    for shared in (True, False):
        pool = KvPool(p, 2, shared=shared)
        pool.store(0, "s", 4 * p.block_tokens)
        assert pool.best(0, "s") == (4 * p.block_tokens, p.local_tier)
        assert pool.best(1, "s") == ((4 * p.block_tokens, p.remote_tier) if shared else (0, None))
        assert pool.holders("s") == {0: 4 * p.block_tokens}     # the index still knows who holds it


def test_round_robin_over_private_tiers_never_loads_from_the_other_node() -> None:
    run = load_bench(BENCH)
    p = load_profile("cpu-bench")
    loaded, computed = {}, {}
    for tiers in ("shared", "private"):
        sim = Simulator(p, RoundRobin(), SimConfig(nodes=2, tiers=tiers, give_up=False))
        sim.run(run.trace)
        assert sim.pool is not None and sim.pool.shared == (tiers == "shared")
        loaded[tiers], computed[tiers] = dict(sim.pool.loaded_bytes), sim.counters.computed_tokens
    assert loaded["shared"][p.remote_tier.name] > 0            # a session's next turn on the other node
    assert loaded["private"][p.remote_tier.name] == 0
    assert computed["private"] > computed["shared"]            # ... there recomputed instead
    assert Simulator(p, RoundRobin(), SimConfig(nodes=2)).pool is None      # the policy's own: none
    with pytest.raises(ValueError, match="tiers: 'pooled'; allowed: none, private, shared"):
        SimConfig(nodes=2, tiers="pooled")


def _equal_memory_run(tmp_path: Path, **memory: Any) -> Path:
    """The recorded quick run as an issue-47 run: its static and pof rows also as kv_aware and
    pof_private (the set-ups the simulator replays with another policy), and the memory section."""
    raw = json.loads(BENCH.read_text())
    raw["setups"]["kv_aware"] = raw["setups"]["static"]
    raw["setups"]["pof_private"] = raw["setups"]["pof"]
    raw["memory"] = memory
    path = tmp_path / "equal.json"
    path.write_text(json.dumps(raw))
    return path


def test_validate_replays_every_equal_memory_setup_with_its_tiers(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = _equal_memory_run(tmp_path, tier_bytes_per_server=TIER_BYTES)
    run = load_bench(path)
    assert run.tier_bytes_per_server == TIER_BYTES
    assert {s: setup_tiers(run, s) for s in run.setups} == {
        "static": "private", "pof": "shared", "kv_aware": "private", "pof_private": "private"}
    assert setup_tiers(load_bench(BENCH), "static") is None            # an older run: the policy's own
    profile = fit(run).profile
    assert profile.pool_tokens == int(TIER_BYTES // profile.kv_bytes_per_token)
    assert main(["sim", "validate", "--bench", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["setups"]) == {"static", "pof", "kv_aware", "pof_private"} and out["skipped"] == []
    assert main(["sim", "validate", "--bench", str(path), "--fit-setups", "kv_aware", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["calibration"]["fitted_on"] == ["kv_aware"]
    assert main(["sim", "validate", "--bench", str(path), "--fit-setups", "vllm"]) == 1
    assert "--fit-setups: some of static, round_robin, cache_aware, kv_aware, pof_private, pof" in \
        capsys.readouterr().err


def test_a_bad_memory_section_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"memory\.tier_bytes_per_server: a positive number of bytes"):
        load_bench(_equal_memory_run(tmp_path, tier_bytes_per_server=-1))


def test_a_profile_with_a_zero_step_cost_still_makes_a_pof_router() -> None:
    """A calibration on noisy decode samples fitted decode_step_s = 0 (issue 47's second mix run):
    the simulated router's fixed cost is its prior, which its config requires to be positive."""
    from dataclasses import replace

    from pof_connector.sim.pof_policy import PofPolicy, router_config

    p = replace(load_profile("cpu-bench"), decode_step_s=0.0)
    assert router_config(p, 2).cost.request_overhead_s > 0
    PofPolicy(p)


def test_the_bracket_of_a_run_of_several_trials_a_factor_is_its_verdicts(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """x16 passed one trial of three (a fail by majority): the measured goodput lies in [14.7, 16),
    not at 16 or above."""
    raw = json.loads(BENCH.read_text())
    trials = [{"factor": 1.0, "passed": True}, {"factor": 16.0, "passed": False}, {"factor": 16.0, "passed": True},
              {"factor": 16.0, "passed": False}, {"factor": 14.6721, "passed": True}]
    factors = [{"factor": 1.0, "trials": [True], "passed": True},
               {"factor": 16.0, "trials": [False, True, False], "passed": False},
               {"factor": 14.6721, "trials": [True], "passed": True}]
    raw["setups"]["pof"] = {**raw["setups"]["pof"], "trials": [{**raw["setups"]["pof"]["trials"][0], **t}
                                                               for t in trials], "factors": factors}
    path = tmp_path / "several.json"
    path.write_text(json.dumps(raw))
    assert main(["sim", "validate", "--bench", str(path), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["setups"]["pof"]
    assert row["measured_bracket"] == [14.6721, 16.0]
