"""This node's membership of the cluster: its heartbeat keeps it alive in the index, reports its
tiers, notices a tier lost while running, publishes everything again on a new incarnation (or
after a publish was lost), sends again the withdrawals the index did not take, and restarts the
embedded index server when its process died."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from pof_connector.audit.revocations import revoked_for
from pof_connector.config import ConfigError
from pof_connector.cpu_affinity import unpin
from pof_connector.index import NodeIdTaken, NodeInfo, TierUsage
from pof_connector.pins.pin_book import PinBook
from pof_connector.pool.lookup import SourceFinder
from pof_connector.pool.node_parts import NodeParts
from pof_connector.pool.pin_copies import PinCopies
from pof_connector.pool.placement import Placement
from pof_connector.tiers.tenant_usage import META_KEY, TenantUsage

if TYPE_CHECKING:
    from pof_connector.pool.reads import Reads

log = logging.getLogger("pof_connector.pool")     # the pool's one logger: filters set on it keep working
REVOCATIONS_EVERY_S = 2.0
"""How often a node reads the node list for pages of its own another node's audit revoked."""
EMBEDDED_RESTART_S = 5.0
"""Least time between two restarts of the embedded index server."""


class Membership:
    """Heartbeats of a worker node (``meta``: the node meta it reports, the fabric's lending state added)."""

    def __init__(self, parts: NodeParts, meta: dict[str, str], finder: SourceFinder, placement: Placement,
                 reads: Reads | None = None, namespace: bytes = b"") -> None:
        self.config = parts.config
        self.parts = parts
        self.node_id = parts.own.node_id
        self.meta = meta
        self.own = parts.own
        self.index = parts.index
        self.guard = parts.guard
        self.publisher = parts.publisher
        self.placement = placement
        self.finder = finder
        self.stats = parts.stats
        self.log_once = parts.log_once
        self.fabric = parts.fabric
        self._tenants = TenantUsage(self.stats) if self.config.tenants.enabled else None
        self.pins = PinBook()
        """The live prefix pins: the tiers ask it on eviction; the heartbeat keeps it in step with the index."""
        for tier in self.own.all:
            tier.set_keep(self.pins.keep)
        self.copies: PinCopies | None = None
        """Makes this node one of a pin's ``replicas`` when it is asked to (a node with tiers)."""
        if reads is not None and self.own.all:
            self.copies = PinCopies(parts, finder, self.pins, namespace, reads.load, placement.store_packed)
        self._next_index_restart = 0.0
        self._last_beat: float | None = None
        """When a heartbeat last reached the index (``None``: never yet)."""
        self._next_revocations = 0.0
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Register now (unless the index is down), then heartbeat every ``heartbeat_s`` on a thread."""
        # Registered before the pool's constructor returns: until then the node is not in the node
        # list and its publishes are dropped, so a page stored at once was invisible to other
        # nodes until the heartbeat thread first ran.
        self.beat()
        self._thread = threading.Thread(target=self._loop, name="pof-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the heartbeat thread (waiting up to 5 s for a beat in progress)."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.copies is not None:
            self.copies.close()

    def _drop_revoked(self) -> None:
        """Drop the pages of ours another node's audit found wrong (see :mod:`pof_connector.audit.revocations`)."""
        now = time.monotonic()
        if not self.own.all or now < self._next_revocations:
            return
        self._next_revocations = now + REVOCATIONS_EVERY_S
        # Read apart from the finder's node list: refreshing that one here would make a node that
        # registers right after look unknown to lookups for a moment (they refresh it on a miss).
        infos = self.guard.call("nodes", self.index.nodes, default=None)
        dropped = 0
        for key, loc in revoked_for(self.node_id, infos or ()):
            if self.parts.drop_own(key, loc.medium, loc.slot):
                dropped += 1
                self.stats.add("audit_revoked", tier=loc.medium)
        if dropped:
            log.warning("pof: another node's audit found %d page(s) of ours wrong; dropped them "
                        "(pof_audit_revoked_total)", dropped)

    def node_info(self) -> NodeInfo:
        tiers = {t.medium: TierUsage(t.capacity_slots * t.slot_bytes, t.free_slots * t.slot_bytes, t.domain)
                 for t in self.own.live()}
        for t in self.own.all:
            self.stats.set_gauge("tier_used_bytes", t.used_slots * t.slot_bytes, tier=t.medium)
            self.stats.set_gauge("tier_capacity_bytes", t.capacity_slots * t.slot_bytes, tier=t.medium)
        meta = self.meta if self.fabric is None else {**self.meta, **self.fabric.lend_meta()}
        if self._tenants is not None:
            meta = {**meta, META_KEY: self._tenants.report(self.own.all)}
        return NodeInfo(self.node_id, tiers, meta)

    def heartbeat(self) -> None:
        """One heartbeat: check the tiers, keep the node alive, re-publish when the index asks."""
        self._check_tiers()
        if self.fabric is not None and self.fabric.peers.connected:
            self.finder.refresh_nodes()        # drop connections to peers that left or restarted
        if self.fabric is not None and self.fabric.lender is not None:
            gone = self.fabric.lender.reclaim_expired()
            if gone:         # published by writers as ours; the slots are invalid now
                self.publisher.withdraw(gone)
        self.placement.maintain_spills_soon()
        self.placement.balance_soon()
        try:
            fresh = self.guard.call("heartbeat", self.index.heartbeat, self.node_info(), self.config.node_ttl_s,
                                    default=None)
        except NodeIdTaken as e:
            # Taking the id back would end the other process's registration, which would take it
            # back in turn: every heartbeat a new incarnation and a full re-publish on both.
            self.stats.add("index_errors", op="node_id_taken")
            self.log_once("node-id-taken", logging.ERROR, "pof: %s. Until it stops, this process serves its "
                          "pages only to itself (they are not published)", e)
            return                       # once the id is ours again, a fresh registration re-publishes
        if fresh is None:
            self._restart_embedded_index()
            return
        now = time.monotonic()
        if fresh and self._last_beat is not None and now - self._last_beat >= self.config.node_ttl_s:
            # Its pages were invisible to every lookup from the lapse until the re-publish below
            # (a P/D decode waiting for them may have given up): say how late the heartbeat was.
            log.warning("pof: this node's registration had lapsed: %.1fs since its last heartbeat reached the "
                        "index (node_ttl_s %.1f): an index outage, a busy host or a paused process",
                        now - self._last_beat, self.config.node_ttl_s)
            self.stats.add("registration_lapses")
        self._last_beat = now
        self.publisher.retry_withdraws(fresh)
        self._drop_revoked()
        # After a fresh registration (the index lost its data, or this node restarted) the pins this
        # node knows are written back: a pin outlives an index restart while any node lives.
        if fresh or self.pins.due():
            self.guard.call("pins", lambda: self.pins.sync(self.index, write_back=bool(fresh)), default=None)
            if self.copies is not None:
                self.copies.check_soon()
        if self.publisher.take_republish() or fresh:
            entries = [e for t in self.own.live() for e in self.own.entries(t)]
            self.publisher.publish_all(entries)
            if entries:
                log.info("pof: published %d pages to the index (%s)", len(entries),
                         "new registration" if fresh else "after an index outage")
            self.placement.republish_spills_soon()

    def _check_tiers(self) -> None:
        for tier in self.own.all:
            if self.own.is_broken(tier.medium) or tier.healthy():
                continue
            self.own.mark_broken(tier.medium)
            self.stats.add("tier_errors", tier=tier.medium)
            entries = self.own.entries(tier)
            log.error("pof: the %s tier was lost (%s); dropping its %d pages, engines recompute them",
                      tier.medium, getattr(tier, "path", tier.domain), len(entries))
            self.publisher.withdraw(entries)

    def _restart_embedded_index(self) -> None:
        """The embedded server is this host's to run: if its process died, start it again (every
        5 s at most). Whether it died is asked of its processes (see
        :func:`~pof_connector.index.embedded.embedded_alive`), never concluded from a failed call:
        a server that a busy host makes slow keeps its books, and a second one would split them."""
        if self.config.index_url != "embedded" or time.monotonic() < self._next_index_restart:
            return
        from pof_connector.index.embedded import embedded_alive, restart_embedded

        if embedded_alive(self.config.runtime_dir):
            return                         # slow or frozen, not dead: its calls were counted, they are retried
        self._next_index_restart = time.monotonic() + EMBEDDED_RESTART_S
        reason = f"node {self.node_id}: no index server process runs; last error: {self.guard.last_error}"
        try:
            started = restart_embedded(self.config.runtime_dir, reason)
        except (OSError, TimeoutError, RuntimeError, ConfigError) as e:      # ConfigError: runtime_dir not ours
            self.log_once("embedded-restart", logging.ERROR, "pof: could not restart the embedded index: %s", e)
            return
        if started:
            self.stats.add("index_restarts", reason="server_died")
        self.guard.retry_now()             # try it at once

    def beat(self) -> None:
        """:meth:`heartbeat`, logging (once) instead of raising."""
        try:
            self.heartbeat()
        except Exception as e:   # keep heartbeating; a bug here must not silently stop liveness
            self.log_once("heartbeat", logging.ERROR, "pof: heartbeat failed", exc_info=e)

    def _loop(self) -> None:
        unpin()          # an engine's busy core must not starve the heartbeat (see cpu_affinity)
        while not self._closed.wait(self.config.heartbeat_s):
            self.beat()
