"""The Tier contract: one medium of fixed-size page slots.

A tier owns a byte region split into slots of ``slot_bytes`` and a table of per-slot
generations. It writes and reads pages with a seqlock-like protocol that lets readers in other
processes (a shared CXL region) or on other hosts (a NIXL READ of the same bytes) detect a slot
that was reused under them:

* writer: bump the slot's generation in the table, zero the generation field of the slot's page
  header, write the segments, write the header (which carries the new generation) last;
* reader: copy the header and check magic, key, generation and header checksum; copy each
  segment (:meth:`Tier.segment_view`) to where it is used, then check the checksum of the copy and
  re-read the live generation field (:meth:`Tier.check_segment`): if it changed, the copy may be
  torn and the page is rejected.

The protocol uses plain ``numpy`` loads and stores, no fences: it relies on x86's total store
order (stores and loads each stay in program order). Tiers therefore refuse to start on other
CPUs (ARM, POWER), where a reader could see the new generation before the new bytes; see
:mod:`pof_connector.tiers.ordering`.

Books (which key is where, LRU, pins) are kept by a :class:`SlotTable` for the slots this
process may write; reads may target any slot of the region.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import numpy as np

from pof_connector.config.tenant_config import DEFAULT_TENANT
from pof_connector.pages import page_sum
from pof_connector.pages.keys import PageKey
from pof_connector.pages.layout import (
    GENERATION_AT,
    PageError,
    PageHeader,
    PageSpec,
    as_array,
    encode_header,
    expect_checksums,
    header_template,
)
from pof_connector.tiers.ordering import require_store_order
from pof_connector.tiers.slot_table import SlotTable

SLOT_ALIGN = 64


def slot_bytes_for(spec: PageSpec) -> int:
    return (spec.page_bytes + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


class SlotRef(NamedTuple):
    """Where a page sits in a tier: its slot and the generation it was written with. (Immutable; a
    NamedTuple because every store and load builds one, and a frozen dataclass costs several
    times more to construct.)"""

    slot: int
    generation: int


class Tier(ABC):
    """A medium of page slots. Subclasses provide the region; this class moves the bytes."""

    medium: ClassVar[str]

    def __init__(self, spec: PageSpec, region: np.ndarray, generations: np.ndarray,
                 slot_bytes: int, own_slots: Sequence[int]) -> None:
        require_store_order()
        if slot_bytes < spec.page_bytes:
            raise ValueError(f"{self.medium}: slot of {slot_bytes} bytes cannot hold a {spec.page_bytes}-byte page")
        self.spec = spec
        self.slot_bytes = slot_bytes
        self.num_slots = len(generations)
        self._region = region
        self._generations = generations
        # Per-call overhead matters at 64 KiB pages: a memoryview copies header bytes, a uint64 view
        # of the region reads and writes a slot's generation word, without building slices.
        self._bytes: memoryview | None = memoryview(region) if isinstance(region, np.ndarray) else None  # type: ignore[arg-type]
        self._words: np.ndarray | None = (region.view(np.uint64) if isinstance(region, np.ndarray)
                                          and len(region) % 8 == 0 else None)
        # [slot, layer] -> that segment, in place: a load reads one per page and layer (hundreds
        # per step), so one indexing instead of two slices and an offset computed each time.
        self._segments: np.ndarray | None = None
        if isinstance(region, np.ndarray) and region.ndim == 1 and len(region) >= self.num_slots * slot_bytes > 0:
            self._segments = np.lib.stride_tricks.as_strided(
                region[spec.header_bytes:], shape=(self.num_slots, spec.num_layers, spec.segment_bytes),
                strides=(slot_bytes, spec.segment_bytes, 1))
        self._books = SlotTable(own_slots)
        self._gen_lock = threading.Lock()
        self._template = header_template(spec)     # what the native whole-page store and load fill in
        # One seed per tier, stamped in each page it writes: a reader sums under the page's own
        # seed (from its header), so pages of tiers with other seeds read the same way.
        self.sum_seed = page_sum.new_seed()

    # ---- books -----------------------------------------------------------------------------

    @property
    def capacity_slots(self) -> int:
        """Slots this process may write."""
        return self._books.capacity

    @property
    def used_slots(self) -> int:
        return self._books.used

    @property
    def free_slots(self) -> int:
        return self.capacity_slots - self.used_slots

    def find(self, key: PageKey, *, pin: bool = False, touch: bool = True) -> SlotRef | None:
        """Where this process stored ``key``; ``None`` when it did not (or evicted it).

        With ``pin`` the slot stays put until :meth:`unpin`; a local reader uses that.
        """
        slot = self._books.lookup(key, pin=pin, touch=touch)
        return None if slot is None else SlotRef(slot, self._generations.item(slot))

    def contains(self, key: PageKey) -> bool:
        return self._books.contains(key)

    def can_allocate(self, tenant: str = DEFAULT_TENANT) -> bool:
        return self._books.can_allocate(tenant)

    def needs_room(self, tenant: str = DEFAULT_TENANT) -> bool:
        """Whether a store for ``tenant`` must evict a page first (no free slot, or it is at its quota)."""
        return self._books.needs_room(tenant)

    # ---- tenants -----------------------------------------------------------------------------

    def set_quotas(self, quotas: Mapping[str, int]) -> None:
        """Tenant -> bytes its pages may take here (whole slots: a quota is rounded down to them)."""
        self._books.set_quotas({t: q // self.slot_bytes for t, q in quotas.items()})

    def set_keep(self, keep: Callable[[PageKey], int] | None) -> None:
        """What prefix pins ask of each page on eviction (see :meth:`SlotTable.set_keep`)."""
        self._books.set_keep(keep)

    def tenant_use(self) -> dict[str, tuple[int, int | None]]:
        """Tenant -> (bytes used, quota in bytes or ``None``), for tenants with pages or a quota."""
        use, quotas = self._books.tenant_use(), self._books.quotas()
        return {t: (use.get(t, 0) * self.slot_bytes, None if t not in quotas else quotas[t] * self.slot_bytes)
                for t in sorted(set(use) | set(quotas))}

    def page_tenant(self, key: PageKey) -> str:
        """The tenant of a page stored here."""
        return self._books.owner(key)

    def prepare_store(self, key: PageKey, tenant: str = DEFAULT_TENANT) -> tuple[SlotRef, PageKey | None] | None:
        """Reserve and invalidate a slot for ``key``, a page of ``tenant``; returns its ref and the
        evicted key.

        ``None`` means nothing to do: ``key`` is stored or in flight, or no slot can be freed for it.
        """
        got = self._books.prepare_store(key, tenant)
        if got is None:
            return None
        slot, evicted = got
        with self._gen_lock:
            generation = self._generations.item(slot) + 1     # item(): a Python int, no numpy scalar
            self._generations[slot] = generation
        self._set_live_generation(slot, 0)
        if evicted is not None:
            self.evicted(self._books.evicted_age)
        return SlotRef(slot, generation), evicted

    def evicted(self, unused_for: float | None) -> None:
        """A store evicted a page that had gone unused for ``unused_for`` s (``None``: unknown).
        A tier whose writers trade slots tells the others here that it is short of room."""

    # ---- slots changing hands (a shared region's writers trading memory) ---------------------

    @property
    def trades(self) -> bool:
        """Whether this tier's writers trade slots (:mod:`pof_connector.tiers.cxl`); here: no."""
        return False

    def balance(self, now: float | None = None) -> tuple[int, int, list[tuple[PageKey, SlotRef]]]:
        """Give slots to another writer shorter of room: (its partition or -1, slots given, pages
        dropped for them). A tier that does not trade gives none."""
        return -1, 0, []

    def adopt_given(self) -> int:
        """Take in the slots other writers gave this one; returns how many (here: none)."""
        return 0

    def unused_for(self, key: PageKey, now: float) -> float | None:
        """How long the page of ``key`` stored here has gone unused (s); ``None``: not stored."""
        return self._books.unused_for(key, now)

    def coldest_age(self, now: float) -> float | None:
        """How long the page a store would evict next has gone unused (s); ``inf``: a slot is
        free; ``None``: no page may be evicted."""
        return self._books.coldest_age(now)

    def give_slots(self, n: int, unused_for: float, now: float
                   ) -> tuple[list[int], list[tuple[PageKey, SlotRef]]]:
        """Take up to ``n`` slots out of this process's books for good (free ones first, then
        those of pages unused for ``unused_for`` s, see :meth:`SlotTable.give`), each invalidated
        (generation bumped, live generation zeroed) before this returns, so no reader accepts what
        was in it and the next writer stamps a newer generation. Returns the slots and where each
        dropped page was (the caller withdraws them from the index)."""
        slots, dropped = self._books.give(n, unused_for, now)
        before = {slot: self._bump(slot) - 1 for slot in slots}
        return slots, [(key, SlotRef(slot, before[slot])) for key, slot in dropped]

    def adopt_slots(self, slots: Sequence[int]) -> int:
        """Take ``slots`` (invalidated by the writer that gave them) into this process's books as
        free slots; returns how many."""
        return self._books.adopt(slots)

    def complete_store(self, key: PageKey, ok: bool) -> None:
        self._books.complete_store(key, ok)

    def cancel_store(self, key: PageKey) -> bool:
        """Give up a store that was prepared (and maybe written) but not completed: the slot is
        invalidated first (its page, whole or not, is never read), then freed. ``False`` when no
        store of ``key`` is in flight."""
        slot = self._books.pending_slot(key)
        if slot is None:
            return False
        self._set_live_generation(slot, 0)
        self._books.complete_store(key, False)
        return True

    def remove(self, key: PageKey, *, slot: int | None = None) -> SlotRef | None:
        """Drop ``key`` (only if it sits in ``slot``, when given) and invalidate its slot; returns
        where it was, ``None`` when it was not there. A slot that readers pin keeps its bytes
        until the last :meth:`unpin` (hidden from :meth:`find` meanwhile)."""
        got = self._books.detach(key, slot)
        if got is None:
            return None
        at, pinned = got
        generation = int(self._generations[at])
        if not pinned:
            self._invalidate_and_free(at)
        return SlotRef(at, generation)

    def evict(self, key: PageKey) -> SlotRef | None:
        """:meth:`remove` ``key`` to make room for another page, and tell :meth:`evicted` how
        long it had gone unused (a tier whose writers trade slots asks for more here)."""
        unused_for = self._books.unused_for(key, time.monotonic())
        removed = self.remove(key)
        if removed is not None:
            self.evicted(unused_for)
        return removed

    def _invalidate_and_free(self, slot: int) -> None:
        # Invalidate before freeing: once free, our own store may take the slot at once, and a
        # zeroing after that would destroy its fresh page.
        self._set_live_generation(slot, 0)
        self._books.release(slot)

    @property
    def lent_slots(self) -> int:
        """Slots granted to other nodes' writers (fabric spill)."""
        return self._books.lent

    def lend(self, n: int) -> list[SlotRef]:
        """Grant up to ``n`` free slots to a writer on another node: each slot's generation is
        bumped and its live generation zeroed first, so the writer stamps the page with the
        returned generation (header last) and no reader accepts what was there before."""
        return [SlotRef(slot, self._bump(slot)) for slot in self._books.lend(n)]

    def _bump(self, slot: int) -> int:
        """Bump ``slot``'s generation and zero its live one (no reader accepts what is there);
        returns the new generation, which the slot's next page is stamped with."""
        with self._gen_lock:
            generation = int(self._generations[slot]) + 1
            self._generations[slot] = generation
        self._set_live_generation(slot, 0)
        return generation

    def is_lent(self, slot: int) -> bool:
        """Whether ``slot`` is granted to another node's writer now (its page is not in our books)."""
        return self._books.is_lent(slot)

    def take_back(self, slot: int) -> bool:
        """Reclaim a lent slot: invalidate it (readers of the page in it miss from now on) and
        free it. ``False`` when ``slot`` was not lent."""
        if not self._books.is_lent(slot):
            return False
        # Invalidate before freeing: once free, our own store may take the slot at once.
        self._bump(slot)
        return self._books.take_back(slot)

    def lru_victim(self, tenant: str = DEFAULT_TENANT) -> tuple[PageKey, SlotRef] | None:
        """The page a store for ``tenant`` would evict next (left in place); ``None`` when it may
        evict none."""
        got = self._books.victim(tenant)
        if got is None:
            return None
        key, slot = got
        return key, SlotRef(slot, int(self._generations[slot]))

    def pin(self, slot: int) -> None:
        self._books.pin(slot)

    def unpin(self, slot: int) -> None:
        if self._books.unpin(slot):      # the last reader of a removed page: now it goes
            self._invalidate_and_free(slot)

    def stored(self) -> Iterator[tuple[PageKey, SlotRef]]:
        """Every page this process stored here (for re-publishing after an index restart)."""
        for key, slot in self._books.items():
            yield key, SlotRef(slot, int(self._generations[slot]))

    # ---- bytes -----------------------------------------------------------------------------

    def slot_offset(self, slot: int) -> int:
        """Byte offset of ``slot`` inside :attr:`region` (a remote reader's descriptor)."""
        return slot * self.slot_bytes

    @property
    def region(self) -> np.ndarray:
        """The whole slot region, for registration with a NIXL agent."""
        return self._region

    def _slot(self, slot: int) -> np.ndarray:
        start = slot * self.slot_bytes
        return self._region[start:start + self.spec.page_bytes]

    def _set_live_generation(self, slot: int, generation: int) -> None:
        start = slot * self.slot_bytes + GENERATION_AT
        if self._words is not None:              # slot_bytes and GENERATION_AT are multiples of 8
            self._words[start >> 3] = generation
            return
        self._region[start:start + 8].view(np.uint64)[0] = generation

    def live_generation(self, slot: int) -> int:
        start = slot * self.slot_bytes + GENERATION_AT
        if self._words is not None:
            live: int = self._words.item(start >> 3)
            return live
        return int(self._region[start:start + 8].view(np.uint64)[0])

    def write(self, ref: SlotRef, key: PageKey, layers: Sequence[Any]) -> None:
        """Write a page from per-layer segments (canonical layout) into a prepared slot."""
        spec = self.spec
        if len(layers) != spec.num_layers:
            raise ValueError(f"{len(layers)} layer segments for {spec.num_layers} layers")
        # The whole page in one native call: segments copied and summed, header, generation last.
        def store(segments: Sequence[Any]) -> bool:
            return page_sum.store_page(self._region, ref.slot * self.slot_bytes, self._template, key.namespace,
                                       key.digest, ref.generation, self.sum_seed, segments, True)

        try:        # numpy segments as they are (the kernel takes their bytes): no wrapping
            stored = store(layers)
        except (TypeError, BufferError):      # no buffer protocol (torch tensors): wrap them
            stored = store([as_array(layer) for layer in layers])
        if stored:
            return
        # No native kernel: numpy copies, sums and header (same bytes, several times slower).
        body = self._slot(ref.slot)[spec.header_bytes:]
        sums = page_sum.gather_checksums(body, [as_array(layer) for layer in layers], self.sum_seed, True)
        self._write_header_at(ref.slot, encode_header(spec, key, ref.generation, sums, self.sum_seed))

    def write_page(self, ref: SlotRef, page: Any) -> None:
        """Write an already packed and verified page, re-stamped with ``ref.generation``: it keeps
        its own checksum seed and segment checksums (its bytes are not summed again)."""
        spec = self.spec
        src = as_array(page)
        header = PageHeader.parse(src[:spec.header_bytes])
        dst = self._slot(ref.slot)
        np.copyto(dst[spec.header_bytes:], src[spec.header_bytes:spec.page_bytes])
        self._write_header_at(ref.slot, encode_header(spec, header.key, ref.generation,
                                                      header.segment_checksums, header.sum_seed))

    def _write_header_at(self, slot: int, header: bytes) -> None:
        """:meth:`_write_header` into ``slot``: one copy of the header with a zero generation, then
        the generation word (plain stores in program order: see the module docstring)."""
        if self._bytes is None or self._words is None:
            self._write_header(self._slot(slot), header)
            return
        start = slot * self.slot_bytes
        self._bytes[start:start + len(header)] = header[:GENERATION_AT] + bytes(8) + header[GENERATION_AT + 8:]
        self._words[(start + GENERATION_AT) >> 3] = int.from_bytes(header[GENERATION_AT:GENERATION_AT + 8], "little")

    def _write_header(self, dst: np.ndarray, header: bytes) -> None:
        # The generation field goes last: until it is stored, readers see generation 0.
        raw = np.frombuffer(header, dtype=np.uint8)
        dst[:GENERATION_AT] = raw[:GENERATION_AT]
        dst[GENERATION_AT + 8:len(raw)] = raw[GENERATION_AT + 8:]
        gen = raw[GENERATION_AT:GENERATION_AT + 8].view(np.uint64)[0]
        dst[GENERATION_AT:GENERATION_AT + 8].view(np.uint64)[0] = gen

    def read_header(self, ref: SlotRef, key: PageKey, into: Any) -> PageHeader:
        """Copy and check the header of the page at ``ref`` into the head of ``into``;
        raises :class:`PageError`."""
        spec = self.spec
        self._check_slot(ref.slot)
        dst = as_array(into)[:spec.header_bytes]
        np.copyto(dst, self._slot(ref.slot)[:spec.header_bytes])
        header = PageHeader.parse(dst, key)
        header.expect(spec, key, ref.generation)
        return header

    in_place: ClassVar[bool] = True
    """:meth:`segment_view` hands out the tier's own memory (host-addressable regions)."""

    def segment_view(self, ref: SlotRef, layer: int, into: np.ndarray | None = None) -> np.ndarray:
        """Layer ``layer`` of the page at ``ref``, in place in tier memory (zero-copy read, step 1;
        ``into`` is for tiers that are not :attr:`in_place`).

        Whatever the caller copies out of it is trusted only after :meth:`check_segment` passed."""
        if self._segments is not None:
            if not 0 <= ref.slot < self.num_slots:
                self._check_slot(ref.slot)          # raises (a negative index would wrap around)
            seg: np.ndarray = self._segments[ref.slot, layer]
            return seg
        start = self.spec.segment_offset(layer)
        return self._slot(ref.slot)[start:start + self.spec.segment_bytes]

    def host_buffer(self, nbytes: int) -> np.ndarray:
        """Host memory a reader copies segments into (for tiers that are not :attr:`in_place`)."""
        return np.empty(nbytes, dtype=np.uint8)

    def device_view(self, ref: SlotRef, layer: int, device: Any) -> Any | None:
        """A tensor of layer ``layer`` a copy to ``device`` reads directly; ``None`` (host tiers):
        :meth:`segment_view` is the source."""
        return None

    def check_segment(self, ref: SlotRef, header: PageHeader, layer: int, landed: int) -> None:
        """Zero-copy read, step 2: after the caller copied :meth:`segment_view` to where the engine
        reads it, ``landed`` is the checksum of those bytes *where they landed* (summed in the same
        pass as the copy where the copy can); it must be the header's, and the slot must not have
        been rewritten meanwhile (a writer zeroes the generation before touching any byte). The
        tier's bytes are not read again: a check covers what the engine got, not the source.
        Raises :class:`PageError`."""
        if landed != header.segment_checksums[layer]:
            raise PageError("bad_checksum", f"layer {layer} of slot {ref.slot}")
        if self.live_generation(ref.slot) != ref.generation:
            raise PageError("stale_generation", f"slot {ref.slot} was rewritten during the read")

    def read(self, ref: SlotRef, key: PageKey, into: Any) -> PageHeader:
        """Copy and check a whole page into ``into`` (``spec.page_bytes`` long): one call copies the
        page and sums its segments in the same pass; then the copied header (key, generation,
        header checksum) and the segment checksums are checked, and the live generation once (a
        writer zeroes it before touching any byte, so an unchanged one means an untorn copy)."""
        spec = self.spec
        if not 0 <= ref.slot < self.num_slots:
            self._check_slot(ref.slot)          # raises
        # The whole page in one native call; None: a check failed (or no kernel), and the Python
        # path below copies again and says which.
        got = page_sum.load_page(as_array(into), self._region, ref.slot * self.slot_bytes, self._template,
                                 key.namespace, key.digest, ref.generation)
        if got is not None:
            return PageHeader(key, ref.generation, spec.kind, spec.num_layers, spec.segment_bytes, spec.page_tokens,
                              got[1], got[0])
        dst = as_array(into)[:spec.page_bytes]
        src = self._slot(ref.slot)
        hb, seg = spec.header_bytes, spec.segment_bytes
        # The header first: its seed is what the segments are summed under as they are copied.
        if len(dst) < spec.page_bytes:
            raise ValueError(f"page buffer of {len(dst)} bytes, need {spec.page_bytes}")
        np.copyto(dst[:hb], src[:hb])
        header = PageHeader.parse(dst[:hb], key)
        header.expect(spec, key, ref.generation)
        expect_checksums(header, page_sum.copy_checksums(dst[hb:], src[hb:], seg, header.sum_seed),
                         f"slot {ref.slot}")
        if self.live_generation(ref.slot) != ref.generation:
            raise PageError("stale_generation", f"slot {ref.slot} was rewritten during the read")
        return header

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise PageError("bad_location", f"slot {slot} outside 0..{self.num_slots - 1}")

    # ---- identity --------------------------------------------------------------------------

    @property
    @abstractmethod
    def domain(self) -> str:
        """Who else can read this tier's slots with plain loads: a unique id of a shared region
        (CXL) or of this process's private memory (DRAM)."""

    def healthy(self) -> bool:
        """False once the medium was lost under us (e.g. a CXL region's file was removed)."""
        return True

    def close(self) -> None:
        """Release the region. Reads and writes after close are errors."""
