"""pof-owned local memory, registered with the NIXL agent, that remote pages land in before they
are validated (and spilled pages leave from); not :mod:`pof_connector.pool.staging`, the adapters'
reusable host buffers.

Remote READs never target an engine's buffers: a cancelled READ (deadline passed) can still write
its destination much later (measured: 16.7 of 16.8 MB landed after the cancel), so its staging
slots are quarantined for a grace period instead of being reused at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from pof_connector.fabric.agent import NixlAgent
from pof_connector.fabric.spans import span_descs
from pof_connector.pages.layout import PageError, PageHeader, PageSpec
from pof_connector.tiers import SlotRef

SLOT_ALIGN = 64
QUARANTINE_S = 60.0
"""How long the staging slots of a cancelled READ stay unused (late data may still arrive)."""


class StagingArea:
    """``num_slots`` page slots plus one 8-byte generation word per slot, registered once.

    Local descriptor ``i < num_slots`` is page slot ``i``; ``num_slots + i`` is its generation word
    (the target of the second, small READ that re-checks the remote slot's live generation).
    With ``spans`` (byte ranges of a page, e.g. the header and layer 0, then groups of later
    layers), descriptor ``span_base(c, num_slots, len(spans)) + i`` is span ``c`` of slot ``i``:
    a remote page is then read in several requests, layer 0's first.
    """

    @property
    def memory(self) -> np.ndarray:
        """The page slots' memory (a GPU engine pins it with CUDA: a copy out of it is a DMA)."""
        return self._pages

    def __init__(self, agent: NixlAgent, page_bytes: int, size: int,
                 spans: Sequence[tuple[int, int]] = ()) -> None:
        self.page_bytes = page_bytes
        self.stride = (page_bytes + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN
        self.num_slots = max(1, size // self.stride)
        self._pages = np.zeros(self.num_slots * self.stride, dtype=np.uint8)
        self._gens = np.zeros(self.num_slots, dtype=np.uint64)
        agent.register(self._pages)
        agent.register(self._gens)
        base, gens = self._pages.ctypes.data, self._gens.ctypes.data
        slots = np.arange(self.num_slots, dtype=np.uint64)
        descs = np.zeros((2 * self.num_slots, 3), dtype=np.uint64)
        descs[:self.num_slots, 0] = base + slots * self.stride
        descs[:self.num_slots, 1] = page_bytes
        descs[self.num_slots:, 0] = gens + slots * 8
        descs[self.num_slots:, 1] = 8
        self.spans = list(spans) if len(spans) > 1 else []
        descs = np.concatenate([descs, span_descs(base + slots * self.stride, self.spans)])
        self.dlist = agent.prep(None, descs)
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._quarantined: list[tuple[float, list[int]]] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> list[int]:
        """Up to ``n`` free slots (fewer when staging is short: the rest of a load misses)."""
        with self._lock:
            self._release_quarantined()
            got = self._free[-n:] if n else []
            del self._free[len(self._free) - len(got):]
            return got

    def give(self, slots: list[int]) -> None:
        with self._lock:
            self._free.extend(slots)

    def quarantine(self, slots: list[int], seconds: float = QUARANTINE_S) -> None:
        """Keep ``slots`` out of use for ``seconds``: a cancelled READ may still write them."""
        if slots:
            with self._lock:
                self._quarantined.append((time.monotonic() + seconds, list(slots)))

    @property
    def quarantined_slots(self) -> int:
        with self._lock:
            return sum(len(s) for _, s in self._quarantined)

    def _release_quarantined(self) -> None:
        now = time.monotonic()
        keep = []
        for until, slots in self._quarantined:
            if until <= now:
                self._free.extend(slots)
            else:
                keep.append((until, slots))
        self._quarantined = keep

    def page(self, slot: int) -> np.ndarray:
        start = slot * self.stride
        return self._pages[start:start + self.page_bytes]

    def generation(self, slot: int) -> int:
        """The live generation word fetched by the last re-check READ into ``slot``."""
        return int(self._gens[slot])

    def clear_generation(self, slot: int) -> None:
        self._gens[slot] = 0

    def set_generation(self, slot: int, generation: int) -> None:
        """The word a spill WRITEs last into the remote slot's live generation."""
        self._gens[slot] = generation


class StagedPage:
    """Validated remote pages in staging, read through the same calls as a tier
    (:class:`pof_connector.pool.page_reader.SlotSource`); ``ref.slot`` is the staging slot."""

    in_place = True

    def __init__(self, staging: StagingArea, spec: PageSpec, medium: str) -> None:
        self._staging = staging
        self._spec = spec
        self.medium = medium

    def segment_view(self, ref: SlotRef, layer: int, into: np.ndarray | None = None) -> np.ndarray:
        page: np.ndarray = self._staging.page(ref.slot)
        return page[self._spec.segment_offset(layer):self._spec.segment_offset(layer) + self._spec.segment_bytes]

    def host_buffer(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, dtype=np.uint8)

    def device_view(self, ref: SlotRef, layer: int, device: object) -> None:
        """Staging is host memory: :meth:`segment_view` is the source."""
        return None

    def check_segment(self, ref: SlotRef, header: PageHeader, layer: int, landed: int) -> None:
        """The copy out of staging is checked where it landed, like any other: a layer is handed
        out only after it was validated on arrival
        (:meth:`~pof_connector.fabric.remote_reader.RemoteLoad.get`), but that covered staging,
        not the engine's memory. No generation to re-read: staging slots are pof's own (no one
        writes them until they are given back)."""
        if landed != header.segment_checksums[layer]:
            raise PageError("bad_checksum", f"layer {layer} of staged page {ref.slot}")

    def header(self, ref: SlotRef) -> np.ndarray:
        return self._staging.page(ref.slot)[:self._spec.header_bytes]

    def unpin(self, slot: int) -> None:
        self._staging.give([slot])
