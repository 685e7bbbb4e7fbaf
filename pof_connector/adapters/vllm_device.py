"""Loads and saves of one vLLM step on pof's own CUDA streams, ordered with the engine's by events.

On a GPU, vLLM runs its forward on a stream of its own (``vllm.utils.torch_utils.current_stream``,
the engine thread's current stream). Nothing pof queues may race it, and pof must never make the
engine's thread wait for a copy. So:

* **Loads** (:class:`StepLoads`): planned once per step (which page lands in which blocks, its
  checksum seed; the block ids uploaded once). Per layer, on pof's load stream: the layer's page
  segments are copied into a device staging buffer (from pinned tier memory a DMA that returns at
  once; from a peer GPU's region device to device), summed there and compared with their
  headers' sums on the device; the pages that match are scattered into the engine's blocks in one
  batch (a page that does not keeps its blocks as they were), gathered back from the blocks and
  checksummed there (the Triton kernel), then an event is recorded. Before attention reads the
  layer, the engine's stream waits for that event (``wait_for_layer_load``): on the device, not on
  the host. The landed sums come back to the host once per step, after the forward is queued
  (``wait_for_save``), where each page is checked against its header and its slot's generation;
  a page that failed is reported for recompute and its blocks are never used. The load stream
  first waits for what the engine queued before the step (a block being loaded may still be read
  by the previous step's kernels).
* **Saves** (:class:`StepSaves`): per layer, pof's save stream waits for an event recorded on the
  engine's stream right after attention wrote the layer, gathers the step's new pages from the
  blocks in one batch and copies them device-to-host into page-locked staging (no host wait).
  At the end of the step the engine's stream waits for those gathers (the blocks may be reused by
  the next step), and the pool's store thread waits for the copies' event before it reads the
  staging.

The rules of docs/safety.md §3 hold: the bytes checked are gathered from the engine's blocks
after the copy landed (rule 1), every write into the blocks is queued before the layer's event
and the check runs after the stream drained (rule 2). On CPU tensors there is no stream: the same
calls copy synchronously and each layer is checked right after its copy, as before.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pof_connector.adapters.vllm_layout import BlockLayout
from pof_connector.pages import page_sum
from pof_connector.pool import PageReader, Pool

log = logging.getLogger(__name__)

COPY_BYTES = 1 << 20
"""A load copies at least this much of a page at once (several layers when a layer's segment is
smaller): queuing one host-to-device copy costs about 10 us of host time, as long as a 64 KiB
segment takes over PCIe, so copies of single small segments would leave the DMA engine idle."""
STAGE_BYTES = 256 << 20
"""Device staging a step's loads take at most (fewer layers per copy when a step loads many pages)."""


class Lane:
    """One of pof's CUDA streams on the engine's device; on a CPU device, no stream: work runs
    when it is called and every ordering call does nothing."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: Any = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def queue(self) -> Iterator[None]:
        """Queue the work of the ``with`` block on this lane (from any thread)."""
        if self.stream is None:
            yield
        else:
            with torch.cuda.stream(self.stream):
                yield

    def after_engine(self) -> None:
        """This lane's next work waits for what the engine's stream queued so far. Call on the
        engine's thread: its current stream is the engine's."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def mark(self) -> Any:
        """An event after the work queued on this lane so far (``None`` on CPU)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def engine_waits(self, event: Any) -> None:
        """The engine's stream waits (on the device) for ``event``. Call on the engine's thread."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def drain(self) -> None:
        """The host waits for everything queued on this lane."""
        if self.stream is not None:
            self.stream.synchronize()


@dataclass(frozen=True)
class PlannedPage:
    """One page of a step's loads: where it comes from and which blocks it writes."""

    reader: PageReader
    page: int
    blocks: list[int]
    """The blocks it writes (manager blocks), after its first ``skip`` (the engine's own)."""
    skip: int


