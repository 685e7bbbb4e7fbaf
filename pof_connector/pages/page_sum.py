"""The per-layer segment checksum of page format v3, fused with the copy that moves the bytes.

Definition (the same on every implementation, bit for bit). Constants: ``B = 256`` 32-bit words
per NH block (1 KiB) and the prime ``p = 2**61 - 1``.

Keys, from a 64-bit ``seed`` with SplitMix64 (all arithmetic mod ``2**64``)::

    state = seed
    next64(): state += 0x9E3779B97F4A7C15; z = state
              z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
              z = (z ^ (z >> 27)) * 0x94D049BB133111EB
              return z ^ (z >> 31)
    K[i] = next64() & 0xFFFFFFFF for i = 0 .. B + 1     (258 NH key words, drawn first, in order)
    r: draw v = next64() & p until 2 <= v < p; r = v

Checksum of a segment of ``L >= 1`` bytes:

1. ``n = ceil(L / 4)`` little-endian 32-bit words (zero-padded), zero-padded again to ``m * B``
   words, ``m = ceil(n / B)``.
2. For each NH block ``j`` (words ``x_0 .. x_{B-1}``), mod ``2**64``::

       h1_j = sum_{i < B/2} ((x_{2i} + K[2i]) mod 2**32) * ((x_{2i+1} + K[2i+1]) mod 2**32)
       h2_j = sum_{i < B/2} ((x_{2i} + K[2i+2]) mod 2**32) * ((x_{2i+1} + K[2i+3]) mod 2**32)

3. Elements, block by block: ``lo32(h1_j), hi32(h1_j), lo32(h2_j), hi32(h2_j)``: ``E = 4m`` of them.
4. ``checksum = sum_t e_t * r**(E - t) mod p`` (Horner: ``acc = (acc + e) * r mod p`` per
   element), always below ``2**61``.

The bound. For two different segments of the same length, and keys drawn uniformly at random
independently of the data: ``Pr[equal checksums] <= 2**-64 + E / (2**61 - 1)``. NH with a 2-fold
Toeplitz key is ``2**-64``-almost-universal on equal-length inputs (Black, Halevi, Krawczyk,
Krovetz, Rogaway, "UMAC: Fast and Secure Message Authentication", CRYPTO 1999), so the two
segments' sequences of NH outputs are equal with probability at most ``2**-64`` (a block where
the segments differ collides at most that often); where the sequences differ, the two
checksums are equal only at a root of a nonzero polynomial of degree at most ``E`` in ``r`` (its
coefficients, element differences, are below ``2**32 < p`` in size; it has no constant term), so
at most ``E - 1`` of the ``2**61 - 3`` values ``r`` is drawn from, and
``(E - 1) / (2**61 - 3) <= E / (2**61 - 1)``. A 256 KiB segment has ``E = 1024``: ``<= 2**-51``
per segment. The bound holds for every pair of different segments, structured
errors included (bursts, words swapped or shifted, sparse multi-word faults whose plain and
position-weighted sums cancel, which format v2's sums missed deterministically).

Honest limits: the keys come from a 64-bit random seed (:func:`new_seed`, one per tier, stamped
in each page header) through SplitMix64, a pseudo-random generator, not from ``258 * 32 + 61``
truly random bits; and the checksum guards against faults, torn, stale and mixed pages, not
against a forger who knows the seed (the seed is in the page header, in plain sight).

Why this shape: NH is adds and 32x32->64-bit multiplies that fit in the CPU copy loop itself (the
native kernel ``pof_connector.pages._pagesum``: one pass over memory, AVX2 ``vpmuludq``), and the same
definition vectorises on a GPU over the bytes where they landed (:func:`torch_checksums`, a
Triton kernel there); the polynomial step is one multiply-add per 1 KiB block element, and it
makes the result depend on each block's position.

Implementations: the native kernel when the package was built with it (``pip install .`` compiles
it; it is optional, so an install without a compiler still works), else numpy (same values,
several times slower, several passes; :mod:`pof_connector.pages.page_sum_numpy`, the reference).
:data:`NATIVE` says which one runs.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from pof_connector.pages.page_sum_numpy import (
    _M32,
    PRIME,
    _check_seed,
    _numpy_checksums,
    weights,
)

# the definition in numpy; these are also read through this module
from pof_connector.pages.page_sum_numpy import NH_WORDS as NH_WORDS
from pof_connector.pages.page_sum_numpy import _numpy_checksum as _numpy_checksum
from pof_connector.pages.page_sum_numpy import keys as keys

log = logging.getLogger("pof_connector.page_sum")     # its name before the move to pages/: filters keep working

_native: ModuleType | None
try:
    from pof_connector.pages import _pagesum as _native
except ImportError:       # built without a C compiler, or a source checkout without build_ext
    _native = None
NATIVE: str | None = None if _native is None else _native.KERNEL
"""The native kernel in use ("avx2" or "generic"); ``None``: the numpy fallback."""


def kernel_line() -> tuple[int, str]:
    """What a node logs at start about its page copies: the level and the line. The numpy
    fallback is a warning, because pages then move at a fraction of memcpy speed and nothing
    else would tell: the line says where the package was imported from (a source checkout
    without ``build_ext`` shadows an installed build) and how to build the kernel."""
    if NATIVE is not None:
        return logging.INFO, f"pof: pages are copied and checked by the native kernel ({NATIVE})"
    where = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return logging.WARNING, (
        "pof: the native copy kernel (pof_connector.pages._pagesum) is not built, so pages are copied and checked "
        f"in numpy (the same checks, several times slower); pof_connector was imported from {where}: "
        "`pip install .` (or `pip install -e .` in a checkout) builds it where a C compiler is installed")


def new_seed() -> int:
    """A fresh checksum seed: 64 random bits from the OS, never 0 (0 reads as "no seed" to a
    person looking at a header dump)."""
    while True:
        seed = int.from_bytes(os.urandom(8), "little")
        if seed:
            return seed



def checksums(buf: np.ndarray, segment_bytes: int, seed: int) -> tuple[int, ...]:
    """The checksum of each ``segment_bytes`` segment of a flat uint8 array (a whole number of
    them) under ``seed``."""
    if _native is not None:
        result: tuple[int, ...] = _native.checksums(buf, segment_bytes, seed)
        return result
    if segment_bytes <= 0 or len(buf) % segment_bytes:
        raise ValueError(f"{len(buf)} bytes are not a whole number of {segment_bytes}-byte segments")
    return _numpy_checksums(np.asarray(buf, dtype=np.uint8).reshape(-1), segment_bytes, _check_seed(seed))


def checksum(buf: np.ndarray, seed: int) -> int:
    """The checksum of one segment (a flat uint8 array) under ``seed``."""
    return checksums(buf, len(buf), seed)[0]


def copy_checksums(dst: np.ndarray, src: np.ndarray, segment_bytes: int, seed: int, head: int = 0) -> tuple[int, ...]:
    """Copy ``src`` into ``dst`` (flat uint8 arrays of one length) and return the checksum under
    ``seed`` of each segment of the copy after its first ``head`` bytes (copied, not summed). One
    pass over the bytes with the native kernel."""
    if _native is not None:
        result: tuple[int, ...] = _native.copy_checksums(dst, src, segment_bytes, seed, head)
        return result
    if len(dst) != len(src):
        raise ValueError(f"copy of {len(src)} bytes into {len(dst)}")
    np.copyto(dst, src)
    return checksums(dst[head:], segment_bytes, seed)


def gather_checksums(dst: np.ndarray, srcs: Sequence[np.ndarray], seed: int, stream: bool = False) -> tuple[int, ...]:
    """Copy each of ``srcs`` (flat uint8 arrays of ``len(dst) // len(srcs)`` bytes) into consecutive
    segments of ``dst`` and return the checksum of each copy under ``seed``, in one call.
    ``stream``: the native kernel may bypass the caches (for a tier slot, which nobody reads soon
    after it is written)."""
    if _native is not None:
        result: tuple[int, ...] = _native.gather_checksums(dst, srcs, seed, stream)
        return result
    seg = len(dst) // max(len(srcs), 1)
    if not srcs or seg * len(srcs) != len(dst):
        raise ValueError(f"{len(dst)} bytes cannot hold {len(srcs)} equal segments")
    for i, src in enumerate(srcs):
        if len(src) != seg:
            raise ValueError(f"segment {i} has {len(src)} bytes, expected {seg}")
        np.copyto(dst[i * seg:(i + 1) * seg], src)
    return checksums(dst, seg, seed)


def store_page(region: np.ndarray, offset: int, template: bytes, namespace: bytes, digest: bytes, generation: int,
               seed: int, srcs: Sequence[Any], stream: bool = False) -> bool:
    """Write a whole format-v3 page into ``region[offset:]`` in one native call: each of ``srcs``
    (one segment per layer) copied and summed under ``seed``, then the header (``template``'s fixed
    fields, the key, ``generation``, ``seed``, the segment checksums and the header checksum) with
    its generation field zero, the generation word last (the tier's write protocol). ``template``:
    a header of the page's spec (:func:`pof_connector.pages.layout.header_template`). ``False``: no native
    kernel here, nothing was written (the caller takes its Python path). Raises
    ``TypeError``/``BufferError`` before writing anything when a segment has no buffer interface
    (a torch tensor)."""
    # a build from before the whole-page calls (an editable install not rebuilt) takes the Python path
    if _native is None or not hasattr(_native, "store_page"):
        return False
    _native.store_page(region, offset, template, namespace, digest, generation, seed, srcs, stream)
    return True


def load_page(dst: np.ndarray, region: np.ndarray, offset: int, template: bytes, namespace: bytes, digest: bytes,
              generation: int) -> tuple[int, tuple[int, ...]] | None:
    """Copy the page at ``region[offset:]`` into ``dst`` and check it in one native call, summing
    its segments as they are copied under the seed of the copied header: ``(seed, segment
    checksums)`` when it is a format-v3 page of ``template``'s geometry holding this key at
    ``generation`` whose header and segment checksums hold and whose slot still has that live
    generation after the copy. ``None`` when anything differs, ``dst`` is too short or no native
    kernel is here: the caller then copies and checks on its Python path, which names the reason."""
    if _native is None or not hasattr(_native, "load_page"):
        return None
    result: tuple[int, tuple[int, ...]] | None = _native.load_page(dst, region, offset, template, namespace, digest,
                                                                   generation)
    return result


def kt_copy_pages(cache: np.ndarray, pages: Sequence[tuple[np.ndarray, Sequence[int], int, int]], block_tokens: int,
                  heads: int, head_dim: int, itemsize: int, vnni: bool = False, threads: int = 1) -> list[int]:
    """Write canonical segments (K then V, each ``[blocks * block_tokens, heads, head_dim]``) into
    a vLLM CPU cache and return each segment's checksum, summed in the same pass. ``pages``: one
    ``(segment, block_ids, skip, seed)`` per page; its block ``b >= skip`` goes to cache block
    ``block_ids[b - skip]`` (each block ``[heads, 2, block_tokens * head_dim]``: K^T then V per
    head; with ``vnni``, the ``amx`` ISA's bf16 tiles, see :mod:`pof_connector.adapters.vllm_layout`),
    and its checksum is taken under ``seed`` (its page header's). ``cache``: the whole cache as
    writable bytes. ``threads > 1``: up to ``threads - 1`` helper threads of the kernel's own copy
    pages alongside the caller; a page goes to whoever is free first, and a page a descheduled
    helper holds is copied again by the caller, so a core the OS gives to another process delays
    the call by a page at most. Such a helper may write its page (the same bytes) after the call
    returned: :func:`settle` before the segments may change. Native kernel only (callers check
    :data:`NATIVE`)."""
    if _native is None:
        raise RuntimeError("kt_copy_pages needs the native kernel (pof_connector.pages._pagesum)")
    result: list[int] = _native.kt_copy_pages(cache, pages, block_tokens, heads, head_dim, itemsize, vnni, threads)
    return result


def settle() -> None:
    """Return once no helper thread of :func:`kt_copy_pages` still reads a page of an earlier call
    (normally at once: only a helper the OS descheduled mid-page is late; it never writes a page
    the caller took over)."""
    if _native is not None:
        _native.settle()


# ---- torch ----------------------------------------------------------------------------------------

_LOW31 = (1 << 31) - 1


def device_tables(seed: int, elements: int, device: Any) -> tuple[Any, Any]:
    """``seed``'s NH key words (int64 ``[258]``) and polynomial weights ``r**(E - t)`` (int64
    ``[elements]``) as tensors on ``device``, cached (a page read looks them up, it does not
    upload them)."""
    return _device_tables(seed, elements, str(device))


@functools.lru_cache(maxsize=64)
def _device_tables(seed: int, elements: int, device: str) -> tuple[Any, Any]:
    import torch

    k = keys(seed)
    nh = torch.from_numpy(k.nh.astype(np.int64)).to(device)
    w = torch.from_numpy(np.ascontiguousarray(weights(seed, elements)).astype(np.int64)).to(device)
    return nh, w


def seed_tables(seed: int | Sequence[int], lead: tuple[int, ...], elements: int,
                device: Any) -> tuple[Any, Any, Any | None]:
    """The key and weight tables of ``seed`` (one seed, or one per index of the first of the
    ``lead`` dimensions): ``[S, 258]`` and ``[S, elements]`` int64 tensors on ``device``, and the
    row of each segment of ``lead`` (int32 ``[prod(lead)]``; ``None``: row 0 for all)."""
    import torch

    if isinstance(seed, int):
        nh, w = device_tables(_check_seed(seed), elements, device)
        return nh.unsqueeze(0), w.unsqueeze(0), None
    seeds = [_check_seed(int(s)) for s in seed]
    if not lead or len(seeds) != lead[0]:
        raise ValueError(f"{len(seeds)} seeds for segments of leading shape {lead}: one per index of the first")
    distinct = list(dict.fromkeys(seeds))
    if len(distinct) == 1:
        return seed_tables(distinct[0], lead, elements, device)
    tables = [device_tables(s, elements, device) for s in distinct]
    row = torch.tensor([distinct.index(s) for s in seeds], dtype=torch.int32)
    rest = 1
    for d in lead[1:]:
        rest *= d
    rows = row.repeat_interleave(rest).to(device)
    return torch.stack([t[0] for t in tables]), torch.stack([t[1] for t in tables]), rows


def combine_halves(lo_sum: Any, hi_sum: Any) -> Any:
    """``(hi_sum * 2**32 + lo_sum) mod p``, in ``[0, p)``, by int64 torch ops on tensors of
    non-negative sums below ``2**62`` each (the halves of the per-element terms, summed by the
    torch path or the Triton kernel)."""
    p = PRIME
    hi = (hi_sum & p) + (hi_sum >> 61)                                   # < 2**61 + 2
    hi = ((hi & ((1 << 29) - 1)) << 32) + (hi >> 29)                     # * 2**32 mod p: < 2**61 + 2**33
    lo = (lo_sum & p) + (lo_sum >> 61)
    t = hi + lo                                                          # < 2**62 + 2**34
    t = (t & p) + (t >> 61)                                              # < 2**61 + 2
    return t - p * (t >= p).to(t.dtype)


def _term_halves(e: Any, w: Any) -> tuple[Any, Any]:
    """``e * w mod p`` (up to a few ``p``) for int64 ``e < 2**32`` and ``w < 2**61``, as its low 32
    bits and the rest, so that sums of many of them stay far below ``2**63``. ``w`` splits at bit
    31 (``e * (w mod 2**31) < 2**63``; ``e * (w >> 31) < 2**62``, times ``2**31`` by rotating the
    61-bit residue)."""
    p = PRIME
    a = e * (w & _LOW31)
    a = (a & p) + (a >> 61)                                              # < 2**61 + 4
    b = e * (w >> 31)
    b = ((b & ((1 << 30) - 1)) << 31) + (b >> 30)                        # < 2**61 + 2**32
    t = a + b
    return t & _M32, t >> 32


_TORCH_CHUNK_BYTES = 32 << 20
"""Segment bytes the torch ops sum per round: their int64 temporaries take about 8x the bytes
summed, so a batch of whole pages is summed in rounds instead of all at once (GPU memory)."""


def _torch_ops_checksums(segments: Any, seed: int | Sequence[int]) -> Any:
    import torch

    lead = tuple(segments.shape[:-1])
    seg = segments.shape[-1]
    n = -(-seg // 4)
    m = max(1, -(-n // NH_WORDS))
    elements = 4 * m
    nh, w, rows = seed_tables(seed, lead, elements, segments.device)
    flat = segments.reshape(-1, seg)                  # a copy only where the leading dims do not fold
    out = torch.empty(flat.shape[0], dtype=torch.int64, device=segments.device)
    step = max(1, _TORCH_CHUNK_BYTES // (m * NH_WORDS * 4))
    for start in range(0, flat.shape[0], step):
        part = flat[start:start + step]
        pad = m * NH_WORDS * 4 - seg
        if pad:
            part = torch.nn.functional.pad(part, (0, pad))
        if part.stride(-1) != 1 or part.stride(0) % 4 or part.storage_offset() % 4:
            part = part.contiguous()
        x = (part.view(torch.int32).to(torch.int64) & _M32).view(-1, m, NH_WORDS)
        if rows is None:
            kt, wt = nh[0], w[0]
            k1, k2 = kt[:NH_WORDS], kt[2:]                                 # each word's key in h1, in h2
        else:
            which = rows[start:start + step].long()
            kt, wt = nh[which], w[which]                                  # [rows, 258], [rows, E]
            k1, k2 = kt[:, None, :NH_WORDS], kt[:, None, 2:]
        hs = []
        for k in (k1, k2):          # whole-width passes, then the pairs (cheaper than strided halves)
            keyed = ((x + k) & _M32).view(-1, m, NH_WORDS // 2, 2)
            # int64 products and sums wrap: that is the mod 2**64 the definition asks for
            hs.append((keyed[..., 0] * keyed[..., 1]).sum(dim=-1))
        h1, h2 = hs
        e = torch.stack([h1 & _M32, (h1 >> 32) & _M32, h2 & _M32, (h2 >> 32) & _M32], dim=-1).view(-1, elements)
        lo, hi = _term_halves(e, wt)
        out[start:start + step] = combine_halves(lo.sum(dim=-1), hi.sum(dim=-1))
    return out.view(lead)


def torch_checksums(segments: Any, seed: int | Sequence[int]) -> Any:
    """The checksums of a ``[..., segment_bytes]`` uint8 tensor's last-dimension rows, computed by
    torch on the tensor's own device (CPU or GPU), as an int64 tensor of shape ``[...]`` (each
    checksum is below ``2**61``, so its int64 is its value). ``seed``: the seed of every row, or a
    sequence of one seed per index of the first dimension (pages of different writers in one
    ``[pages, layers, segment_bytes]`` batch). Only the last dimension must be contiguous:
    ``pages[:, header_bytes:].view(P, layers, seg)``-style views of whole pages are summed in
    place. On a GPU, the Triton kernel (:mod:`pof_connector.pages.page_sum_triton`) where it runs."""
    if segments.device.type == "cuda":
        got = _triton_checksums(segments, seed)
        if got is not None:
            return got
    return _torch_ops_checksums(segments, seed)


_triton_state = "untried"
"""``"ok"``: GPU tensors are summed by the Triton kernel; ``"off"``: by torch ops (no Triton here,
or its first launch failed)."""


def _triton_checksums(segments: Any, seed: int | Sequence[int]) -> Any | None:
    """:func:`torch_checksums` by one Triton kernel (:mod:`pof_connector.pages.page_sum_triton`: reads
    each byte once, where the torch ops read it several times); ``None``: use the torch ops."""
    global _triton_state
    if _triton_state == "off":
        return None
    try:
        from pof_connector.pages import page_sum_triton
    except ImportError:
        _triton_state = "off"
        log.info("pof: no Triton here; pages on a GPU are checked by torch ops")
        return None
    if _triton_state == "ok":
        return page_sum_triton.checksums(segments, seed)
    try:        # the first launch compiles the kernel for this GPU
        got = page_sum_triton.checksums(segments, seed)
    except ValueError:
        raise           # the caller's mistake (seeds that do not fit): the torch ops would refuse it too
    except Exception as e:
        _triton_state = "off"
        log.warning("pof: the Triton checksum kernel failed to build or run here (%s: %s); pages on a GPU "
                    "are checked by torch ops instead (the same checksums, several times slower)",
                    type(e).__name__, e)
        return None
    if got is not None:
        _triton_state = "ok"
    return got
