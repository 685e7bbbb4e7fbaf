"""Reads of single page slots of other nodes' tiers, over NIXL, into pof-owned staging.

One call of :meth:`RemoteReader.read` serves one load: pages are grouped per (peer, medium) and
each group is one NIXL READ request; when it completes, a second small READ per group fetches
each slot's live generation word, so a slot the owner started to reuse during the first READ is
rejected (the owner zeroes that word before touching any byte, tiers/base.py). Then every page
is checked like a local one: header magic, key, generation, header and segment checksums.

Nothing here raises for a remote failure: a page that cannot be fetched or validated comes back
as a :class:`~pof_connector.pages.PageError` (``remote_error``, ``timeout``, ``peer_down``,
``no_staging``, or a validation reason) and the engine recomputes it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pof_connector.fabric.agent import FabricError, NixlAgent
from pof_connector.fabric.meta import AGENT_KEY, PeerMeta
from pof_connector.fabric.peer import Peer
from pof_connector.fabric.staging import StagingArea
from pof_connector.index import Location, NodeInfo
from pof_connector.keys import PageKey
from pof_connector.pages import PageError, PageHeader, PageSpec, verify_segment
from pof_connector.tiers import SlotRef

log = logging.getLogger(__name__)

POLL_S = 0.0002
"""Sleep between completion polls: busy polling starved UCX's progress thread on 2 cores."""
SUSPECT_AFTER_TIMEOUT_S = 5.0
"""A peer that missed a deadline gets no new reads for this long (a stalled peer stays stalled)."""
RECONNECT_AFTER_ERROR_S = 1.0
"""After a disconnect, wait this long before connecting again from the index's metadata."""


class StagedPage:
    """Validated remote pages in staging, read through the same calls as a tier
    (:class:`pof_connector.page_reader.SlotSource`); ``ref.slot`` is the staging slot."""

    def __init__(self, staging: StagingArea, spec: PageSpec, medium: str) -> None:
        self._staging = staging
        self._spec = spec
        self.medium = medium

    def segment_view(self, ref: SlotRef, layer: int) -> np.ndarray:
        page: np.ndarray = self._staging.page(ref.slot)
        return page[self._spec.segment_offset(layer):self._spec.segment_offset(layer) + self._spec.segment_bytes]

    def check_segment(self, ref: SlotRef, header: PageHeader, layer: int) -> None:
        """Nothing left to check: the whole page was validated on arrival, and staging slots are
        pof's own (no one writes them until :meth:`unpin` gives them back)."""

    def header(self, ref: SlotRef) -> np.ndarray:
        return self._staging.page(ref.slot)[:self._spec.header_bytes]

    def unpin(self, slot: int) -> None:
        self._staging.give([slot])


Fetched = tuple[StagedPage, SlotRef, PageHeader]


@dataclass
class _Group:
    """The pages of one load that come from one peer's medium: one READ request."""

    node: str
    medium: str
    meta: PeerMeta
    pages: list[int] = field(default_factory=list)      # positions in the load
    peer: Peer | None = None
    slots: list[int] = field(default_factory=list)      # staging slots, parallel to pages
    handle: Any = None
    phase: str = "data"                                 # data → generation → done