class StepLoads:
    """One step's loads by torch copies (any layout, any device), planned once."""

    def __init__(self, layout: BlockLayout, kv: Sequence[torch.Tensor], page_tokens: int, blocks_per_page: int,
                 segment_bytes: int, lane: Lane, pages: Sequence[PlannedPage]) -> None:
        self.layout, self.kv, self.lane = layout, kv, lane
        self.page_tokens, self.bpp, self.segment_bytes = page_tokens, blocks_per_page, segment_bytes
        self.pages = list(pages)
        self._at = {(id(p.reader), p.page): pos for pos, p in enumerate(self.pages)}
        self.events: list[Any] = [None] * len(kv)
        self._pending: list[tuple[int, list[int]]] = []     # (layer, positions copied) still to check
        # Layers copied per page at once (a group): segments of consecutive layers are adjacent in a slot.
        group = min(len(kv), -(-COPY_BYTES // segment_bytes))
        self.group = max(1, min(group, STAGE_BYTES // max(1, len(self.pages) * segment_bytes)))
        self._spanned: set[int] = set()     # positions whose current group was copied in one span
        device = kv[0].device
        lane.after_engine()
        with lane.queue():
            self._rows, self._ids = self._plan(range(len(self.pages)), device)
            self._stage = torch.empty((len(self.pages), self.group, segment_bytes), dtype=torch.uint8, device=device)
            self._sums = (torch.zeros((len(kv), len(self.pages)), dtype=torch.int64, device=device)
                          if lane.stream is not None else None)
            # Each page's expected sums, layer by layer as its header is known (a remote page's
            # arrives with its first layer): filled on the host, uploaded without a wait.
            self._want_host = torch.empty((len(kv), len(self.pages)), dtype=torch.int64,
                                          pin_memory=device.type == "cuda")
            self._want = (torch.empty_like(self._want_host, device=device) if device.type == "cuda"
                          else self._want_host)

    def _plan(self, positions: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the staged blocks (``[pages * bpp]``) that the pages at ``positions`` write, and
        the blocks they write, as device tensors (uploaded without a host wait)."""
        rows: list[int] = []
        ids: list[int] = []
        for pos in positions:
            p = self.pages[pos]
            rows.extend(range(pos * self.bpp + p.skip, pos * self.bpp + p.skip + len(p.blocks)))
            ids.extend(p.blocks)
        plan = torch.tensor([rows, ids], dtype=torch.long)
        if device.type == "cuda":
            plan = plan.pin_memory().to(device, non_blocking=True)
        return plan[0], plan[1]

    def copy_layer(self, layer: int, segments: Sequence[tuple[PageReader, int, np.ndarray | torch.Tensor]]) -> None:
        """Queue layer ``layer`` of the pages given (``(reader, page, segment)``: those not failed
        yet; a segment is host memory, or a tensor on a device: a peer GPU's region, copied device
        to device) into the engine's blocks, and the sums of the landed bytes; on CPU, check them.

        A page's staged bytes are summed before they are scattered, and a page whose sum is not
        its header's never reaches the blocks: they keep what they held (the decision is taken on
        the device, without a host wait). What did land is summed again where it landed and
        checked (:meth:`settle`); a page refused here fails that check too and is reported."""
        lay, kv, lane = self.layout, self.kv[layer], self.lane
        present = sorted(self._at[(id(r), i)] for r, i, _ in segments)
        if not present:
            return
        refilled = False
        first, at = layer - layer % self.group, layer % self.group
        seeds = {pos: self.pages[pos].reader.sum_seed(self.pages[pos].page) for pos in present}
        distinct = set(seeds.values())
        # One seed (a step's pages from one writer): one launch; else a seed per row (rows of pages
        # not copied this layer get any: their sums are never read).
        seed: int | list[int] = (distinct.pop() if len(distinct) == 1
                                 else [seeds.get(pos, seeds[present[0]]) for pos in range(len(self.pages))])
        want = self._want_host[layer]
        want.fill_(-1)          # no sum is negative: a row of no page this layer never matches
        for reader, i, _ in segments:
            want[self._at[(id(reader), i)]] = reader.expected_sum(i, layer)
        with lane.queue():
            if at == 0:      # a group's first layer: each page's layers of the group in one copy where it can
                count = min(self.group, len(self.kv) - first)
                self._spanned = set()
                for reader, i, _ in segments:
                    pos = self._at[(id(reader), i)]
                    span = reader.span(i, first, count)
                    if span is not None:
                        self._stage[pos, :count].view(-1).copy_(torch.from_numpy(span), non_blocking=True)
                        self._spanned.add(pos)
            for reader, i, seg in segments:
                pos = self._at[(id(reader), i)]
                if pos not in self._spanned:
                    on_device = isinstance(seg, torch.Tensor)
                    self._stage[pos, at].copy_(seg if on_device else torch.from_numpy(seg), non_blocking=True)
                    refilled = refilled or (not on_device and reader.refilled(i))
            rows, ids = ((self._rows, self._ids) if len(present) == len(self.pages)
                         else self._plan(present, kv.device))
            staged = self._stage[:, at]
            expected = self._want[layer]
            expected.copy_(want, non_blocking=True)
            good = page_sum.torch_checksums(staged, seed) == expected           # [pages], on the device
            pages = staged.view(lay.dtype).view(len(self.pages), *lay.canonical_shape(self.page_tokens))
            blocks = lay.pages_to_blocks(pages, self.bpp)
            incoming = blocks.index_select(0, rows)
            keep = good.repeat_interleave(self.bpp).index_select(0, rows)
            held = lay.gather(kv, ids)
            lay.scatter(kv, ids, torch.where(keep.view(-1, *[1] * (incoming.dim() - 1)), incoming, held))
            # What the engine will read: its blocks as they hold the page now (the skipped head
            # blocks, the engine's own, are summed from the source as the header covers them).
            blocks.index_copy_(0, rows, lay.gather(kv, ids))
            landed = lay.blocks_to_pages(blocks, self.bpp).reshape(len(self.pages), -1).view(torch.uint8)
            if self._sums is not None:
                self._sums[layer] = page_sum.torch_checksums(landed, seed)
                self.events[layer] = lane.mark()
                self._pending.append((layer, present))
                if refilled:     # a reader buffer the next layer's segment call refills: copied out first
                    lane.drain()
                return
        self._check(layer, present, lambda pos: self.pages[pos].reader.landed_sum(self.pages[pos].page,
                                                                                  landed[pos].numpy()))

    def ready(self, layer: int) -> None:
        """Before the engine reads layer ``layer``: its stream waits for the layer's copy and sums."""
        self.lane.engine_waits(self.events[layer])

    def settle(self) -> None:
        """After the forward was queued: wait for pof's copies (once a step), bring the sums to
        the host and check every page of every layer copied (pages that fail land in their
        reader's ``failed``)."""
        if not self._pending:
            return
        assert self._sums is not None
        self.lane.drain()
        with self.lane.queue():     # on pof's stream: a copy on the engine's would wait for its forward
            sums = self._sums.cpu().tolist()
        for layer, present in self._pending:
            self._check(layer, present, sums[layer].__getitem__)      # tolist(): Python ints
        self._pending = []

    def _check(self, layer: int, present: Sequence[int], landed: Callable[[int], int]) -> None:
        """Check layer ``layer`` of the pages at ``present`` against the sums ``landed(pos)`` of
        their bytes where they landed, a reader's pages at once (failures land in its ``failed``)."""
        by_reader: dict[int, tuple[PageReader, list[tuple[int, int]]]] = {}
        for pos in present:
            p = self.pages[pos]
            by_reader.setdefault(id(p.reader), (p.reader, []))[1].append((p.page, landed(pos)))
        for reader, checks in by_reader.values():
            reader.check_all(layer, checks)

    def drain(self) -> None:
        """Wait for pof's copies (before the sources are unpinned after an error)."""
        self.lane.drain()


class StepSaves:
    """One step's saves: each layer's new pages gathered from the blocks in one batch and copied
    into the staging of the save they belong to."""

    def __init__(self, layout: BlockLayout, kv: Sequence[torch.Tensor], blocks_per_page: int, lane: Lane,
                 saves: Sequence[tuple[list[int], np.ndarray]]) -> None:
        """``saves``: per save, its pages' blocks (page after page) and its staging
        ``[layers, pages, segment_bytes]``."""
        self.layout, self.kv, self.bpp, self.lane = layout, kv, blocks_per_page, lane
        self.staging = [segments for _, segments in saves]
        self._bounds: list[tuple[int, int]] = []
        ids: list[int] = []
        for blocks, segments in saves:
            first = len(ids) // blocks_per_page
            ids.extend(blocks)
            self._bounds.append((first, first + segments.shape[1]))
        with lane.queue():
            host = torch.tensor(ids, dtype=torch.long)
            self._ids = (host.pin_memory().to(kv[0].device, non_blocking=True) if kv[0].device.type == "cuda"
                         else host)
        self._gathered: Any = None

    def save_layer(self, layer: int) -> None:
        """Right after attention wrote layer ``layer`` (on the engine's thread): queue its pages'
        gather and their copy into the staging."""
        lay, lane = self.layout, self.lane
        lane.after_engine()
        with lane.queue():
            pages = lay.blocks_to_pages(lay.gather(self.kv[layer], self._ids), self.bpp)
            flat = pages.reshape(pages.shape[0], -1).view(torch.uint8)
            self._gathered = lane.mark()
            for (first, end), segments in zip(self._bounds, self.staging, strict=True):
                torch.from_numpy(segments[layer]).copy_(flat[first:end], non_blocking=True)

    def finish(self) -> Callable[[], None] | None:
        """At the end of the step (on the engine's thread): the engine's next work waits for the
        gathers; returns what the store thread must call before reading the staging (``None``:
        the staging holds its bytes already)."""
        self.lane.engine_waits(self._gathered)
        done = self.lane.mark()
        return None if done is None else done.synchronize

    def drain(self) -> None:
        """Wait for the copies into the staging (before it is dropped after an error)."""
        self.lane.drain()


class HostPins:
    """The pool's host memory that loads copy to a GPU from, page-locked with CUDA
    (``cudaHostRegister``) so that a host-to-device copy is a DMA that returns at once instead of
    a staged, synchronous one: the tiers' regions (DRAM, CXL mappings) and the NIXL staging that
    remote pages land in. Memory that is page-locked already (a DRAM tier made where torch uses
    CUDA) is left as it is; memory the driver refuses (some devdax mappings) stays pageable, and
    is logged once: its loads are slower, not wrong."""

    ALREADY = 712
    """``cudaErrorHostMemoryAlreadyRegistered``."""

    def __init__(self) -> None:
        self.pinned: list[tuple[int, int]] = []     # (address, bytes) this object registered
        self.refused: list[str] = []

    @classmethod
    def of_pool(cls, pool: Pool, device: torch.device) -> HostPins:
        """Pin ``pool``'s host memory for ``device`` (nothing unless it is a CUDA device)."""
        pins = cls()
        if device.type != "cuda":
            return pins
        memory = [(t.medium, t.region) for t in pool.tiers if t.in_place]
        if pool.fabric is not None:
            memory.append(("nixl staging", pool.fabric.staging.memory))
        for name, array in memory:
            pins.pin(name, array)
        if pins.refused:
            log.warning("pof: CUDA would not page-lock %s; loads from there copy through pageable "
                        "memory (slower)", ", ".join(pins.refused))
        return pins

    def pin(self, name: str, array: np.ndarray) -> bool:
        """Register ``array``'s memory; False when CUDA refused it (it stays pageable)."""
        if array.nbytes == 0:
            return False
        addr = array.ctypes.data
        rc = int(torch.cuda.cudart().cudaHostRegister(addr, array.nbytes, 0))
        if rc == 0:
            self.pinned.append((addr, array.nbytes))
            return True
        if rc == self.ALREADY:
            return True
        self.refused.append(f"{name} (cudaError {rc})")
        return False

    def release(self) -> None:
        """Unregister what :meth:`pin` registered (before the memory is unmapped)."""
        for addr, _ in self.pinned:
            torch.cuda.cudart().cudaHostUnregister(addr)
        self.pinned = []


def pinned_buffer(nbytes: int) -> np.ndarray:
    """Page-locked host memory as a numpy array (the tensor that owns it stays referenced by the
    array): device-to-host copies into it do not wait."""
    array: np.ndarray = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
    return array
