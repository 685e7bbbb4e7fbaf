"""Zero-copy, layer-by-layer reads of pages that this process maps (its own tiers, a shared CXL
region), driven by the caller's thread.

An engine adapter copies each layer straight from tier memory into its KV blocks, converting the
layout on the way, so a page is copied once instead of twice (tier → staging → engine) and no
I/O thread competes with the forward pass for cores. Safety is the same as for a staged read:

1. :meth:`Pool.open_read <pof_connector.pool.Pool.open_read>` copies and checks every page header
   (key, generation, geometry) and pins this node's slots;
2. :meth:`PageReader.segment` gives layer ``l`` of page ``i``: in place, or (a source the host
   cannot address, such as a GPU region) copied into a buffer of that page's own; the caller
   copies it to where the engine reads it;
3. :meth:`PageReader.check` then takes the checksum of **the bytes where they landed** (computed
   by the caller, in the same pass as its copy where it can) and verifies it against the header,
   and that the slot's live generation did not change (a writer zeroes it before touching any
   byte). Nothing is ever re-read from the source to be checked. A page that fails is reported
   in :attr:`failed`; the caller must have the engine recompute it — the bytes it copied are not
   to be used.

Pages of another node's tier that no shared region connects (fabric enabled) are fetched in one
batch into pof's staging memory, layer 0 first (:mod:`pof_connector.fabric.remote_reader`); the
caller reads them through the same calls, and :meth:`PageReader.segment` waits only until that
layer arrived and was validated. Such a page can still fail at a later layer (or at the final
generation re-check), after earlier layers were copied: it then lands in :attr:`failed` like a
local page whose later check fails, and the engine recomputes it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from pof_connector.index import Location
from pof_connector.metrics import PoolStats
from pof_connector.pages import page_sum
from pof_connector.pages.keys import PageKey
from pof_connector.pages.layout import PageError, PageHeader, PageSpec, as_array
from pof_connector.tiers import SlotRef, Tier

if TYPE_CHECKING:
    from pof_connector.fabric.remote_reader import RemoteLoad

log = logging.getLogger("pof_connector.page_reader")     # its name before the move to pool/: filters keep working


class SlotSource(Protocol):
    """Where a page's bytes are read from: a :class:`~pof_connector.tiers.Tier`, or a remote page
    already staged locally (:class:`pof_connector.fabric.remote_reader.StagedPage`)."""

    @property
    def medium(self) -> str: ...

    @property
    def in_place(self) -> bool:
        """Whether :meth:`segment_view` hands out the source's own (host) memory; else it copies
        into the caller's ``into``, from memory the host cannot address (a GPU region)."""
        ...

    def segment_view(self, ref: SlotRef, layer: int, into: np.ndarray | None = None) -> np.ndarray: ...

    def host_buffer(self, nbytes: int) -> np.ndarray:
        """Host memory for ``into`` (pinned where the source copies from a GPU)."""
        ...

    def device_view(self, ref: SlotRef, layer: int, device: Any) -> Any | None:
        """Layer ``layer`` of the page at ``ref`` as a tensor a copy to ``device`` (a torch
        device) reads straight from (a GPU region to a GPU: device to device); ``None``: take
        :meth:`segment_view`. Trusted, like any segment, only after :meth:`check_segment`."""
        ...

    def check_segment(self, ref: SlotRef, header: PageHeader, layer: int, landed: int) -> None:
        """Raise :class:`PageError` unless ``landed`` (the checksum of the bytes the caller copied,
        where they landed) is the header's for ``layer`` and the slot was not rewritten meanwhile."""
        ...

    def unpin(self, slot: int) -> None: ...


class PageSource(Protocol):
    """What a :class:`PageReader` reads through (the pool's :class:`~pof_connector.pool.reads.Reads`)."""

    @property
    def spec(self) -> PageSpec: ...

    @property
    def stats(self) -> PoolStats: ...

    def fetch_remote(self, keys: list[PageKey], sources: list[Location]) -> tuple[RemoteLoad | None, dict[int, int]]:
        """Start fetching the pages only the fabric reaches: the load in flight (``None``: no such
        page) and, per such page index, its position in that load."""
        ...

    def resolve(self, key: PageKey, src: Location) -> tuple[Tier, SlotRef, bool]:
        """The tier and slot to read ``key`` from, and whether the slot was pinned (unpin it after);
        raises ``PageError`` when this node cannot read it."""
        ...

    def count_load_failure(self, err: PageError) -> None: ...

    def drop_if_corrupt(self, key: PageKey, src: Location, err: PageError, ref: SlotRef, own: bool) -> None:
        """Forget a page of this node that failed its checksums (``ref``: the slot read; ``own``: pinned)."""
        ...


