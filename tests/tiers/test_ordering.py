"""Tiers refuse CPUs whose memory model breaks the page seqlock (tiers/ordering.py)."""

from __future__ import annotations

import os
import platform

import pytest

from pof_connector.config import TierConfig
from pof_connector.pages.layout import PageSpec
from pof_connector.tiers import CpuDramTier, make_tier
from pof_connector.tiers.ordering import UnsupportedPlatform


@pytest.mark.parametrize("machine", ["aarch64", "arm64", "ppc64le", "riscv64", ""])
def test_tiers_refuse_cpus_without_total_store_order(machine: str, spec: PageSpec, runtime_dir: str,
                                                     shm_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "machine", lambda: machine)
    with pytest.raises(UnsupportedPlatform, match=r"x86-64 CPU.*total store order.*numpy issues no fences"):
        CpuDramTier(spec, 4 * spec.page_bytes)
    with pytest.raises(UnsupportedPlatform, match="torn page"):
        make_tier(TierConfig("cpu_dram", 4 * spec.page_bytes), spec, runtime_dir)
    with pytest.raises(UnsupportedPlatform):      # refused before the region is created or a partition claimed
        make_tier(TierConfig("cxl", 1 << 20, path=shm_path, partitions=2), spec, runtime_dir)
    assert not os.path.exists(shm_path)


@pytest.mark.parametrize("machine", ["x86_64", "AMD64"])
def test_tiers_start_on_x86(machine: str, spec: PageSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "machine", lambda: machine)
    tier = CpuDramTier(spec, 4 * spec.page_bytes)
    assert tier.capacity_slots == 4
    tier.close()
