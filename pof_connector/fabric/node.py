"""This node's side of the fabric: one NIXL agent, its tiers registered, its connections to remote
nodes, a reader of their pages."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Sequence

from pof_connector.config import PofConfig, format_size
from pof_connector.fabric.agent import FabricError, NixlAgent
from pof_connector.fabric.meta import PeerMeta, Region
from pof_connector.fabric.notifier import Notifier
from pof_connector.fabric.peers import Peers
from pof_connector.fabric.registered_staging import StagingArea
from pof_connector.fabric.remote_reader import RemoteReader
from pof_connector.fabric.slot_lender import SlotLender
from pof_connector.fabric.spans import layer_parts, part_spans
from pof_connector.fabric.spill_writer import LEND_KEY, SpillWriter
from pof_connector.pages.layout import PageSpec
from pof_connector.tiers import Tier

log = logging.getLogger(__name__)


class FabricNode:
    """Registers ``tiers``' regions with a new NIXL agent and prepares remote reads.

    :attr:`meta` is what the pool publishes in its node info (see :mod:`.meta`). The agent name
    carries a fresh incarnation id, so a restarted node is never confused with its former self:
    readers drop the old connection when the name changes.

    With ``fabric.spill``, :attr:`lender` grants this node's free slots to other nodes and
    :attr:`writer` spills this node's evicted pages into theirs (both ``None`` otherwise); they
    start exchanging control messages at :meth:`start`.
    """

    def __init__(self, config: PofConfig, spec: PageSpec, tiers: Sequence[Tier]) -> None:
        self.config = config
        self.spec = spec
        self.tiers = list(tiers)
        self.lender: SlotLender | None = None
        self.writer: SpillWriter | None = None
        self.notifier: Notifier | None = None
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
            spans = part_spans(spec, layer_parts(spec.num_layers))
            self.staging = StagingArea(self.agent, spec.page_bytes, config.fabric.staging_size, spans)
            self.peers = Peers(self.agent, spec.page_bytes, spans, config.fabric.timeout_s)
            self.reader = RemoteReader(self.agent, self.peers, self.staging, spec, config.fabric.timeout_s)
            self.meta = PeerMeta(name, self.agent.metadata(), regions)
            self.meta_strings = self.meta.to_meta()
            if config.fabric.spill:
                self.meta_strings[LEND_KEY] = "1"
        except FabricError:
            self.agent.close()
            raise
        log.info("pof fabric: agent %s serves %s; staging for %d remote pages (%s)", name,
                 ", ".join(regions) or "no tiers", self.staging.num_slots,
                 format_size(self.staging.num_slots * self.staging.stride))

    def start(self, peer_meta: Callable[[str], PeerMeta | None]) -> None:
        """Serve and request spill grants (``fabric.spill``): ``peer_meta(node)`` is what ``node``
        publishes now (``None`` when it is not alive), so a grant goes only to a node's current agent."""
        if not self.config.fabric.spill:
            return

        def authorize(node: str, agent: str) -> bool:
            meta = peer_meta(node)
            if meta is None or meta.agent != agent:
                return False
            try:
                self.peers.release(self.peers.acquire(node, meta))   # we answer to its agent
            except FabricError:
                return False
            return True

        fabric = self.config.fabric
        self.lender = SlotLender(self.config.node_id, self.tiers, fabric.spill_lease_s, fabric.timeout_s, authorize,
                                 fabric.max_lent_fraction_per_writer)
        self.notifier = Notifier(self.agent, self.lender.handle)
        self.writer = SpillWriter(self.config.node_id, self.agent, self.peers, self.staging, self.notifier,
                                  self.spec, fabric)

    def lend_meta(self) -> dict[str, str]:
        """Node meta for ``pof stats``: per medium, slots lent and writers holding leases now; the
        spill messages refused so far, by reason."""
        if self.lender is None:
            return {}
        usage = self.lender.usage()
        refused = {k: v for k, v in {**self.lender.refused, **(self.notifier.refused if self.notifier else {})}.items()
                   if v}
        return {"fabric.lent": json.dumps({m: list(u) for m, u in usage.items()}, separators=(",", ":")),
                "fabric.refused": json.dumps(refused, separators=(",", ":"), sort_keys=True)}

    def close(self) -> None:
        """Disconnect peers and deregister memory (before the tiers unmap it)."""
        if self.notifier is not None:
            self.notifier.close()
        if self.lender is not None:
            self.lender.reclaim_all()
        self.peers.close()
        self.agent.close()