class PageReader:
    def __init__(self, source: PageSource, keys: list[PageKey], sources: list[Location],
                 headers: list[np.ndarray] | None = None) -> None:
        """``headers[i]``, when given, receives page ``i``'s header (else a scratch buffer does)."""
        self._source = source
        self.keys = keys
        self.sources = sources
        self.failed: dict[int, str] = {}
        self._pages: list[tuple[SlotSource, SlotRef, PageHeader, bool] | None] = []
        self._headers = headers
        self._scratch: np.ndarray | None = None     # [pages, segment_bytes]: segments of sources not in place
        self._started = time.perf_counter()
        scratch = np.empty(source.spec.header_bytes, dtype=np.uint8)
        # Remote pages: posted now, resolved on first use (segment); the load owns their staging.
        self._remote: RemoteLoad | None = None
        self._remote_at: dict[int, int] = {}
        self._remote, self._remote_at = source.fetch_remote(keys, sources)
        for i, (key, src) in enumerate(zip(keys, sources, strict=True)):
            header_buf = headers[i] if headers is not None else scratch
            if i in self._remote_at:
                self._pages.append(None)
                continue
            try:
                tier, ref, pinned = source.resolve(key, src)
            except PageError as e:
                self._fail(i, e)
                self._pages.append(None)
                continue
            try:
                header = tier.read_header(ref, key, header_buf)
            except PageError as e:
                self._fail(i, e, (ref, pinned))      # still pinned: a dropped page's slot waits for us
                if pinned:
                    tier.unpin(ref.slot)
                self._pages.append(None)
                continue
            self._pages.append((tier, ref, header, pinned))

    def segment(self, page: int, layer: int) -> np.ndarray | None:
        """Layer ``layer`` of page ``page`` in tier memory; ``None`` when the page failed. For a
        remote page this waits until that layer arrived (up to ``fabric.timeout_s`` from the start)."""
        if page in self.failed:
            return None
        if page in self._remote_at and not self._resolve_remote(page, layer):
            return None
        entry = self._pages[page]
        if entry is None:
            return None
        tier, ref, _, _ = entry
        if tier.in_place:
            return tier.segment_view(ref, layer)
        # Each page gets its own buffer: a source's per-thread scratch would be refilled by the next
        # page's call while the caller still holds this one (a layer's segments are taken at once).
        return tier.segment_view(ref, layer, into=self._scratch_row(tier, page))

    def _scratch_row(self, tier: SlotSource, page: int) -> np.ndarray:
        seg = self._source.spec.segment_bytes
        if self._scratch is None:
            self._scratch = tier.host_buffer(len(self._pages) * seg).reshape(len(self._pages), seg)
        row: np.ndarray = self._scratch[page]
        return row

    def segments(self, layer: int, device: Any = None) -> list[tuple[int, Any]]:
        """``(page, segment)`` of every page not failed: :meth:`segment` for a whole layer at once
        (a step's load reads hundreds of segments; this spares a call per segment). The segments
        never share memory: each stays valid until this layer's :meth:`check_all`. ``device``:
        the torch device the caller copies them to; a source that a copy there reads directly (a
        GPU region, see :meth:`SlotSource.device_view`) gives a tensor instead of host bytes."""
        out: list[tuple[int, Any]] = []
        failed, remote = self.failed, self._remote_at
        for i, entry in enumerate(self._pages):
            if i in failed:
                continue
            if device is not None and entry is not None and i not in remote:
                view = entry[0].device_view(entry[1], layer, device)
                if view is not None:
                    out.append((i, view))
                    continue
            if i in remote or (entry is not None and not entry[0].in_place):
                seg = self.segment(i, layer)
                if seg is not None:
                    out.append((i, seg))
            elif entry is not None:
                out.append((i, entry[0].segment_view(entry[1], layer)))
        return out

    def span(self, page: int, first: int, count: int) -> np.ndarray | None:
        """Layers ``first .. first + count - 1`` of page ``page`` as one contiguous view of the
        source's memory (one copy instead of ``count``), when the page is this node's to read in
        place and already whole (not a remote page still arriving, not a copied-out source);
        ``None`` otherwise: take :meth:`segment` layer by layer. Checked like any segment."""
        entry = self._pages[page] if 0 <= page < len(self._pages) else None
        if entry is None or page in self.failed or page in self._remote_at or not entry[0].in_place:
            return None
        seg = self._source.spec.segment_bytes
        head = entry[0].segment_view(entry[1], first)
        tail = entry[0].segment_view(entry[1], first + count - 1)
        if tail.ctypes.data != head.ctypes.data + (count - 1) * seg or not head.flags.c_contiguous:
            return None
        # Both ends lie in the one mapped slot, and the page format puts layer l + 1 right after l.
        view: np.ndarray = np.lib.stride_tricks.as_strided(head, shape=(count * seg,), strides=(1,))
        return view

    def refilled(self, page: int) -> bool:
        """Whether :meth:`segment` gives page ``page``'s layers in a buffer of this reader's that
        the next layer's call refills (a source the host cannot address, copied out): a copy from
        it must have read it by then, not merely been queued."""
        entry = self._pages[page] if 0 <= page < len(self._pages) else None
        return entry is not None and not entry[0].in_place

    def check_all(self, layer: int, landed: Sequence[tuple[int, int]]) -> None:
        """:meth:`check` of each ``(page, checksum)`` (a whole layer at once, after a fused copy):
        pages that fail land in :attr:`failed`."""
        pages, failed = self._pages, self.failed
        for page, got in landed:
            entry = pages[page]
            if entry is None or page in failed:
                continue
            tier, ref, header, pinned = entry
            try:
                tier.check_segment(ref, header, layer, got)
            except PageError as e:
                self._fail(page, e, (ref, pinned))

    def expected_sum(self, page: int, layer: int) -> int:
        """The checksum page ``page``'s checked header gives layer ``layer`` (what a copy must sum
        to, under :meth:`sum_seed`). Only for a page :meth:`segment` gave a segment of."""
        entry = self._pages[page]
        if entry is None:
            raise ValueError(f"page {page} has no checked header (it failed, or no segment of it was read yet)")
        return int(entry[2].segment_checksums[layer])

    def sum_seed(self, page: int) -> int:
        """The checksum seed of page ``page``'s checked header: what a copy of its segments sums
        under (for :meth:`check`). Only for a page :meth:`segment` gave a segment of."""
        entry = self._pages[page]
        if entry is None:
            raise ValueError(f"page {page} has no checked header (it failed, or no segment of it was read yet)")
        return entry[2].sum_seed

    def check(self, page: int, layer: int, landed: int) -> bool:
        """After copying :meth:`segment` to where the engine reads it: were those bytes the page's?
        ``landed``: the checksum of the bytes where they landed (:func:`landed_sum`, or the one a
        fused copy computed as it stored them). Also checks that the slot was not rewritten."""
        self.check_all(layer, [(page, landed)])
        return self._pages[page] is not None and page not in self.failed

    def copy_into(self, page: int, layer: int, dst: object) -> bool:
        """Copy layer ``layer`` of page ``page`` into ``dst`` (writable host memory of
        ``segment_bytes``: a numpy array, a contiguous CPU tensor) and check the copy, summed in
        the same pass. False: the page failed (it is in :attr:`failed`; ``dst`` is garbage)."""
        seg = self.segment(page, layer)
        if seg is None:
            return False
        (landed,) = page_sum.copy_checksums(as_array(dst), seg, len(seg), self.sum_seed(page))
        return self.check(page, layer, landed)

    def landed_sum(self, page: int, landed: np.ndarray) -> int:
        """The checksum of a segment of page ``page`` as it landed (host bytes, canonical order),
        for :meth:`check`."""
        return page_sum.checksum(landed, self.sum_seed(page))

    def _resolve_remote(self, page: int, layer: int) -> bool:
        """Wait for ``layer`` of remote page ``page``; False when the page failed (by now)."""
        assert self._remote is not None
        got = self._remote.get(self._remote_at[page], layer)
        if isinstance(got, PageError):
            self._fail(page, got)
            return False
        if self._pages[page] is None:
            staged, ref, header = got
            if self._headers is not None:
                np.copyto(self._headers[page], staged.header(ref))
            self._pages[page] = (staged, ref, header, False)     # not pinned: the remote load owns its staging
        return True

    def _fail(self, page: int, err: PageError, read: tuple[SlotRef, bool] | None = None) -> None:
        """``read``: the slot of this node's tier the failed read copied from, and whether that
        was one of our own pages (pinned); ``None`` when no tier of this node was read."""
        if page in self.failed:
            return
        self.failed[page] = err.reason
        self._source.count_load_failure(err)
        if read is not None:
            self._source.drop_if_corrupt(self.keys[page], self.sources[page], err, *read)

    def close(self) -> None:
        """Unpin and count. Idempotent. A remote page whose every layer was not read and
        validated (the caller stopped early) counts as failed."""
        spec = self._source.spec
        if self._remote is not None:
            for i, pos in self._remote_at.items():
                if i not in self.failed and not self._remote.complete(pos):
                    self._fail(i, PageError("aborted", "closed before all its layers were read"))
            self._remote.close()      # cancels what is still in flight, frees the staging
            self._remote = None
        loaded: dict[str, int] = {}
        for i, entry in enumerate(self._pages):
            if entry is None:
                continue
            tier, ref, _, pinned = entry
            if pinned:
                tier.unpin(ref.slot)
            if i not in self.failed:
                loaded[tier.medium] = loaded.get(tier.medium, 0) + 1
        for medium, n in loaded.items():
            self._source.stats.add("loaded_pages", n, tier=medium)
            self._source.stats.add("loaded_bytes", n * spec.page_bytes, tier=medium)
        self._pages = [None] * len(self._pages)
        self._source.stats.add("load_seconds", time.perf_counter() - self._started)
