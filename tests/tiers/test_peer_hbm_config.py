"""peer_hbm configuration, and start-up without torch (core: needs no torch)."""

from __future__ import annotations

import sys

import pytest

from pof_connector.config import ConfigError, PofConfig
from pof_connector.pages.layout import PageSpec
from pof_connector.tiers import make_tier


def test_peer_hbm_keys_round_trip() -> None:
    c = PofConfig.from_mapping({"tiers": {"peer_hbm": {"device": "cuda:1", "size": "8GiB", "partitions": 4},
                                          "cpu_dram": {"size": "1GiB"}}})
    hbm = c.tier("peer_hbm")
    assert hbm is not None and (hbm.device, hbm.size, hbm.partitions, hbm.partition) == ("cuda:1", 8 << 30, 4, None)
    assert PofConfig.from_mapping(c.to_mapping()) == c


@pytest.mark.parametrize(("options", "where"), [
    ({"size": "1GiB"}, r"tiers\.peer_hbm\.device"),
    ({"size": "1GiB", "device": "gpu1"}, r"tiers\.peer_hbm\.device"),
    ({"size": "1GiB", "device": "cuda:1", "path": "/x"}, r"tiers\.peer_hbm: unknown option 'path'"),
    ({"size": "1GiB", "device": "cpu", "partition": 9, "partitions": 4}, r"tiers\.peer_hbm\.partition"),
])
def test_bad_peer_hbm_options_name_the_key(options: dict[str, object], where: str) -> None:
    with pytest.raises(ConfigError, match=where):
        PofConfig.from_mapping({"tiers": {"peer_hbm": options}})


def test_peer_hbm_without_torch_fails_at_start_up_naming_the_key(monkeypatch: pytest.MonkeyPatch,
                                                                  runtime_dir: str) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)       # what a torch-less environment sees
    c = PofConfig.from_mapping({"tiers": {"peer_hbm": {"device": "cpu", "size": "1MiB"}}})
    with pytest.raises(ConfigError, match=r"tiers\.peer_hbm: needs PyTorch"):
        make_tier(c.tiers[0], PageSpec(2, 1024, 16), runtime_dir)
    assert "pof_connector.tiers.peer_hbm" in sys.modules     # the module itself imports without torch
