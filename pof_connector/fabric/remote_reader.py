"""Reads of single page slots of other nodes' tiers, over NIXL, into pof-owned staging.

One :meth:`RemoteReader.start` serves one load: pages are grouped per (peer, medium) and each
group is read with a few NIXL READ requests in layer order — first the page headers with
layer 0, then the other layers in up to ``LAYER_REQUESTS - 1`` parts, each posted as soon as the
previous one is seen done (:data:`PARTS_AHEAD`) — so the engine can start on layer 0 while later
layers are still on the wire (one request per layer was 2-3x slower than one request, research
notes §6). Progress is driven by the threads that wait (:meth:`RemoteLoad.get` waits for one
layer): the next part is posted when a waiter sees the previous one complete, so a caller that
waits for each layer in turn keeps the link busy. Each part is checked as it arrives (header
magic, key, generation and header checksum with the first, each layer's segment checksum), and
after the last part a small READ per group fetches each slot's live generation word, so a slot
the owner started to reuse during any part is rejected (the owner zeroes that word before
touching any byte, tiers/base.py).

The seqlock argument covers the whole page only once that last check passed, so the last part's
layers are released only after it. A page whose later part or generation check fails may have
had earlier layers released already: it fails as a whole, like a local page whose later layer
fails :meth:`~pof_connector.pool.page_reader.PageReader.check` — the caller reports it and the engine
recomputes it (vLLM: ``get_block_ids_with_load_errors``); the bytes it copied are not used.

The connections to the nodes read from are :class:`~pof_connector.fabric.peers.Peers`' (shared
with the spill writer); a node that fails a read is backed off there.

Nothing here raises for a remote failure: a page that cannot be fetched or validated comes back
as a :class:`~pof_connector.pages.layout.PageError` (``remote_error``, ``timeout``, ``peer_down``,
``no_staging``, or a validation reason) and the engine recomputes it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pof_connector.fabric.agent import FabricError, NixlAgent
from pof_connector.fabric.meta import PeerMeta
from pof_connector.fabric.peers import RECONNECT_AFTER_ERROR_S, SUSPECT_AFTER_TIMEOUT_S, Peers
from pof_connector.fabric.registered_staging import StagedPage, StagingArea
from pof_connector.fabric.remote_node import RemoteNode
from pof_connector.fabric.spans import LAYER_REQUESTS, layer_parts, part_spans, span_base
from pof_connector.index import Location
from pof_connector.pages.keys import PageKey
from pof_connector.pages.layout import PageError, PageHeader, PageSpec, verify_segment
from pof_connector.tiers import SlotRef

log = logging.getLogger(__name__)

POLL_S = 0.0002
"""Sleep between completion polls: busy polling starved UCX's progress thread on 2 cores."""
PARTS_AHEAD = 1
"""Parts of a group in flight at once: the next is posted when the previous one is seen done.
Posted all at once, UCX over TCP served them interleaved and layer 0 arrived only with the rest
(40 pages of 1 MiB, loopback, busy 2-core machine: layer 0 after 70-270 ms of a 140-310 ms load,
against 7-30 ms of a 100-300 ms load chained; tests/fabric/test_remote_reader_layers.py prints
both)."""


Fetched = tuple[StagedPage, SlotRef, PageHeader]


@dataclass
class _Group:
    """The pages of one load that come from one peer's medium: one READ request per layer part,
    then one of the live generation words."""

    node: str
    medium: str
    meta: PeerMeta
    pages: list[int] = field(default_factory=list)      # positions in the load
    peer: RemoteNode | None = None
    slots: list[int] = field(default_factory=list)      # staging slots, parallel to pages; owned by the load
    handles: list[Any] = field(default_factory=list)    # per stage (parts, then generation); None: not in flight
    level: int = 0                                      # stages validated, in order
    deadline: float = 0.0                               # when the request in flight must be done
    over: bool = True                                   # complete or failed: nothing left to wait for


