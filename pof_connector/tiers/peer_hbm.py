"""Peer-GPU HBM: page slots in memory of a GPU of this node, shared by the node's pof processes.

The region is one device tensor (see :mod:`pof_connector.tiers.peer_region`): the first process
allocates it on ``tiers.peer_hbm.device`` and publishes its CUDA IPC handle in the runtime
directory, the others map it. Like a CXL region, each writer owns a partition and everybody reads
every slot; the tier's ``domain`` is the region, so the pool reads another process's pages here
directly (the fabric is not involved).
"Peer" here is another GPU of this host; the fabric's peers are other nodes
(:mod:`pof_connector.fabric.remote_node`).

Why CUDA IPC through torch and not NIXL VRAM: the peer is on the same node, so the copy is a plain
device-to-device (or host↔device) ``copy_`` that the driver routes over NVLink/PCIe peer access;
it needs no agent, no registration, no UCX ``cuda_ipc`` transport configuration, and it runs on
CPU tensors through the same code (``device: cpu`` maps a ``/dev/shm`` file). NIXL VRAM is the
route for *remote* nodes' GPU memory (docs/fabric-transport.md).

Every byte move is a torch ``copy_`` on the tier's own CUDA stream (never the engine's), with the
seqlock protocol of :mod:`pof_connector.tiers.base`:

* writer: zero the slot's live generation and synchronize, copy the segments, copy the header
  except its generation, synchronize, copy the generation last, synchronize;
* reader: copy, then check key, generation and the segment checksums of the bytes the caller got,
  then re-read the live generation. The checksums (:mod:`pof_connector.pages.page_sum`) are computed on
  the device where the bytes landed (the Triton kernel, or torch ops): a whole-page read into GPU
  memory brings only the header back to the host, and a write from GPU segments sums them on the
  GPU. A page's checksums are taken under the seed in its header, which a GPU read learns only
  with the header; it sums under the seed it expects for that slot (the seed last seen there, else
  the last one seen anywhere: in steady state, right) and sums once more, after one more wait,
  when the header names another. ``ci/gpu_check.sh`` measures what checking costs against the raw
  copies.

torch is optional for pof: this module imports it only when a peer_hbm tier is built, and fails
with a :class:`ConfigError` naming ``tiers.peer_hbm`` when it is missing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from pof_connector.config import TierConfig
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
)
from pof_connector.tiers.base import SlotRef, Tier, slot_bytes_for
from pof_connector.tiers.peer_region import PeerRegion, import_torch, resolve_device


class PeerHbmTier(Tier):
    medium = "peer_hbm"

    def __init__(self, spec: PageSpec, config: TierConfig, runtime_dir: str) -> None:
        assert config.device is not None
        torch = import_torch()
        self._torch = torch
        self.device = resolve_device(torch, config.device)
        self._peer = PeerRegion(torch, self.device, config, runtime_dir, slot_bytes_for(spec), spec.page_bytes)
        self._dev: Any = self._peer.tensor
        self._cuda = self.device.type == "cuda"
        # The tier's own stream: its copies never queue behind (or block) the engine's kernels.
        self._stream: Any = torch.cuda.Stream(self.device) if self._cuda else None
        self._local = threading.local()
        super().__init__(spec, np.empty(0, dtype=np.uint8), self._peer.generations, self._peer.slot_bytes,
                         self._peer.own)
        # A GPU read sums a page before its header reached the host: under the seed it expects
        # (see the module docstring). Slot -> the seed of the page last seen there.
        self._seen_seeds: dict[int, int] = {}
        self._last_seed = self.sum_seed

    @property
    def owner(self) -> bool:
        """True when this process created the region (it lives as long as this process)."""
        return self._peer.owner

    # ---- torch plumbing ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        if self._stream is None:
            yield
        else:
            with self._torch.cuda.stream(self._stream):
                yield

    def _sync(self, *others: Any) -> None:
        """Wait for our copies, and for the current streams of other CUDA tensors they touched
        (a cross-device copy_ may run on the other device's stream)."""
        if self._stream is not None:
            self._stream.synchronize()
        for t in others:
            if t.device.type == "cuda" and t.device != self.device:
                self._torch.cuda.current_stream(t.device).synchronize()

    def _as_tensor(self, buf: Any) -> Any:
        """A flat uint8 tensor over ``buf`` (a tensor on any device, or host memory), no copy."""
        torch = self._torch
        if isinstance(buf, torch.Tensor):
            return buf.reshape(-1).view(torch.uint8)     # refuses a non-contiguous tensor
        return torch.from_numpy(as_array(buf))

    def _scratch(self, nbytes: int) -> Any:
        """A per-thread host buffer (pinned with CUDA, so device→host copies run at full speed)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < nbytes:
            size = max(nbytes, self.slot_bytes)
            buf = self._torch.empty(size, dtype=self._torch.uint8, pin_memory=self._cuda)
            self._local.buf = buf
        return buf[:nbytes]

    def _host(self, t: Any) -> np.ndarray:
        """The bytes of ``t`` as a host array: ``t`` itself when it is in host memory, else a copy in
        this thread's scratch buffer (valid until this thread's next call: headers only)."""
        if t.device.type == "cpu":
            out: np.ndarray = t.numpy()
            return out
        scratch = self._scratch(t.numel())
        with self._on_stream():
            scratch.copy_(t)
        self._sync(t)
        out = scratch.numpy()
        return out

    @property
    def device_bytes(self) -> Any:
        """The whole mapped region as a uint8 tensor (no checks: for benchmarks against raw copies)."""
        return self._dev

    def _slot_t(self, slot: int) -> Any:
        start = slot * self.slot_bytes
        return self._dev[start:start + self.spec.page_bytes]

    def _seg_t(self, slot: int, layer: int) -> Any:
        start = slot * self.slot_bytes + self.spec.segment_offset(layer)
        return self._dev[start:start + self.spec.segment_bytes]

    # ---- live generation -------------------------------------------------------------------------

    def _set_live_generation(self, slot: int, generation: int) -> None:
        start = slot * self.slot_bytes + GENERATION_AT
        word = self._torch.from_numpy(np.array([generation], dtype=np.uint64).view(np.uint8))
        with self._on_stream():
            self._dev[start:start + 8].copy_(word)
        self._sync()           # visible before any byte of the slot changes

    def live_generation(self, slot: int) -> int:
        start = slot * self.slot_bytes + GENERATION_AT
        word = self._torch.empty(8, dtype=self._torch.uint8)
        with self._on_stream():
            word.copy_(self._dev[start:start + 8])
        self._sync()
        return int(word.numpy().view(np.uint64)[0])

    # ---- writes ----------------------------------------------------------------------------------

    def write(self, ref: SlotRef, key: PageKey, layers: Sequence[Any]) -> None:
        """Write a page from per-layer segments (host arrays, or tensors on any device: a segment on
        a GPU is copied device-to-device) into a prepared slot."""
        spec = self.spec
        if len(layers) != spec.num_layers:
            raise ValueError(f"{len(layers)} layer segments for {spec.num_layers} layers")
        dst = self._slot_t(ref.slot)
        seg = spec.segment_bytes
        srcs = [self._as_tensor(layer) for layer in layers]
        for i, src in enumerate(srcs):
            if src.numel() != seg:
                raise ValueError(f"layer {i}: {src.numel()} bytes, expected {seg}")
        # Queued without a wait each (a blocking copy_ from pinned memory waits for the stream per
        # segment: 32 waits a page); the one wait below covers them all before the caller's
        # buffers are theirs again.
        with self._on_stream():
            for i, src in enumerate(srcs):
                start = spec.segment_offset(i)
                dst[start:start + seg].copy_(src, non_blocking=True)
        self._sync(*(t for t in layers if isinstance(t, self._torch.Tensor)))
        # The checksums of the bytes where they landed, all layers at once (on a GPU: one sync).
        sums = self._checksums(dst[spec.header_bytes:], seg, self.sum_seed)
        self._write_header(dst, encode_header(spec, key, ref.generation, sums, self.sum_seed))
        self._saw_seed(ref.slot, self.sum_seed)

    def _checksums(self, t: Any, seg: int, seed: int) -> tuple[int, ...]:
        """The checksums under ``seed`` of each ``seg``-byte segment of flat ``t``, summed where
        ``t`` is (a GPU tensor on its device: no copy to the host)."""
        if t.device.type == "cpu":
            return page_sum.checksums(t.numpy(), seg, seed)
        with self._on_stream():      # tolist on the same stream: it waits for the sums
            got: list[int] = page_sum.torch_checksums(t.view(-1, seg), seed).tolist()
        return tuple(got)

    def _seed_guess(self, slot: int) -> int:
        """The seed a GPU read sums the page in ``slot`` under before it has the page's header."""
        return self._seen_seeds.get(slot, self._last_seed)

    def _saw_seed(self, slot: int, seed: int) -> None:
        self._seen_seeds[slot] = seed
        self._last_seed = seed

    def write_page(self, ref: SlotRef, page: Any) -> None:
        """Write an already packed and verified page, re-stamped with ``ref.generation``: it keeps
        its own checksum seed and segment checksums (its bytes are not summed again)."""
        spec = self.spec
        src = self._as_tensor(page)
        header = PageHeader.parse(self._host(src[:spec.header_bytes]).copy())
        dst = self._slot_t(ref.slot)
        with self._on_stream():
            dst[spec.header_bytes:].copy_(src[spec.header_bytes:spec.page_bytes])
        self._write_header(dst, encode_header(spec, header.key, ref.generation, header.segment_checksums,
                                              header.sum_seed))
        self._saw_seed(ref.slot, header.sum_seed)

    def _write_header(self, dst: Any, header: bytes) -> None:
        # Everything but the generation first, then a barrier, then the generation: until it lands,
        # readers see generation 0 and reject the slot.
        raw = self._torch.from_numpy(np.frombuffer(header, dtype=np.uint8).copy())
        g = GENERATION_AT
        with self._on_stream():
            dst[:g].copy_(raw[:g])
            dst[g + 8:len(raw)].copy_(raw[g + 8:])
        self._sync(dst)
        with self._on_stream():
            dst[g:g + 8].copy_(raw[g:g + 8])
        self._sync()

    # ---- reads -----------------------------------------------------------------------------------

    def read_header(self, ref: SlotRef, key: PageKey, into: Any) -> PageHeader:
        spec = self.spec
        self._check_slot(ref.slot)
        dst = self._as_tensor(into)[:spec.header_bytes]
        with self._on_stream():
            dst.copy_(self._slot_t(ref.slot)[:spec.header_bytes])
        self._sync(dst)
        header = PageHeader.parse(self._host(dst))
        header.expect(spec, key, ref.generation)
        return header

    @property
    def in_place(self) -> bool:  # type: ignore[override]
        """A ``cpu`` region is host memory a reader copies from in place; a GPU region is not."""
        return not self._cuda

    def segment_view(self, ref: SlotRef, layer: int, into: np.ndarray | None = None) -> np.ndarray:
        """Layer ``layer`` of the page at ``ref`` as host bytes: in place for a ``cpu`` region, else
        copied into ``into`` (the caller's own buffer per page, from :meth:`host_buffer`: a
        per-thread scratch would be refilled under a caller that holds several segments at once).
        Trusted only after :meth:`check_segment` passed."""
        self._check_slot(ref.slot)
        seg = self._seg_t(ref.slot, layer)
        if self.in_place:
            out: np.ndarray = seg.numpy()
            return out
        if into is None:
            raise ValueError("a GPU region's segment is copied into the caller's buffer: pass into")
        dst = self._torch.from_numpy(into)
        with self._on_stream():
            dst.copy_(seg, non_blocking=True)
        self._sync(seg)
        return into

    def device_view(self, ref: SlotRef, layer: int, device: Any) -> Any | None:
        """Layer ``layer`` of the page at ``ref`` as a view of the region, for a copy into memory
        of the region's kind (a GPU engine's staging: device to device, over NVLink for another
        GPU; a CPU region to a CPU tensor); ``None`` for any other ``device``."""
        if self._torch.device(device).type != self.device.type:
            return None
        self._check_slot(ref.slot)
        return self._seg_t(ref.slot, layer)

    def host_buffer(self, nbytes: int) -> np.ndarray:
        """Host memory for :meth:`segment_view` (pinned on a GPU host: device→host at full speed)."""
        buf: np.ndarray = self._torch.empty(nbytes, dtype=self._torch.uint8, pin_memory=self._cuda).numpy()
        return buf

    def read(self, ref: SlotRef, key: PageKey, into: Any) -> PageHeader:
        """Copy and check a whole page into ``into`` (``spec.page_bytes``): host memory, or a tensor
        on any GPU (a device-to-device copy). Raises :class:`PageError`; ``into`` is then garbage."""
        spec = self.spec
        self._check_slot(ref.slot)
        dst = self._as_tensor(into)[:spec.page_bytes]
        if dst.numel() < spec.page_bytes:
            raise ValueError(f"page buffer of {dst.numel()} bytes, need {spec.page_bytes}")
        if not self._cuda:
            return self._read_host_region(ref, key, dst)
        # One wait per page on a GPU: the copy, the sums where the bytes landed (under the seed
        # this slot's page is expected to have), the header and the live generation word queue on
        # the tier's stream, and only the header, the sums and that word come to the host. The
        # generation is read after the copy finished (stream order), which is what the writer's
        # zero-first protocol needs.
        hb, seg, layers = spec.header_bytes, spec.segment_bytes, spec.num_layers
        on_gpu = dst.device.type == "cuda"
        landed = self._landed()          # pinned: sums (int64 each) | generation word | header
        guess = self._seed_guess(ref.slot)
        with self._on_stream():
            dst.copy_(self._slot_t(ref.slot), non_blocking=True)
            if on_gpu:
                sums = page_sum.torch_checksums(dst[hb:].view(layers, seg), guess)
                landed[:8 * layers].view(self._torch.int64).copy_(sums, non_blocking=True)
                landed[8 * layers + 8:].copy_(dst[:hb], non_blocking=True)
            start = ref.slot * self.slot_bytes + GENERATION_AT
            landed[8 * layers:8 * layers + 8].copy_(self._dev[start:start + 8], non_blocking=True)
        self._sync(dst)
        host = landed.numpy()
        header = PageHeader.parse(host[8 * layers + 8:] if on_gpu else dst[:hb].numpy(), key)   # keeps no view
        header.expect(spec, key, ref.generation)
        self._saw_seed(ref.slot, header.sum_seed)
        if not on_gpu:
            expect_checksums(header, page_sum.checksums(dst[hb:].numpy(), seg, header.sum_seed), f"slot {ref.slot}")
        elif header.sum_seed == guess:
            expect_checksums(header, host[:8 * layers].view(np.uint64).tolist(), f"slot {ref.slot}")
        else:       # summed under another seed than the page's: again, over the bytes the caller got
            expect_checksums(header, self._checksums(dst[hb:], seg, header.sum_seed), f"slot {ref.slot}")
        if int(host[8 * layers:8 * layers + 8].view(np.uint64)[0]) != ref.generation:
            raise PageError("stale_generation", f"slot {ref.slot} was rewritten during the read")
        return header

    def read_many(self, refs: Sequence[SlotRef], keys: Sequence[PageKey], out: Any) -> list[PageHeader | PageError]:
        """:meth:`read` of several pages into the rows of ``out`` (a ``[len(refs), >= page_bytes]``
        uint8 tensor): per page, its header, or the :class:`PageError` that refused it (that row is
        then garbage; the other pages stand). Into a GPU from a GPU region it waits once for the
        whole batch: the copies, one checksum launch over every page where it landed (each under
        the seed expected for its slot), and one gather of the live generation words, then only
        headers, sums and words come to the host; a page whose header names another seed than
        expected is summed again (one more wait)."""
        spec = self.spec
        n = len(refs)
        if len(keys) != n or out.dim() != 2 or out.shape[0] < n or out.shape[1] < spec.page_bytes:
            raise ValueError(f"{n} refs, {len(keys)} keys and an out of shape {tuple(out.shape)}: "
                             f"need [{n}, >= {spec.page_bytes}]")
        batched = self._cuda and out.device.type == "cuda" and out.stride(1) == 1 and n > 0
        if not batched or not all(0 <= r.slot < self.num_slots for r in refs):
            # Page by page; also where a slot is out of range, so read refuses that page alone.
            results: list[PageHeader | PageError] = []
            for ref, key, row in zip(refs, keys, out, strict=False):
                try:
                    results.append(self.read(ref, key, row))
                except PageError as e:
                    results.append(e)
            return results
        torch = self._torch
        hb, seg, layers = spec.header_bytes, spec.segment_bytes, spec.num_layers
        rows = out[:n, :spec.page_bytes]
        starts = torch.tensor([r.slot * self.slot_bytes + GENERATION_AT for r in refs], dtype=torch.int64)
        word_at = (starts[:, None] + torch.arange(8)).reshape(-1)
        landed = torch.empty(n * (8 * layers + 8 + hb), dtype=torch.uint8, pin_memory=True)
        sums_h = landed[:8 * layers * n].view(torch.int64).view(n, layers)
        gens_h = landed[8 * layers * n:8 * (layers + 1) * n]
        heads_h = landed[8 * (layers + 1) * n:].view(n, hb)
        guesses = [self._seed_guess(r.slot) for r in refs]
        with self._on_stream():
            word_at = word_at.to(self.device)
            for ref, row in zip(refs, rows, strict=True):
                row.copy_(self._slot_t(ref.slot), non_blocking=True)
            sums_h.copy_(page_sum.torch_checksums(rows[:, hb:].view(n, layers, seg), guesses), non_blocking=True)
            heads_h.copy_(rows[:, :hb], non_blocking=True)
            gens_h.copy_(self._dev[word_at], non_blocking=True)     # after the copies: stream order
        self._sync(out)
        live = gens_h.numpy().view(np.uint64).tolist()
        sums = sums_h.numpy().view(np.uint64).tolist()      # Python ints: ~20x cheaper to compare than numpy scalars
        heads = heads_h.numpy()
        results = []
        for i, (ref, key) in enumerate(zip(refs, keys, strict=True)):
            try:
                header = PageHeader.parse(heads[i], key)
                header.expect(spec, key, ref.generation)
                self._saw_seed(ref.slot, header.sum_seed)
                got = sums[i]
                if header.sum_seed != guesses[i]:    # summed under another seed: again, this row alone
                    got = list(self._checksums(rows[i, hb:], seg, header.sum_seed))
                expect_checksums(header, got, f"slot {ref.slot}")
                if live[i] != ref.generation:
                    raise PageError("stale_generation", f"slot {ref.slot} was rewritten during the read")
            except PageError as e:
                results.append(e)
                continue
            results.append(header)
        return results

    def _landed(self) -> Any:
        """This thread's pinned buffer for what a GPU read brings to the host."""
        buf = getattr(self._local, "landed", None)
        if buf is None:
            nbytes = 8 * self.spec.num_layers + 8 + self.spec.header_bytes
            buf = self._torch.empty(nbytes, dtype=self._torch.uint8, pin_memory=True)
            self._local.landed = buf
        return buf

    def _read_host_region(self, ref: SlotRef, key: PageKey, dst: Any) -> PageHeader:
        """:meth:`read` of a ``cpu`` region (tests and CI): plain host copies, checked on the host."""
        spec = self.spec
        dst.copy_(self._slot_t(ref.slot))
        hb = spec.header_bytes
        header = PageHeader.parse(self._host(dst[:hb]).copy())
        header.expect(spec, key, ref.generation)
        got = self._host(dst)
        expect_checksums(header, page_sum.checksums(got[hb:], spec.segment_bytes, header.sum_seed), f"slot {ref.slot}")
        if self.live_generation(ref.slot) != ref.generation:
            raise PageError("stale_generation", f"slot {ref.slot} was rewritten during the read")
        return header

    # ---- identity --------------------------------------------------------------------------------

    @property
    def region(self) -> np.ndarray:
        """The region as host memory (``cpu`` regions only). A GPU region has no host address to
        register with NIXL as DRAM; the fabric does not serve this tier."""
        if self._cuda:
            raise TypeError("a peer_hbm region on a GPU has no host view")
        out: np.ndarray = self._dev.numpy()
        return out

    @property
    def domain(self) -> str:
        return f"peer_hbm:{self._peer.region_id}"

    def healthy(self) -> bool:
        """False once the region's owner exited (CUDA frees IPC memory with its owner)."""
        return self._peer.alive()

    def close(self) -> None:
        self._dev = None
        self._generations = np.empty(0, dtype=np.uint64)
        self._peer.close()
