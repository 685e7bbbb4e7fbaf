"""Tiers: the media a pool node stores pages in (import path ``pof_connector.tiers``).

* :mod:`.base` — :class:`~.base.Tier`: fixed slots, LRU, pins, per-slot generations (the seqlock);
* :mod:`.slot_table` — the books of which key sits in which slot;
* :mod:`.cpu_dram` — process-private DRAM; :mod:`.cxl` — one shared region, a partition per writer;
* :mod:`.peer_hbm` and :mod:`.peer_region` — a GPU of this host mapped by CUDA IPC;
* :mod:`.ordering` — the store-order guarantee the seqlock needs (x86 TSO);
* :mod:`.tenant_books` — which tenant each page belongs to, and quotas in slots;
  :mod:`.tenant_usage` — what each tenant holds of this node's tiers (gauges, heartbeat meta).

May import: ``config``, ``pages``, ``metrics`` and ``runtime_dir``. Never the pool, the index or the
fabric: they are built on the tiers.
"""

from __future__ import annotations

from pof_connector.config import TierConfig
from pof_connector.pages.layout import PageSpec
from pof_connector.tiers.base import SlotRef, Tier
from pof_connector.tiers.cpu_dram import CpuDramTier
from pof_connector.tiers.cxl import CxlTier
from pof_connector.tiers.ordering import require_store_order

__all__ = ["CpuDramTier", "CxlTier", "SlotRef", "Tier", "make_tier"]


def make_tier(config: TierConfig, spec: PageSpec, runtime_dir: str) -> Tier:
    """Build the tier ``config`` describes for pages of ``spec``; raises
    :class:`~pof_connector.tiers.ordering.UnsupportedPlatform` on a CPU without total store order."""
    require_store_order()      # before a region is mapped or a CXL partition claimed
    if config.medium == "cpu_dram":
        return CpuDramTier(spec, config.size)
    if config.medium == "cxl":
        return CxlTier(spec, config, runtime_dir)
    if config.medium == "peer_hbm":
        # Imported here: it is the one tier that needs torch, and the core imports no torch.
        from pof_connector.tiers.peer_hbm import PeerHbmTier

        return PeerHbmTier(spec, config, runtime_dir)
    raise ValueError(f"no tier implementation for medium {config.medium!r}")