class RemoteReader:
    """Reads other nodes' pages into ``staging`` over the connections ``peers`` keeps."""

    def __init__(self, agent: NixlAgent, peers: Peers, staging: StagingArea, spec: PageSpec, timeout_s: float,
                 requests: int = LAYER_REQUESTS) -> None:
        """``requests``: READ requests per group and load (see :func:`layer_parts`); ``staging``
        and ``peers`` must have been made with the matching :func:`part_spans`."""
        self.agent = agent
        self.staging = staging
        self.spec = spec
        self.timeout_s = timeout_s
        self.parts = layer_parts(spec.num_layers, requests)
        self.spans = part_spans(spec, self.parts)
        if staging.spans != self.spans:
            raise ValueError(f"staging prepared for spans {staging.spans}, reads need {self.spans}")
        if peers.spans != self.spans:
            raise ValueError(f"peers prepared for spans {peers.spans}, reads need {self.spans}")
        self.connections = peers

    # ---- reads -------------------------------------------------------------------------------

    def start(self, keys: Sequence[PageKey], sources: Sequence[Location], metas: Sequence[PeerMeta]) -> RemoteLoad:
        """Post the READs of page ``i`` (``keys[i]`` at ``sources[i]``, published in ``metas[i]``)
        and return at once; :meth:`RemoteLoad.get` waits for one layer at a time. Close the load."""
        return RemoteLoad(self, keys, sources, metas)

    def read(self, keys: Sequence[PageKey], sources: Sequence[Location],
             metas: Sequence[PeerMeta]) -> list[Fetched | PageError]:
        """Fetch and validate whole pages (see :meth:`start`).

        Returns, per page, the staged page (give it back with ``unpin``) or why it failed. A peer
        that stalls or dies fails its pages about ``timeout_s`` after the request it did not
        answer was posted, at the latest.
        """
        load = self.start(keys, sources, metas)
        try:
            return load.finish()
        finally:
            load.close()



