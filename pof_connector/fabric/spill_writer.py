"""The writer's side of spill: a page evicted from this node's last tier goes into a slot another
node granted, instead of being dropped.

1. **Target**: among live nodes that lend slots (``fabric.spill`` or ``pof memd``), the one with
   the most free bytes in the most preferred medium (this node's tier order), from the node
   info their heartbeats put in the index.
2. **Grant**: a ``grant`` control message (:mod:`.notifier`) asks the owner for a few slots at once;
   the reply lists (slot, generation) pairs and the lease. Spare slots wait in a reserve for the
   next evicted pages.
3. **Write**: the page, re-stamped with the granted generation, is copied into pof-owned staging
   (:meth:`SpillWriter.prepare_spill`); at the end of a store batch (:meth:`SpillWriter.complete_spills`)
   one NIXL WRITE per owner carries all but the headers' generation words, which a second WRITE
   puts in last (the seqlock protocol of tiers/base.py: until then readers see generation 0).
4. **Publish**: the pool publishes ``(owner node, medium, slot, generation)`` under this node's
   name space in the index; the index records it as the owner's, so it vanishes with the owner.

Leases are renewed from the store thread while the pages are kept; an entry whose lease ended is
withdrawn. Every failure (no target, owner full, timeout, dead owner) only means the page is
dropped, as it would have been without spill: the engine recomputes it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from pof_connector.config import FabricConfig
from pof_connector.fabric.agent import FabricError, NixlAgent
from pof_connector.fabric.meta import PeerMeta
from pof_connector.fabric.notifier import Notifier
from pof_connector.fabric.peers import Peers
from pof_connector.fabric.registered_staging import StagingArea
from pof_connector.fabric.remote_node import RemoteNode
from pof_connector.index import Location, NodeInfo
from pof_connector.pages.keys import PageKey
from pof_connector.pages.layout import GENERATION_AT, PageError, PageHeader, PageSpec, encode_header

log = logging.getLogger(__name__)

LEND_KEY = "fabric.lend"
"""Node meta: ``"1"`` when the node grants spill slots (fabric.spill on, or a memory node)."""
GRANT_BATCH = 64
"""Slots asked for per grant: one round trip serves this many evicted pages."""
FULL_BACKOFF_S = 2.0
"""After an owner answered "full", it is not asked again for this long (its node info catches up)."""
DOWN_BACKOFF_S = 5.0
"""After an owner did not answer or a write failed, it gets no spill for this long."""
POLL_S = 0.0002
MAX_SLOTS_PER_MESSAGE = 1000
"""Slots named in one renew or release message (a notification is meant to stay small)."""


@dataclass(frozen=True)
class Target:
    """Where the next page goes: ``medium`` of ``node``, reachable through ``meta``."""

    node: str
    meta: PeerMeta
    medium: str


@dataclass
class _Grant:
    slot: int
    generation: int
    expires: float          # monotonic, as the writer counts it (the owner keeps it a grace longer)


@dataclass
class _Pending:
    """A page staged for ``grant`` on ``target``, waiting for :meth:`SpillWriter.complete_spills`."""

    key: PageKey
    target: Target
    peer: RemoteNode        # held (connected) until the write is done
    grant: _Grant
    stage: int


class SpillWriter:
    """Spills pages of this node (``node_id``) over ``agent``. Not thread-safe: the pool calls it
    from its store thread only."""

    def __init__(self, node_id: str, agent: NixlAgent, peers: Peers, staging: StagingArea,
                 notifier: Notifier, spec: PageSpec, config: FabricConfig) -> None:
        self.node_id = node_id
        self.agent = agent
        self.peers = peers
        self.staging = staging
        self.notifier = notifier
        self.spec = spec
        self.lease_s = config.spill_lease_s
        self.timeout_s = config.timeout_s
        self._reserve: dict[tuple[str, str], list[_Grant]] = {}
        self._spilled: dict[PageKey, tuple[Location, _Grant]] = {}
        self._full_until: dict[tuple[str, str], float] = {}
        self._metas: dict[str, PeerMeta] = {}
        self._pending: list[_Pending] = []
        self._untold: dict[tuple[str, str], list[tuple[int, PageKey]]] = {}   # told at the end of complete_spills

    @property
    def spilled(self) -> int:
        """Pages of this node living in other nodes' slots now."""
        return len(self._spilled)

    def entries(self) -> list[tuple[PageKey, Location]]:
        """Where this node's spilled pages are (to publish again after an index restart)."""
        return [(key, loc) for key, (loc, _) in self._spilled.items()]

    # ---- target ------------------------------------------------------------------------------

    def choose(self, nodes: Iterable[NodeInfo], media: Sequence[str]) -> Target | None:
        """The lending node with the most free bytes in the first of ``media`` any of them offers
        (then the next medium, …); ``None`` when no node can take a page now."""
        now = time.monotonic()
        best: tuple[int, int, str, str] | None = None
        for info in nodes:
            if info.node_id == self.node_id or info.meta.get(LEND_KEY) != "1":
                continue
            meta = PeerMeta.from_meta(info.meta)
            if meta is None or not self.peers.usable(info.node_id):
                continue
            for medium, usage in info.tiers.items():
                region = meta.regions.get(medium)
                if (region is None or region.slot_bytes < self.spec.page_bytes
                        or self._full_until.get((info.node_id, medium), 0.0) > now):
                    continue
                reserve = self._usable_reserve(info.node_id, medium, now)
                if usage.free_bytes < region.slot_bytes and not reserve:
                    continue
                rank = media.index(medium) if medium in media else len(media)
                cand = (rank, -usage.free_bytes, info.node_id, medium)
                if best is None or cand < best:
                    best = cand
                    self._metas[info.node_id] = meta
        if best is None:
            return None
        return Target(best[2], self._metas[best[2]], best[3])

    # ---- spill -------------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Pages staged by :meth:`prepare_spill` and not written yet."""
        return len(self._pending)

    @property
    def batch_limit(self) -> int:
        """Pages to stage before writing them out: a quarter of the staging area at most, the rest
        stays free for remote reads."""
        return max(1, min(MAX_SLOTS_PER_MESSAGE, self.staging.num_slots // 4))

    def prepare_spill(self, key: PageKey, page: np.ndarray, target: Target) -> None:
        """Stage ``page`` (a verified copy of ``key``'s page; the caller may reuse it at once) for
        a slot granted by ``target``. :meth:`complete_spills` writes what was staged. Raises
        :class:`PageError` with the reason it was dropped (``spill_full``, ``timeout``,
        ``remote_error``, ``peer_down``, ``no_staging``)."""
        try:
            peer = self.peers.acquire(target.node, target.meta)
        except FabricError as e:
            raise PageError(e.reason, f"{target.node}: {e.detail}") from None
        try:
            grant = self._take_grant(peer, target)
            prepared = peer.dlists.get(target.medium)
            if prepared is None or not 0 <= grant.slot < prepared[1]:
                raise PageError("remote_error", f"{target.node} granted slot {grant.slot} outside its "
                                                f"{target.medium}")
            stage = self.staging.take(1)
            if not stage:
                raise PageError("no_staging", "every staging slot is in use")
        except PageError:
            self.peers.release(peer)
            raise
        spec = self.spec
        buf = self.staging.page(stage[0])
        header = PageHeader.parse(page[:spec.header_bytes])
        np.copyto(buf, page[:spec.page_bytes])
        buf[:spec.header_bytes] = np.frombuffer(encode_header(spec, key, grant.generation, header.segment_checksums,
                                                              header.sum_seed),       # the page keeps its own seed
                                                dtype=np.uint8)
        buf[GENERATION_AT:GENERATION_AT + 8] = 0        # the generation word goes last, on its own
        self.staging.set_generation(stage[0], grant.generation)
        self._pending.append(_Pending(key, target, peer, grant, stage[0]))

    def complete_spills(self) -> list[tuple[PageKey, Location | PageError]]:
        """Write every staged page: per owner and medium one WRITE of the pages, then one of their
        generation words. Returns, per page, its location for the index or why it was dropped."""
        pending, self._pending = self._pending, []
        groups: dict[tuple[str, str], list[_Pending]] = {}
        for p in pending:
            groups.setdefault((p.target.node, p.target.medium), []).append(p)
        out: list[tuple[PageKey, Location | PageError]] = []
        for (node, medium), group in groups.items():
            try:
                self._write(node, medium, group)
            except PageError as e:
                out.extend((p.key, e) for p in group)
                continue
            finally:
                for p in group:
                    self.peers.release(p.peer)
            for p in group:
                loc = Location(node, medium, p.grant.slot, p.grant.generation)
                old = self._spilled.pop(p.key, None)
                self._spilled[p.key] = (loc, p.grant)
                self._untold.setdefault((node, medium), []).append((p.grant.slot, p.key))
                if old is not None:    # spilled before and kept locally meanwhile: the old slot goes back
                    self._send_release(old[0].node, old[0].medium, [old[0].slot])
                out.append((p.key, loc))
        # Before the pool publishes these entries: a writer that stops or dies right after
        # publishing (before its next lease upkeep) must not leave entries the owner cannot withdraw.
        self._tell_written()
        return out

    def _usable_reserve(self, node: str, medium: str, now: float) -> list[_Grant]:
        """Granted, unused slots with enough lease left for a write (one timeout) and a read."""
        reserve = self._reserve.get((node, medium), [])
        return [g for g in reserve if g.expires - now > 2 * self.timeout_s]

    def _take_grant(self, peer: RemoteNode, target: Target) -> _Grant:
        now = time.monotonic()
        reserve = self._usable_reserve(target.node, target.medium, now)
        if not reserve:
            asked = time.monotonic()
            try:
                reply = self.notifier.request(peer.name, {"op": "grant", "node": self.node_id, "medium": target.medium,
                                                          "n": GRANT_BATCH, "lease_s": self.lease_s}, self.timeout_s)
            except FabricError as e:
                self.peers.back_off(target.node, DOWN_BACKOFF_S, drop=True)
                raise PageError(e.reason, f"{target.node}: grant request: {e.detail}") from None
            if reply is None:
                self.peers.back_off(target.node, DOWN_BACKOFF_S, drop=False)
                raise PageError("timeout", f"{target.node} did not answer a grant request in {self.timeout_s}s")
            pairs = _granted(reply, peer.dlists[target.medium][1] if target.medium in peer.dlists else 0)
            if pairs is None:
                self.peers.back_off(target.node, DOWN_BACKOFF_S, drop=False)
                raise PageError("remote_error", f"{target.node} answered a grant request with slots outside its "
                                                f"{target.medium} region or a malformed reply")
            if not pairs:
                self._full_until[(target.node, target.medium)] = time.monotonic() + FULL_BACKOFF_S
                raise PageError("spill_full", f"{target.node}'s {target.medium} has no free slot to grant")
            # The lease counts from before the request left: the owner's clock started later.
            reserve = [_Grant(s, g, asked + float(reply["lease_s"])) for s, g in pairs]
        grant = reserve.pop()
        self._reserve[(target.node, target.medium)] = reserve
        return grant

    def _write(self, node: str, medium: str, group: list[_Pending]) -> None:
        dlist, num_slots = group[0].peer.dlists[medium]
        stages = [p.stage for p in group]
        deadline = time.monotonic() + self.timeout_s
        local = np.array(stages, dtype=np.int64)
        remote = np.array([p.grant.slot for p in group], dtype=np.int64)
        handle = None
        try:
            handle = self.agent.post_write(self.staging.dlist, local, dlist, remote)
            self._wait(handle, deadline, node)
            self.agent.release(handle)
            handle = self.agent.post_write(self.staging.dlist, local + self.staging.num_slots, dlist,
                                           remote + num_slots)
            self._wait(handle, deadline, node)
        except FabricError as e:
            self.agent.release(handle)
            # The grants are not reused: a cancelled WRITE may still land in them. They expire.
            if e.disconnected:
                self.staging.give(stages)
                self.peers.back_off(node, DOWN_BACKOFF_S, drop=True)
            else:
                self.staging.quarantine(stages)      # a cancelled WRITE may still read them
                self.peers.back_off(node, DOWN_BACKOFF_S, drop=e.reason != "timeout")
            raise PageError(e.reason, f"{node}: {e.detail}") from None
        self.agent.release(handle)
        self.staging.give(stages)

    def _wait(self, handle: object, deadline: float, node: str) -> None:
        while not self.agent.done(handle):
            if time.monotonic() > deadline:
                raise FabricError("timeout", f"{node} did not complete a spill write in {self.timeout_s}s")
            time.sleep(POLL_S)

    # ---- leases ------------------------------------------------------------------------------

    def maintain(self) -> list[tuple[PageKey, Location]]:
        """Renew the leases of spilled pages that are half over, give back reserve slots about to
        expire; returns the spilled entries whose lease ended (to withdraw from the index)."""
        now = time.monotonic()
        due: dict[tuple[str, str], list[PageKey]] = {}
        for key, (loc, grant) in self._spilled.items():
            if grant.expires - now < self.lease_s / 2 and grant.expires > now:
                due.setdefault((loc.node, loc.medium), []).append(key)
        for (node, medium), keys in due.items():
            for start in range(0, len(keys), MAX_SLOTS_PER_MESSAGE):
                self._renew(node, medium, keys[start:start + MAX_SLOTS_PER_MESSAGE])
        for (node, medium), reserve in list(self._reserve.items()):
            keep = self._usable_reserve(node, medium, now)
            stale = [g.slot for g in reserve if g not in keep]
            if stale:
                self._send_release(node, medium, stale)
            self._reserve[(node, medium)] = keep
        now = time.monotonic()
        ended = [(key, loc) for key, (loc, grant) in self._spilled.items() if grant.expires <= now]
        for key, _ in ended:
            del self._spilled[key]
        if ended:
            log.info("pof spill: %d spilled page(s) lost their lease; withdrawn", len(ended))
        return ended

    def _renew(self, node: str, medium: str, keys: list[PageKey]) -> None:
        meta = self._metas.get(node)
        if meta is None:
            return
        slots = {self._spilled[k][0].slot: k for k in keys}
        asked = time.monotonic()
        try:
            peer = self.peers.acquire(node, meta)
        except FabricError:
            return                              # it is backing off: the leases run out
        try:
            reply = self.notifier.request(peer.name, {"op": "renew", "node": self.node_id, "medium": medium,
                                                      "slots": sorted(slots), "lease_s": self.lease_s},
                                          self.timeout_s)
        except FabricError as e:
            log.info("pof spill: could not renew leases on %s: %s", node, e)
            return
        finally:
            self.peers.release(peer)
        if reply is None or not isinstance(reply.get("slots"), list) or not isinstance(reply.get("lease_s"),
                                                                                        (int, float)):
            return
        for slot in reply["slots"]:
            key = slots.get(slot)
            if key is not None:
                self._spilled[key][1].expires = asked + float(reply["lease_s"])

    def _tell_written(self) -> None:
        """Tell owners which page each newly written slot holds (so a reclaim withdraws it), and
        wait for them to confirm: the pool publishes the pages next, and once published, the
        owner must know them even if this process dies at once."""
        untold, self._untold = self._untold, {}
        for (node, medium), pages in untold.items():
            meta = self._metas.get(node)
            if meta is None:
                continue
            try:
                peer = self.peers.acquire(node, meta)
            except FabricError:
                continue                        # backing off: the owner then only invalidates
            try:
                for start in range(0, len(pages), MAX_SLOTS_PER_MESSAGE):
                    chunk = [[slot, *k.wire()]
                             for slot, k in pages[start:start + MAX_SLOTS_PER_MESSAGE]]
                    reply = self.notifier.request(peer.name, {"op": "written", "node": self.node_id,
                                                              "medium": medium, "pages": chunk}, self.timeout_s)
                    if reply is None:
                        log.info("pof spill: %s did not confirm in %gs which pages it holds; if this node dies, "
                                 "its reclaim only invalidates them", node, self.timeout_s)
                        break
            except FabricError as e:
                log.info("pof spill: could not tell %s what it holds: %s", node, e)
            finally:
                self.peers.release(peer)

    def _send_release(self, node: str, medium: str, slots: list[int]) -> None:
        meta = self._metas.get(node)
        if meta is None or not slots:
            return
        try:
            peer = self.peers.acquire(node, meta)
        except FabricError:
            return                              # unreachable: the owner reclaims them when they expire
        try:
            self.notifier.send(peer.name, {"op": "release", "node": self.node_id, "medium": medium, "slots": slots})
        except FabricError as e:
            log.info("pof spill: could not give slots back to %s: %s", node, e)
        finally:
            self.peers.release(peer)

    def close(self) -> list[tuple[PageKey, Location]]:
        """Give every granted slot back; returns the spilled entries to withdraw."""
        gone = [(key, loc) for key, (loc, _) in self._spilled.items()]
        by_owner: dict[tuple[str, str], list[int]] = {}
        for _, loc in gone:
            by_owner.setdefault((loc.node, loc.medium), []).append(loc.slot)
        for (node, medium), reserve in self._reserve.items():
            by_owner.setdefault((node, medium), []).extend(g.slot for g in reserve)
        for (node, medium), slots in by_owner.items():
            for start in range(0, len(slots), MAX_SLOTS_PER_MESSAGE):
                self._send_release(node, medium, slots[start:start + MAX_SLOTS_PER_MESSAGE])
        self._spilled.clear()
        self._reserve.clear()
        return gone


def _granted(reply: dict[str, object], num_slots: int) -> list[tuple[int, int]] | None:
    """A grant reply's (slot, generation) pairs; ``None`` when the reply is malformed or names a
    slot outside the owner's published region (``num_slots``) or a generation below 1: writing
    there would address another descriptor of the region, so nothing is written."""
    slots, lease_s = reply.get("slots"), reply.get("lease_s")
    if (not isinstance(slots, list) or isinstance(lease_s, bool) or not isinstance(lease_s, (int, float))
            or not 0 < lease_s < float("inf")):
        return None
    out = []
    for pair in slots:
        if (not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(n, int) and not isinstance(n, bool)
                                                                     for n in pair)
                or not 0 <= pair[0] < num_slots or pair[1] < 1):
            return None
        out.append((pair[0], pair[1]))
    return out
