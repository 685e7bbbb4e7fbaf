"""This node's side of the fabric: one NIXL agent, its tiers registered, a reader of peers."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence

from pof_connector.config import PofConfig, format_size
from pof_connector.fabric.agent import FabricError, NixlAgent
from pof_connector.fabric.meta import PeerMeta, Region
from pof_connector.fabric.remote_reader import RemoteReader
from pof_connector.fabric.staging import StagingArea
from pof_connector.pages import PageSpec
from pof_connector.tiers import Tier

log = logging.getLogger(__name__)


class FabricNode:
    """Registers ``tiers``' regions with a new NIXL agent and prepares remote reads.

    :attr:`meta` is what the pool publishes in its node info (see :mod:`.meta`). The agent name
    carries a fresh incarnation id, so a restarted node is never confused with its former self:
    readers drop the old connection when the name changes.
    """

    def __init__(self, config: PofConfig, spec: PageSpec, tiers: Sequence[Tier]) -> None:
        name = f"pof/{config.node_id}/{uuid.uuid4().hex[:12]}"
        self.agent = NixlAgent(name, config.fabric)
        try:
            regions: dict[str, Region] = {}
            for tier in tiers:
                if tier.medium == "peer_hbm":
                    continue      # GPU memory shared inside the node only (NIXL VRAM: docs/fabric-transport.md)
                region = tier.region
                self.agent.register(region)
                regions[tier.medium] = Region(tier.medium, region.ctypes.data, region.nbytes, tier.slot_bytes,
                                              tier.num_slots)
            self.staging = StagingArea(self.agent, spec.page_bytes, config.fabric.staging_size)
            self.reader = RemoteReader(self.agent, self.staging, spec, config.fabric.timeout_s)
            self.meta = PeerMeta(name, self.agent.metadata(), regions)
        except FabricError:
            self.agent.close()
            raise
        log.info("pof fabric: agent %s serves %s; staging for %d remote pages (%s)", name,
                 ", ".join(regions) or "no tiers", self.staging.num_slots,
                 format_size(self.staging.num_slots * self.staging.stride))

    def close(self) -> None:
        """Disconnect peers and deregister memory (before the tiers unmap it)."""
        self.reader.close()
        self.agent.close()