class RemoteLoad:
    """The remote pages of one load, in flight (see the module docstring). Used by one thread.

    It owns every staging slot it took until :meth:`close` (or :meth:`finish`, which hands the
    slots of good pages to the caller): a failed page's slot may still be the target of a later
    part of its group's READ, so it is given back only once nothing is in flight.
    """

    def __init__(self, reader: RemoteReader, keys: Sequence[PageKey], sources: Sequence[Location],
                 metas: Sequence[PeerMeta]) -> None:
        self._reader = reader
        self.keys = list(keys)
        self.sources = list(sources)
        self._parts = reader.parts
        self._stage_of = [c for c, part in enumerate(reader.parts) for _ in part]    # layer → part
        self._out: list[Fetched | PageError | None] = [None] * len(self.keys)
        self._group_of: list[_Group | None] = [None] * len(self.keys)
        groups: dict[tuple[str, str], _Group] = {}
        for i, (src, meta) in enumerate(zip(self.sources, metas, strict=True)):
            groups.setdefault((src.node, src.medium), _Group(src.node, src.medium, meta)).pages.append(i)
        self._groups = list(groups.values())
        self._closed = False
        try:
            for g in self._groups:
                self._start(g)
        except BaseException:
            self.close()
            raise

    # ---- results -------------------------------------------------------------------------------

    def get(self, i: int, layer: int) -> Fetched | PageError:
        """Page ``i`` once layers ``0..layer`` of it arrived and were validated (waiting at most
        about ``timeout_s`` for the peer: each request must complete that long after its post),
        or why it failed. A page may fail at a later layer after earlier ones were returned:
        then it is to be recomputed as a whole."""
        g = self._group_of[i]
        if g is not None:
            stage = self._stage_of[layer]
            # The last part's layers wait for the generation re-check too: only it proves the
            # whole page (all parts) was read before any reuse of the slot began.
            self._wait(g, stage + 1 if stage + 1 < len(self._parts) else len(self._parts) + 1)
        got = self._out[i]
        return got if got is not None else PageError("remote_error", "not read")

    def complete(self, i: int) -> bool:
        """True when page ``i`` was validated whole (all layers and the generation re-check)."""
        g = self._group_of[i]
        return g is not None and g.level > len(self._parts) and not isinstance(self._out[i], PageError)

    def finish(self) -> list[Fetched | PageError]:
        """Wait for every page; the good ones' staging slots pass to the caller (``unpin``)."""
        last = self._reader.spec.num_layers - 1
        out = [self.get(i, last) for i in range(len(self.keys))]
        for g in self._groups:
            if g.over and not any(h is not None for h in g.handles):
                keep = {slot for i, slot in zip(g.pages, g.slots, strict=True) if not isinstance(out[i], PageError)}
                self._reader.staging.give([s for s in g.slots if s not in keep])
                g.slots = []
        return out

    # ---- posting and waiting -------------------------------------------------------------------

    def _start(self, g: _Group) -> None:
        r = self._reader
        try:
            g.peer = r.connections.acquire(g.node, g.meta, time.monotonic() + r.timeout_s)
        except FabricError as e:
            self._fail_pages(g, e)
            return
        prepared = g.peer.dlists.get(g.medium)
        if prepared is None:
            self._fail_pages(g, PageError("unreachable", f"{g.node} publishes no readable {g.medium} region"))
            self._end(g)
            return
        num_slots = prepared[1]
        wanted = []
        for i in g.pages:
            if 0 <= self.sources[i].slot < num_slots:
                wanted.append(i)
            else:
                self._out[i] = PageError("bad_location", f"slot {self.sources[i].slot} outside {g.node}'s {g.medium}")
        slots = r.staging.take(len(wanted))
        for i in wanted[len(slots):]:
            self._out[i] = PageError("no_staging", f"fabric.staging_size holds {r.staging.num_slots} pages")
        g.pages, g.slots = wanted[:len(slots)], slots
        if not g.pages:
            self._end(g)
            return
        for i in g.pages:
            self._group_of[i] = g
        g.over = False
        g.handles = [None] * (len(self._parts) + 1)
        for c in range(min(PARTS_AHEAD, len(self._parts))):
            if not self._post_part(g, c):
                return

    def _post_part(self, g: _Group, c: int) -> bool:
        """Post part ``c`` of ``g``; False when that failed (``g`` is aborted)."""
        r, n = self._reader, len(self._parts)
        assert g.peer is not None
        dlist, num_slots = g.peer.dlists[g.medium]
        local = np.array(g.slots, dtype=np.int64) + span_base(c, r.staging.num_slots, n)
        remote = np.array([self.sources[i].slot for i in g.pages], dtype=np.int64) + span_base(c, num_slots, n)
        try:
            g.handles[c] = r.agent.post_read(r.staging.dlist, local, dlist, remote)
        except FabricError as e:
            self._abort(g, e, posting=True)
            return False
        # Each request gets the whole timeout from its post: the next part is posted only when a
        # caller waits, so a slow consumer (the engine computing layers) must not eat the peer's time.
        g.deadline = time.monotonic() + r.timeout_s
        return True

    def _wait(self, g: _Group, level: int) -> None:
        """Advance ``g`` until ``level`` stages are validated, it failed, or the deadline passed."""
        while not g.over and g.level < level:
            self._progress(g)
            if g.over or g.level >= level:
                return
            for other in self._groups:          # keep the others moving (e.g. post their generation READ)
                if other is not g and not other.over:
                    self._progress(other)
            if time.monotonic() > g.deadline:
                self._abort(g, FabricError("timeout", f"{g.node} did not answer in {self._reader.timeout_s}s"))
                return
            time.sleep(POLL_S)

    def _progress(self, g: _Group) -> None:
        """Validate every stage of ``g`` that completed, in order, without waiting."""
        r, n = self._reader, len(self._parts)
        while not g.over:
            handle = g.handles[g.level]
            if handle is None:               # not posted, as every page had failed; nothing is in flight
                self._reader.staging.give(g.slots)
                g.slots = []
                self._end(g)
                return
            try:
                if not r.agent.done(handle):
                    return
            except FabricError as e:
                self._abort(g, e)
                return
            r.agent.release(handle)
            g.handles[g.level] = None
            if g.level < n:
                # Post the next request before the segment checksums of this part (1-2 ms), so
                # they overlap the wire; the headers (microseconds) first, so a load whose slots
                # were all reused reads no more. After the last part comes the generation
                # re-read, which needs every part done (they are: stages complete in order).
                if g.level == 0:
                    self._check_headers(g)
                if not self._all_failed(g):
                    nxt = g.level + PARTS_AHEAD
                    if nxt < n and not self._post_part(g, nxt):
                        return
                    if g.level == n - 1 and not self._post_generation(g):
                        return
                self._check_part(g, g.level)
                if self._all_failed(g) and not any(h is not None for h in g.handles):
                    # Every page failed (e.g. all slots reused): the rest is not worth reading.
                    self._reader.staging.give(g.slots)
                    g.slots = []
                    self._end(g)
                    return
            else:
                self._check_generation(g)
            g.level += 1
            if g.level > n:
                self._end(g)

    def _all_failed(self, g: _Group) -> bool:
        return all(isinstance(self._out[i], PageError) for i in g.pages)

    def _post_generation(self, g: _Group) -> bool:
        """Post the re-read of ``g``'s live generation words; False when that failed (``g`` is aborted)."""
        r = self._reader
        assert g.peer is not None
        dlist, num_slots = g.peer.dlists[g.medium]
        for s in g.slots:
            r.staging.clear_generation(s)
        local = np.array(g.slots, dtype=np.int64) + r.staging.num_slots
        remote = np.array([self.sources[i].slot for i in g.pages], dtype=np.int64) + num_slots
        try:
            g.handles[len(self._parts)] = r.agent.post_read(r.staging.dlist, local, dlist, remote)
        except FabricError as e:
            self._abort(g, e, posting=True)
            return False
        g.deadline = time.monotonic() + r.timeout_s
        return True

    def _check_headers(self, g: _Group) -> None:
        """With part 0 in: each page's header (magic, geometry, key, generation, header checksum)."""
        r = self._reader
        spec = r.spec
        staged = StagedPage(r.staging, spec, f"remote:{g.medium}")
        for i, slot in zip(g.pages, g.slots, strict=True):
            if isinstance(self._out[i], PageError):
                continue
            try:
                header = PageHeader.parse(r.staging.page(slot)[:spec.header_bytes])
                header.expect(spec, self.keys[i], self.sources[i].generation)
            except PageError as e:
                self._out[i] = e
                continue
            self._out[i] = (staged, SlotRef(slot, self.sources[i].generation), header)

    def _check_part(self, g: _Group, c: int) -> None:
        """The segment checksums of part ``c``'s layers, against the headers checked with part 0."""
        r = self._reader
        spec = r.spec
        for i, slot in zip(g.pages, g.slots, strict=True):
            got = self._out[i]
            if got is None or isinstance(got, PageError):
                continue
            page = r.staging.page(slot)
            try:
                for layer in self._parts[c]:
                    verify_segment(spec, got[2], layer, spec.segment(page, layer))      # under the header's seed
            except PageError as e:
                self._out[i] = e

    def _check_generation(self, g: _Group) -> None:
        staging = self._reader.staging
        for i, slot in zip(g.pages, g.slots, strict=True):
            live = staging.generation(slot)
            if not isinstance(self._out[i], PageError) and live != self.sources[i].generation:
                self._out[i] = PageError("stale_generation", f"{g.node}'s {g.medium} slot {self.sources[i].slot} "
                                                             f"was rewritten during the read (generation now {live})")

    # ---- failure and clean-up ------------------------------------------------------------------

    def _abort(self, g: _Group, err: FabricError, *, posting: bool = False) -> None:
        """Give up on ``g``: every page of it fails with ``err``'s reason, even those whose first
        layers were returned already (the caller has them recomputed). ``posting``: a post
        failed, so whether it reached the peer is unknown."""
        r = self._reader
        in_flight = posting or any(h is not None for h in g.handles)
        for h in g.handles:
            r.agent.release(h)
        g.handles = []
        if err.disconnected:
            # The connection is dead for good (it never recovers, research notes §4), so nothing
            # can land in the staging slots any more: reuse them, reconnect later.
            r.staging.give(g.slots)
            r.connections.back_off(g.node, RECONNECT_AFTER_ERROR_S, drop=True)
        else:
            if in_flight:       # cancelled in flight: the peer's data may still arrive into these slots
                r.staging.quarantine(g.slots)
            else:
                r.staging.give(g.slots)
            if err.reason == "aborted":
                pass                # the caller gave up, not the peer
            elif err.reason == "timeout":
                # A stalled peer may recover on the same connection; leave it alone for a while.
                r.connections.back_off(g.node, SUSPECT_AFTER_TIMEOUT_S, drop=False)
            else:
                # e.g. stale metadata: fetch it again
                r.connections.back_off(g.node, RECONNECT_AFTER_ERROR_S, drop=True)
        g.slots = []
        log.warning("pof fabric: %d page(s) from %s failed: %s", len(g.pages), g.node, err)
        self._fail_pages(g, err, replace=True)
        self._end(g)

    def _fail_pages(self, g: _Group, err: FabricError | PageError, *, replace: bool = False) -> None:
        page_err = err if isinstance(err, PageError) else PageError(err.reason, f"{g.node}: {err.detail}")
        for i in g.pages:
            if self._out[i] is None or (replace and not isinstance(self._out[i], PageError)):
                self._out[i] = page_err

    def _end(self, g: _Group) -> None:
        """``g`` needs its peer no more (complete or failed)."""
        g.over = True
        if g.peer is not None:
            self._reader.connections.release(g.peer)
            g.peer = None

    def close(self) -> None:
        """Cancel what is still in flight (its pages fail) and give back the staging slots this
        load still owns. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for g in self._groups:
            if not g.over:
                self._abort(g, FabricError("aborted", "the load was closed before its pages arrived"))
            self._reader.staging.give(g.slots)
            g.slots = []
