"""The fabric's pure parts: published metadata, UCX parameters, start-up without NIXL. No NIXL needed."""

from __future__ import annotations

import base64
import json
import os

import pytest

from pof_connector.config import ConfigError, FabricConfig, PofConfig
from pof_connector.fabric import PeerMeta, Region, nixl_api
from pof_connector.fabric.agent import ucx_init_params
from pof_connector.fabric.meta import AGENT_KEY, MD_KEY, REGIONS_KEY
from pof_connector.pool import Pool
from tests.fabric.node_proc import NAMESPACE, SPEC

META = PeerMeta("pof/a/0123456789ab", bytes(range(256)) * 2,
                {"cpu_dram": Region("cpu_dram", 0x7F00_0000_0000, 1 << 20, 6272, 167),
                 "cxl": Region("cxl", 0x7E00_0000_1000, 4 << 20, 6272, 600)})


def test_meta_round_trips_as_strings() -> None:
    encoded = META.to_meta()
    assert all(isinstance(v, str) for v in encoded.values())
    assert set(encoded) == {AGENT_KEY, MD_KEY, REGIONS_KEY}
    assert PeerMeta.from_meta({"namespace": "x", **encoded}) == META
    assert META.regions["cxl"].slot_address(2) == 0x7E00_0000_1000 + 2 * 6272


@pytest.mark.parametrize("change", [
    {AGENT_KEY: ""},
    {MD_KEY: "not base64!"},
    {REGIONS_KEY: "{"},
    {REGIONS_KEY: "[1, 2]"},
    {REGIONS_KEY: json.dumps({"cpu_dram": [1, 2, 3]})},
    {REGIONS_KEY: json.dumps({"cpu_dram": [1, 100, 0, 0]})},          # zero-byte slots
    {REGIONS_KEY: json.dumps({"cpu_dram": [1, 100, 64, 2]})},         # slots beyond the region
    {REGIONS_KEY: json.dumps({"cpu_dram": [-1, 100, 10, 2]})},
    {REGIONS_KEY: json.dumps({"cpu_dram": [1, 100, True, 2]})},
    # Hostile numbers: each would have a reader build a descriptor outside any real address
    # space, or allocate descriptor lists for billions of slots.
    {REGIONS_KEY: json.dumps({"cpu_dram": [2**64 - 4096, 1 << 20, 4096, 256]})},   # region past 2**64
    {REGIONS_KEY: json.dumps({"cpu_dram": [2**70, 1 << 20, 4096, 256]})},
    {REGIONS_KEY: json.dumps({"cpu_dram": [4096, 2**62, 4096, 2**50]})},        # 2**50 slots
    {REGIONS_KEY: json.dumps({"cpu_dram": [4096, 2**40, 1, 2**40]})},           # 1-byte slots
    {REGIONS_KEY: json.dumps({"cpu_dram": [4096, 1 << 20, 4096.0, 256]})},       # a float
    {REGIONS_KEY: json.dumps({"cpu_dram": ["4096", 1 << 20, 4096, 256]})},       # a string
    {REGIONS_KEY: json.dumps({"no_such_medium": [4096, 1 << 20, 4096, 256]})},
    {REGIONS_KEY: json.dumps({"engine": [4096, 1 << 20, 4096, 256]})},          # no pool reads it
    {REGIONS_KEY: "[" * 100_000},                                                # nested too deep
    {MD_KEY: base64.b64encode(bytes(2 << 20)).decode()},                          # 2 MiB of metadata
    {AGENT_KEY: "x" * 10_000},
])
def test_malformed_meta_means_not_readable(change: dict[str, str]) -> None:
    assert PeerMeta.from_meta({**META.to_meta(), **change}) is None


def test_no_fabric_meta_means_not_readable() -> None:
    assert PeerMeta.from_meta({"namespace": "x"}) is None
    assert base64.b64decode(META.to_meta()[MD_KEY]) == META.metadata


def test_ucx_params_come_from_config_only() -> None:
    assert ucx_init_params(FabricConfig(enabled=True, tls="tcp", ucx_devices="vA")) == {
        "ucx_devices": "vA",
        "engine_config": "TLS=tcp,TCP_USER_TIMEOUT=5s,TCP_KEEPIDLE=1s,TCP_KEEPINTVL=1s,KEEPALIVE_INTERVAL=1s"}
    params = ucx_init_params(FabricConfig(enabled=True))
    assert "ucx_devices" not in params and "TLS=" not in params["engine_config"]


def test_fabric_without_nixl_fails_at_start_up(monkeypatch: pytest.MonkeyPatch, runtime_dir: str) -> None:
    monkeypatch.setattr(nixl_api, "NIXL_MODULES", ("pof_no_such_nixl._api",))
    config = PofConfig.from_mapping({"node_id": "a", "index_url": "local", "runtime_dir": runtime_dir,
                                     "tiers": {"cpu_dram": {"size": "1MiB"}}, "fabric": {"enabled": True}})
    for role in ("worker", "client"):
        with pytest.raises(ConfigError, match=r"fabric\.enabled.*nixl-cu13==1\.5\.1"):
            Pool(config, SPEC, NAMESPACE, role=role)  # type: ignore[arg-type]
    # Disabled, nothing of NIXL is needed.
    Pool(PofConfig.from_mapping({**config.to_mapping(), "fabric": {"enabled": False}}), SPEC, NAMESPACE).close()


@pytest.mark.skipif(os.environ.get("POF_REQUIRE_NIXL") != "1", reason="only where CI installs NIXL (ci/test.sh)")
def test_nixl_is_installed_where_ci_requires_it() -> None:
    """ci/test.sh sets POF_REQUIRE_NIXL=1: the NIXL tests must run there, not skip silently."""
    assert nixl_api.nixl_installed(), "ci/core_venv.sh should have installed nixl-cu13"