class RemoteReader:
    def __init__(self, agent: NixlAgent, staging: StagingArea, spec: PageSpec, timeout_s: float) -> None:
        self.agent = agent
        self.staging = staging
        self.spec = spec
        self.timeout_s = timeout_s
        self._peers: dict[str, Peer] = {}
        self._suspect: dict[str, float] = {}          # node → monotonic time it may be used again
        self._connecting: dict[str, tuple[str, Future[None]]] = {}    # node → (agent name, attempt)
        self._connector = ThreadPoolExecutor(1, thread_name_prefix="pof-fabric-connect")
        self._closed = False
        self._lock = threading.Lock()

    # ---- peers -------------------------------------------------------------------------------

    @property
    def peers(self) -> list[str]:
        """Nodes connected now."""
        with self._lock:
            return list(self._peers)

    def usable(self, node: str) -> bool:
        """False while ``node`` is in a back-off after a timeout or a disconnect."""
        with self._lock:
            return self._suspect.get(node, 0.0) <= time.monotonic()

    def retain(self, live: Mapping[str, NodeInfo]) -> None:
        """Disconnect peers that left the index (heartbeat expired) or restarted (new agent)."""
        with self._lock:
            gone = [n for n, p in self._peers.items() if n not in live or live[n].meta.get(AGENT_KEY) != p.name]
        for node in gone:
            log.info("pof fabric: dropping peer %s (left the index or restarted)", node)
            self._drop(node)

    def connect(self, node: str, meta: PeerMeta) -> Peer:
        """The connected peer, for spill's WRITEs and control messages; :meth:`disconnect` after use.
        Raises :class:`FabricError` (``peer_down`` while ``node`` is in a back-off). Waits for a
        new connection however long it takes (a spill runs on the store thread, not a request's)."""
        return self._acquire(node, meta, None)

    def disconnect(self, peer: Peer) -> None:
        self._release(peer)

    def back_off(self, node: str, seconds: float, *, drop: bool) -> None:
        """Use ``node`` for nothing during ``seconds``; ``drop`` also closes its connection (after a
        disconnect error: it never recovers, reconnect from fresh metadata later)."""
        if drop:
            self._drop(node, seconds)
        else:
            with self._lock:
                self._suspect[node] = max(self._suspect.get(node, 0.0), time.monotonic() + seconds)

    def _acquire(self, node: str, meta: PeerMeta, deadline: float | None) -> Peer:
        """The connected peer (connecting lazily from ``meta``); call :meth:`_release` after use.

        Connecting runs on the connect thread: loading a peer's metadata opens UCX endpoints,
        which blocks for seconds when the peer's address is unreachable (a cut link). A load
        waits for it only until its ``deadline`` (``None``: as long as it takes); the connection
        goes on in the background.
        """
        with self._lock:
            if self._suspect.get(node, 0.0) > time.monotonic():
                raise FabricError("peer_down", f"{node} failed recently; not reading from it for now")
            peer = self._peers.get(node)
            if peer is not None and peer.name != meta.agent:
                self._detach(node)
                peer = None
            if peer is not None:
                peer.inflight += 1
                return peer
            pending = self._connecting.get(node)
            if pending is None or pending[0] != meta.agent:
                # One connection attempt per peer incarnation, whoever asks (1-40 ms normally).
                pending = (meta.agent, self._connector.submit(self._connect, node, meta))
                self._connecting[node] = pending
        try:
            pending[1].result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            with self._lock:
                self._suspect[node] = max(self._suspect.get(node, 0.0), time.monotonic() + SUSPECT_AFTER_TIMEOUT_S)
            raise FabricError("timeout", f"connecting to {node} took longer than {self.timeout_s}s") from None
        with self._lock:
            peer = self._peers.get(node)
            if peer is None or peer.name != meta.agent:
                raise FabricError("peer_down", f"{node} was dropped while connecting")
            peer.inflight += 1
            return peer

    def _connect(self, node: str, meta: PeerMeta) -> None:
        """On the connect thread: load ``meta`` into our agent and prepare its descriptor lists."""
        try:
            peer = Peer(self.agent, node, meta, self.spec.page_bytes)
        except FabricError as e:
            with self._lock:
                self._suspect[node] = max(self._suspect.get(node, 0.0), time.monotonic() + RECONNECT_AFTER_ERROR_S)
                self._connecting.pop(node, None)
            log.warning("pof fabric: could not connect to %s: %s", node, e)
            raise
        with self._lock:
            self._connecting.pop(node, None)
            stale = self._closed or (node in self._peers and self._peers[node].name == peer.name)
            if not stale:
                old = self._detach(node)
                self._peers[node] = peer
        if stale:
            peer.close(self.agent)
            return
        if old is not None and old.inflight == 0:
            old.close(self.agent)
        log.info("pof fabric: connected to %s (%s)", node, peer.name)

    def _release(self, peer: Peer) -> None:
        with self._lock:
            peer.inflight -= 1
            close = peer.closing and peer.inflight == 0
        if close:
            peer.close(self.agent)

    def _drop(self, node: str, backoff_s: float = 0.0) -> None:
        with self._lock:
            if backoff_s:
                self._suspect[node] = max(self._suspect.get(node, 0.0), time.monotonic() + backoff_s)
            peer = self._detach(node)
            close = peer is not None and peer.inflight == 0
        if close and peer is not None:
            peer.close(self.agent)

    def _detach(self, node: str) -> Peer | None:
        """Under the lock: forget ``node``'s peer; it is closed by whoever sees inflight reach 0."""
        peer = self._peers.pop(node, None)
        if peer is not None:
            peer.closing = True
        return peer

    # ---- reads -------------------------------------------------------------------------------

    def read(self, keys: Sequence[PageKey], sources: Sequence[Location],
             metas: Sequence[PeerMeta]) -> list[Fetched | PageError]:
        """Fetch and validate page ``i`` (``keys[i]`` at ``sources[i]``, published in ``metas[i]``).

        Returns, per page, the staged page (give it back with ``unpin``) or why it failed. Returns
        within about ``timeout_s`` whatever the peers do.
        """
        deadline = time.monotonic() + self.timeout_s
        out: list[Fetched | PageError | None] = [None] * len(keys)
        groups: dict[tuple[str, str], _Group] = {}
        for i, (src, meta) in enumerate(zip(sources, metas, strict=True)):
            groups.setdefault((src.node, src.medium), _Group(src.node, src.medium, meta)).pages.append(i)
        active: list[_Group] = []
        try:
            for g in groups.values():
                try:
                    self._start(g, sources, out, deadline)
                except FabricError as e:
                    self._fail_group(g, out, e)
                    continue
                except PageError as e:
                    self._fail_group(g, out, e)
                    continue
                if g.handle is not None:
                    active.append(g)
            self._wait(active, sources, out, deadline)
            for g in active:
                if g.phase == "done":
                    self._validate(g, keys, sources, out)
        finally:
            for g in groups.values():
                if g.handle is not None:      # still in flight: deadline or an unexpected error
                    self._cancel(g, out, FabricError("timeout", f"{g.node} did not answer in {self.timeout_s}s"))
                if g.peer is not None:
                    self._release(g.peer)
                    g.peer = None
        return [r if r is not None else PageError("remote_error", "not read") for r in out]

    def _start(self, g: _Group, sources: Sequence[Location], out: list[Fetched | PageError | None],
               deadline: float) -> None:
        g.peer = self._acquire(g.node, g.meta, deadline)
        prepared = g.peer.dlists.get(g.medium)
        if prepared is None:
            raise PageError("unreachable", f"{g.node} publishes no readable {g.medium} region")
        dlist, num_slots = prepared
        wanted = []
        for i in g.pages:
            if 0 <= sources[i].slot < num_slots:
                wanted.append(i)
            else:
                out[i] = PageError("bad_header", f"slot {sources[i].slot} outside {g.node}'s {g.medium}")
        slots = self.staging.take(len(wanted))
        for i in wanted[len(slots):]:
            out[i] = PageError("no_staging", f"fabric.staging_size holds {self.staging.num_slots} pages")
        g.pages, g.slots = wanted[:len(slots)], slots
        if not g.pages:
            return
        remote = np.array([sources[i].slot for i in g.pages], dtype=np.int64)
        try:
            g.handle = self.agent.post_read(self.staging.dlist, np.array(slots, dtype=np.int64), dlist, remote)
        except FabricError as e:
            if e.disconnected:
                self.staging.give(g.slots)
            else:
                self.staging.quarantine(g.slots)    # whether anything was posted is unknown
            g.slots = []
            self._drop(g.node, RECONNECT_AFTER_ERROR_S)   # reconnect from fresh metadata next time
            raise

    def _wait(self, active: list[_Group], sources: Sequence[Location], out: list[Fetched | PageError | None],
              deadline: float) -> None:
        pending = list(active)
        while pending:
            for g in list(pending):
                try:
                    if not self.agent.done(g.handle):
                        continue
                except FabricError as e:
                    self._cancel(g, out, e)
                    pending.remove(g)
                    continue
                self.agent.release(g.handle)
                g.handle = None
                if g.phase == "data":
                    # The data is here; now the live generation words, strictly after it.
                    assert g.peer is not None
                    dlist, num_slots = g.peer.dlists[g.medium]
                    local = np.array(g.slots, dtype=np.int64) + self.staging.num_slots
                    remote = np.array([sources[i].slot for i in g.pages], dtype=np.int64) + num_slots
                    for s in g.slots:
                        self.staging.clear_generation(s)
                    g.phase = "generation"
                    try:
                        g.handle = self.agent.post_read(self.staging.dlist, local, dlist, remote)
                    except FabricError as e:
                        self._cancel(g, out, e)
                        pending.remove(g)
                else:
                    g.phase = "done"
                    pending.remove(g)
            if pending:
                if time.monotonic() > deadline:
                    return
                time.sleep(POLL_S)

    def _validate(self, g: _Group, keys: Sequence[PageKey], sources: Sequence[Location],
                  out: list[Fetched | PageError | None]) -> None:
        spec = self.spec
        staged = StagedPage(self.staging, spec, f"remote:{g.medium}")
        for i, slot in zip(g.pages, g.slots, strict=True):
            page = self.staging.page(slot)
            try:
                header = PageHeader.parse(page[:spec.header_bytes])
                header.expect(spec, keys[i], sources[i].generation)
                for layer in range(spec.num_layers):
                    verify_segment(spec, header, layer, spec.segment(page, layer))
                live = self.staging.generation(slot)
                if live != sources[i].generation:
                    raise PageError("stale_generation", f"{g.node}'s {g.medium} slot {sources[i].slot} was "
                                                        f"rewritten during the read (generation now {live})")
            except PageError as e:
                self.staging.give([slot])
                out[i] = e
                continue
            out[i] = (staged, SlotRef(slot, sources[i].generation), header)
        g.slots = []

    def _cancel(self, g: _Group, out: list[Fetched | PageError | None], err: FabricError) -> None:
        """Give up on ``g``: its pages fail with ``err``'s reason."""
        self.agent.release(g.handle)
        g.handle = None
        if err.disconnected:
            # The connection is dead for good (it never recovers, research notes §4), so nothing
            # can land in the staging slots any more: reuse them, reconnect later.
            self.staging.give(g.slots)
            self._drop(g.node, RECONNECT_AFTER_ERROR_S)
        else:
            # Cancelled in flight: the peer's data may still arrive into these slots.
            self.staging.quarantine(g.slots)
            if err.reason == "timeout":
                # A stalled peer may recover on the same connection; leave it alone for a while.
                with self._lock:
                    self._suspect[g.node] = time.monotonic() + SUSPECT_AFTER_TIMEOUT_S
            else:
                self._drop(g.node, RECONNECT_AFTER_ERROR_S)     # e.g. stale metadata: fetch it again
        g.slots = []
        log.warning("pof fabric: %d page(s) from %s failed: %s", len(g.pages), g.node, err)
        self._fail_group(g, out, err)

    @staticmethod
    def _fail_group(g: _Group, out: list[Fetched | PageError | None], err: FabricError | PageError) -> None:
        page_err = err if isinstance(err, PageError) else PageError(err.reason, f"{g.node}: {err.detail}")
        for i in g.pages:
            if out[i] is None:
                out[i] = page_err

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._connector.shutdown(wait=True)     # a connection under way ends (or fails) first
        with self._lock:
            nodes = list(self._peers)
        for node in nodes:
            self._drop(node)
