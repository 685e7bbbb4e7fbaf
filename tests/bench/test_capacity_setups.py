"""What each ``pof bench capacity`` set-up would start, read from its plan without starting anything:
the same total of tier memory for every set-up, private tiers for the baselines and one shared
region for pof, the routers' flags, the relays, static's namings."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from pathlib import Path

import pytest

from pof_connector.bench.capacity_fleet import FleetSpec
from pof_connector.bench.capacity_report import merge_namings, report
from pof_connector.bench.capacity_setups import (
    SETUPS,
    TIER_ALIGN,
    balance_args,
    kv_bytes_per_token,
    plan,
    static_server,
    tier_share,
)
from pof_connector.config import PofConfig


def planned(setup: str, servers: int = 2, tier_bytes: int = 1 << 30, audit_rate: float = 0.0):  # type: ignore[no-untyped-def]
    ports = itertools.count(6000)
    return plan(setup, servers=servers, tier_bytes=tier_bytes, block=128, max_num_seqs=8,
                runtime_dir=lambda name: f"/rt/{name}", index_url="redis://127.0.0.1:7/0", region="/dev/shm/r",
                port=lambda: next(ports), audit_rate=audit_rate)


@pytest.mark.parametrize("servers", [2, 3])
@pytest.mark.parametrize("tier_bytes", [1 << 30, 300 << 20, 7 * TIER_ALIGN])
def test_every_setup_reads_back_the_same_tier_memory(servers: int, tier_bytes: int) -> None:
    share = tier_share(tier_bytes, servers)
    assert share % TIER_ALIGN == 0 and 0 < share * servers <= tier_bytes
    totals = {s: planned(s, servers, tier_bytes).tier_bytes() for s in SETUPS}
    assert set(totals.values()) == {share * servers}, totals


def test_a_tier_budget_that_leaves_a_server_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="--tier-bytes"):
        tier_share(TIER_ALIGN, 2)


@pytest.mark.parametrize("setup", ["static", "round_robin", "cache_aware"])
def test_the_plain_baselines_have_a_private_tier_and_index_each(setup: str) -> None:
    p = planned(setup)
    assert p.relays == [] and all(s.events is None for s in p.servers)
    assert [s.pool["tiers"] for s in p.servers] == [{"cpu_dram": {"size": 512 << 20}}] * 2
    assert {s.pool["index_url"] for s in p.servers} == {"embedded"}
    assert [s.pool["runtime_dir"] for s in p.servers] == ["/rt/n0", "/rt/n1"]        # embedded: one index each
    assert all("audit" not in s.pool for s in p.servers)                                # off (connector_config)
    assert p.router == ("vllm-router" if setup == "cache_aware" else None)


def test_cache_aware_balances_at_half_a_batch() -> None:
    p = planned("cache_aware")
    assert p.policy == "cache_aware" and p.router_args is not None
    assert p.router_args(["http://a", "http://b"]) == balance_args(8) == [
        "--balance-abs-threshold", "4", "--balance-rel-threshold", "1.5"]


def test_kv_aware_hears_each_engine_and_its_private_tier_through_a_relay() -> None:
    p = planned("kv_aware")
    assert p.router == "vllm-router" and p.policy == "kv_aware" and p.router_args is not None
    assert [s.pool["tiers"] for s in p.servers] == [{"cpu_dram": {"size": 512 << 20}}] * 2   # still private
    assert {s.pool["index_url"] for s in p.servers} == {"redis://127.0.0.1:7/0"}
    assert all(r.pool_residency for r in p.relays)                    # host credit for what the tier loads
    assert [r.events for r in p.relays] == [s.events for s in p.servers] and all(r.events for r in p.relays)
    args = p.router_args(["http://a", "http://b"])
    assert args[:4] == ["--kv-event-block-size", "128", "--kv-event-model", "m"]
    assert args[4:] == ["--kv-event-source", f"http://a={p.relays[0].bind}",
                        "--kv-event-source", f"http://b={p.relays[1].bind}"]
    assert len({r.bind for r in p.relays} | {r.events for r in p.relays}) == 4          # no port twice


def test_pof_private_differs_from_kv_aware_in_its_router_only() -> None:
    private, kv = planned("pof_private"), planned("kv_aware")
    assert private.router == "pof" and private.router_args is None
    assert [s.pool for s in private.servers] == [s.pool for s in kv.servers]
    assert not any(r.pool_residency for r in private.relays)      # pof router reads the index itself


def test_pof_shares_one_region_with_a_writer_partition_each() -> None:
    p = planned("pof", servers=3, audit_rate=0.1)
    tiers = [s.pool["tiers"]["cxl"] for s in p.servers]
    assert {(t["path"], t["size"], t["partitions"]) for t in tiers} == {("/dev/shm/r", 3 * tier_share(1 << 30, 3), 3)}
    assert [t["partition"] for t in tiers] == [0, 1, 2] and all(t["trade"] for t in tiers)
    assert all("partition" not in r.pool["tiers"]["cxl"] and "node_id" not in r.pool for r in p.relays)
    assert all(s.pool["audit"] == {"sample_rate": 0.1, "seed": 7} for s in p.servers)
    assert p.router == "pof" and not any(r.pool_residency for r in p.relays)


def test_pof_with_fixed_shares_differs_in_trade_only(tmp_path: Path) -> None:
    spec = FleetSpec(servers=2, kv_blocks=40, block=128, max_model_len=4096, max_num_seqs=8, tier_bytes=1 << 30)
    traded = spec.plan("pof", tmp_path, "redis://x", "/dev/shm/r", port=lambda: 1)
    fixed = dataclasses.replace(spec, region_trade=False).plan("pof", tmp_path, "redis://x", "/dev/shm/r",
                                                               port=lambda: 1)
    assert [s.pool["tiers"]["cxl"]["trade"] for s in fixed.servers] == [False, False]
    for a, b in zip(traded.servers, fixed.servers, strict=True):
        assert {**a.pool["tiers"]["cxl"], "trade": False} == b.pool["tiers"]["cxl"]
    assert PofConfig.from_mapping(fixed.servers[0].pool).tier("cxl").trade is False  # type: ignore[union-attr]


def test_a_plan_needs_what_it_shares() -> None:
    with pytest.raises(ValueError, match="index"):
        plan("kv_aware", servers=2, tier_bytes=1 << 30, block=128, max_num_seqs=8, runtime_dir=str,
             index_url=None, region=None, port=lambda: 1)
    with pytest.raises(ValueError, match="unknown set-up"):
        planned("cache_aware_offload")


def test_the_fleet_spec_plans_in_its_work_directory_and_flags_kv_events(tmp_path: Path) -> None:
    spec = FleetSpec(servers=2, kv_blocks=40, block=128, max_model_len=4096, max_num_seqs=8, tier_bytes=1 << 30)
    p = spec.plan("static", tmp_path, port=lambda: 1)
    assert [s.pool["runtime_dir"] for s in p.servers] == [str(tmp_path / "rt-n0"), str(tmp_path / "rt-n1")]
    args = spec.server_args(None)
    assert args[args.index("--num-gpu-blocks-override") + 1] == "40" and "--kv-events-config" not in args
    assert "--kv-events-config" in spec.server_args("tcp://127.0.0.1:5557")


def test_static_namings_draw_different_placements() -> None:
    keys = [f"session-{i}" for i in range(200)]
    import hashlib
    bare = [int.from_bytes(hashlib.sha256(k.encode()).digest()[:4], "little") % 2 for k in keys]
    assert [static_server(k, 0, 2) for k in keys] == bare            # naming 0: earlier runs' placement
    placements = {n: tuple(static_server(k, n, 2) for k in keys) for n in range(3)}
    assert len(set(placements.values())) == 3
    for p in placements.values():                                    # each a fair split, not the same one
        assert 70 < Counter(p)[0] < 130


def test_kv_bytes_per_token_from_the_model_config() -> None:
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128}
    assert kv_bytes_per_token(config, "float32") == 2 * 2 * 2 * 32 * 4
    assert kv_bytes_per_token({**config, "head_dim": 64}, "bfloat16") == 2 * 2 * 2 * 64 * 2


def test_static_namings_fold_into_the_median_and_ratios_come_as_intervals() -> None:
    def row(goodput: float, failed: float | None) -> dict[str, object]:
        return {"goodput_rps": goodput, "failed_at_rps": failed, "at_bound": failed is None, "trials": [],
                "at_reference_load": None}
    results = {"static": row(1.0, 1.2), "static@1": row(0.5, 0.6), "static@2": row(2.0, 2.4),
               "kv_aware": row(2.0, 2.5), "pof_private": row(2.5, 3.0), "pof": row(4.0, None)}
    merged, spread = merge_namings(results, ["static", "static@1", "static@2"])
    assert list(merged) == ["static", "kv_aware", "pof_private", "pof"]
    assert merged["static"]["naming_key"] == "static" and merged["static"]["goodput_rps"] == 1.0
    assert spread is not None and spread["goodput_rps"] == {"min": 0.5, "median": 1.0, "max": 2.0}
    assert set(spread["rows"]) == {"static@1", "static@2"}
    out = report(merged, {}, {"requests": 20}, 1.0, 0.25, FleetSpec(2, 10, 16, 256, 4), 1, None, Path("m"))
    assert out["intervals"]["pof/static"] == {"low": round(4.0 / 1.2, 4), "high": None, "text": ">= 3.3333"}
    assert out["intervals"]["pof/pof_private"]["text"] == ">= 1.3333"       # pof never failed
    assert out["intervals"]["pof_private/kv_aware"]["text"] == "[1, 1.5]"
    assert "kv_aware/cache_aware" not in out["intervals"]                   # cache_aware did not run
    assert merge_namings({"pof": row(1.0, 2.0)}, ["static"]) == ({"pof": row(1.0, 2.0)}, None)
