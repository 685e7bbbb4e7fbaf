from __future__ import annotations

from pathlib import Path

import pytest

from pof_connector.config import ConfigError, PofConfig, parse_size


@pytest.mark.parametrize("text,expected", [
    ("4GiB", 4 << 30), ("512MiB", 512 << 20), ("1.5GiB", 3 << 29), ("64KiB", 64 << 10),
    ("2G", 2 << 30), ("1GB", 10**9), (4096, 4096), ("100", 100),
])
def test_sizes(text: str | int, expected: int) -> None:
    assert parse_size(text, "k") == expected


@pytest.mark.parametrize("bad", ["4 parsecs", "-1GiB", "0", "", "GiB", True, None, 1.5, "1e9"])
def test_bad_sizes_name_the_key(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"tiers\.cpu_dram\.size"):
        PofConfig.from_mapping({"tiers": {"cpu_dram": {"size": bad}}})


def test_defaults() -> None:
    c = PofConfig()
    assert c.index_url == "embedded"
    assert c.page_tokens is None
    assert [t.medium for t in c.tiers] == ["cpu_dram"]


def test_full_config_round_trips() -> None:
    raw = {"node_id": "a", "index_url": "redis://127.0.0.1:6379/0", "page_tokens": 64, "namespace": "tenant-1",
           "tiers": {"cpu_dram": {"size": "1GiB"},
                     "cxl": {"path": "/dev/dax0.0", "size": "64GiB", "partition": 3, "numa_node": 2,
                             "trade": False}}}
    c = PofConfig.from_mapping(raw)
    assert c.tier("cxl") is not None and c.tier("cxl").partition == 3  # type: ignore[union-attr]
    assert c.tier("cxl").trade is False  # type: ignore[union-attr]
    assert c.tier("cxl").size == 64 << 30  # type: ignore[union-attr]
    assert [t.medium for t in c.tiers] == ["cpu_dram", "cxl"]
    assert PofConfig.from_mapping(c.to_mapping()) == c


def test_fabric_section() -> None:
    assert PofConfig().fabric.enabled is False
    c = PofConfig.from_mapping({"fabric": {"enabled": True, "tls": "^cma,tcp", "ucx_devices": "mlx5_0:1,eth0",
                                           "timeout_s": 0.5, "staging_size": "16MiB"}})
    assert (c.fabric.enabled, c.fabric.tls, c.fabric.ucx_devices) == (True, "^cma,tcp", "mlx5_0:1,eth0")
    assert (c.fabric.timeout_s, c.fabric.staging_size) == (0.5, 16 << 20)
    assert PofConfig.from_mapping(c.to_mapping()) == c
    assert PofConfig.from_mapping({"fabric": None}).fabric == PofConfig().fabric
    c = PofConfig.from_mapping({"fabric": {"enabled": True, "spill": True, "spill_lease_s": 10}})
    assert (c.fabric.spill, c.fabric.spill_lease_s) == (True, 10.0)
    assert PofConfig().fabric.progress_wakeup_ms == 1
    assert PofConfig.from_mapping({"fabric": {"progress_wakeup_ms": 0}}).fabric.progress_wakeup_ms == 0
    assert PofConfig.from_mapping(c.to_mapping()) == c
    assert PofConfig().fabric.max_lent_fraction_per_writer == 0.5
    c = PofConfig.from_mapping({"fabric": {"max_lent_fraction_per_writer": 1}})
    assert c.fabric.max_lent_fraction_per_writer == 1.0 and PofConfig.from_mapping(c.to_mapping()) == c


@pytest.mark.parametrize("raw,key,allowed", [
    ({"nodeid": "a"}, "nodeid", "node_id"),
    ({"index_url": "http://x"}, "index_url", "embedded"),
    ({"page_tokens": 0}, "page_tokens", "1.."),
    ({"page_tokens": "64"}, "page_tokens", "integer"),
    ({"tiers": {"gpu": {"size": "1GiB"}}}, "tiers", "cpu_dram, cxl"),
    ({"tiers": {"cpu_dram": {"size": "1GiB", "pinned": True}}}, "tiers.cpu_dram", "size"),
    ({"tiers": {"cxl": {"size": "1GiB"}}}, "tiers.cxl.path", "/dev/dax0.0"),
    ({"tiers": {"cxl": {"size": "1GiB", "path": "/x", "partition": 9}}}, "tiers.cxl.partition", "auto"),
    ({"tiers": {"cxl": {"size": "1GiB", "path": "/x", "trade": "yes"}}}, "tiers.cxl.trade", "true"),
    ({"tiers": {}}, "tiers", "cpu_dram"),
    ({"heartbeat_s": 2, "node_ttl_s": 1}, "node_ttl_s", "heartbeat_s"),
    ({"node_id": "a b"}, "node_id", "A-Za-z0-9"),
    ({"fabric": True}, "fabric", "enabled"),
    ({"fabric": {"enable": True}}, "fabric", "enabled, ucx_devices, tls, timeout_s, staging_size"),
    ({"fabric": {"enabled": "yes"}}, "fabric.enabled", "true or false"),
    ({"fabric": {"tls": "tcp,carrier_pigeon"}}, "fabric.tls", "tcp"),
    ({"fabric": {"tls": ["tcp"]}}, "fabric.tls", "rc"),
    ({"fabric": {"ucx_devices": "eth0; rm -rf"}}, "fabric.ucx_devices", "mlx5_0:1"),
    ({"fabric": {"ucx_devices": 3}}, "fabric.ucx_devices", "eth0"),
    ({"fabric": {"timeout_s": 0}}, "fabric.timeout_s", ">= 0.01"),
    ({"fabric": {"staging_size": "lots"}}, "fabric.staging_size", "MiB"),
    ({"fabric": {"spill": 1}}, "fabric.spill", "true or false"),
    ({"fabric": {"spill": True}}, "fabric.spill", "fabric.enabled: true"),
    ({"fabric": {"enabled": True, "spill": True, "spill_lease_s": 1}}, "fabric.spill_lease_s", "2 * fabric.timeout_s"),
    ({"fabric": {"progress_wakeup_ms": -1}}, "fabric.progress_wakeup_ms", "0..1000"),
    ({"fabric": {"progress_wakeup_ms": 0.5}}, "fabric.progress_wakeup_ms", "0..1000"),
    ({"fabric": {"spill_lease_s": "long"}}, "fabric.spill_lease_s", ">= 0.1"),
    ({"fabric": {"max_lent_fraction_per_writer": 0}}, "fabric.max_lent_fraction_per_writer", "> 0 and <= 1"),
    ({"fabric": {"max_lent_fraction_per_writer": 1.5}}, "fabric.max_lent_fraction_per_writer", "> 0 and <= 1"),
    ({"fabric": {"max_lent_fraction_per_writer": "half"}}, "fabric.max_lent_fraction_per_writer", "> 0 and <= 1"),
    ({"fabric": {"max_lent_fraction_per_writer": True}}, "fabric.max_lent_fraction_per_writer", "> 0 and <= 1"),
])
def test_bad_values_name_key_and_allowed(raw: dict[str, object], key: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as e:
        PofConfig.from_mapping(raw)
    assert key in str(e.value) and allowed in str(e.value)


def test_yaml_file(tmp_path: Path) -> None:
    f = tmp_path / "pof.yaml"
    f.write_text("node_id: mem-1\nindex_url: local\ntiers:\n  cpu_dram: {size: 256MiB}\n")
    c = PofConfig.from_file(f)
    assert c.node_id == "mem-1" and c.tiers[0].size == 256 << 20
    f.write_text("node_id: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        PofConfig.from_file(f)


def test_config_is_frozen() -> None:
    c = PofConfig()
    with pytest.raises(AttributeError):
        c.node_id = "x"  # type: ignore[misc]


def test_example_config_parses() -> None:
    c = PofConfig.from_file(Path(__file__).parent.parent / "examples" / "pof.yaml")
    assert [t.medium for t in c.tiers] == ["cxl", "cpu_dram"]
