"""The per-layer segment checksum of page format v2, fused with the copy that moves the bytes.

Definition (the same on every implementation): zero-pad a segment of ``L`` bytes to
``n = ceil(L / 4)`` little-endian 32-bit words ``w_0 .. w_{n-1}`` and take, modulo 2**64,

    A = sum(w_i),   B = sum((n - i) * w_i),   checksum = A + MIX * B.

Why this and not xxh3 (format v1): a plain sum and a position-weighted sum are what a GPU computes
at HBM speed with two torch reductions over the bytes where a DMA put them
(:func:`torch_checksums`), so a GPU engine verifies a page in device memory instead of bringing it
back to the host; and on the CPU the sums fit in the copy loop itself (the native kernel
``pof_connector._pagesum``), so checking costs no second pass over memory.

What it catches, for segments up to ``MAX_SEGMENT_BYTES`` (``n < 2**28``): every error inside one
32-bit word — any flipped bit, any burst of up to 32 bits (``A`` moves by ``d != 0``, the checksum
by ``d * (1 + MIX * (n - i))``, an odd factor times ``0 < |d| < 2**32``); every swap of two
different words (``B`` moves by ``(j - i) * (w_j - w_i)``, below ``2**60``, times ``MIX``, which
is twice an odd number); a segment zeroed, shifted or taken from another page unless the two sums
collide by chance (about 2**-64 for unrelated data). It is not a MAC: like xxh3 it guards against
faults and stale slots, not against a forger (the generation protocol and the index guard the
rest).

Implementations: the native kernel when the package was built with it (``pip install .`` compiles
it; it is optional, so an install without a compiler still works), else numpy (same values,
several times slower, two passes). :data:`NATIVE` says which one runs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

MIX = 0x9E3779B97F4A7C16
"""Twice an odd number: keeps single-word errors and word swaps detectable after folding A and B."""
_MASK = (1 << 64) - 1
_MIX_SIGNED = MIX - (1 << 64)      # the same residue as an int64, for torch

log = logging.getLogger(__name__)

_native: ModuleType | None
try:
    from pof_connector import _pagesum as _native
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
    where = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return logging.WARNING, (
        "pof: the native copy kernel (pof_connector._pagesum) is not built, so pages are copied and checked "
        f"in numpy (the same checks, several times slower); pof_connector was imported from {where}: "
        "`pip install .` (or `pip install -e .` in a checkout) builds it where a C compiler is installed")


def _words(seg: np.ndarray) -> np.ndarray:
    pad = -len(seg) % 4
    if pad:
        seg = np.concatenate([seg, np.zeros(pad, dtype=np.uint8)])
    return np.ascontiguousarray(seg).view("<u4").astype(np.uint64)


def _numpy_checksum(seg: np.ndarray) -> int:
    w = _words(seg)
    weights = np.arange(len(w), 0, -1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        a = int(w.sum(dtype=np.uint64))
        b = int((w * weights).sum(dtype=np.uint64))
    return (a + MIX * b) & _MASK


def checksums(buf: np.ndarray, segment_bytes: int) -> tuple[int, ...]:
    """The checksum of each ``segment_bytes`` segment of a flat uint8 array (a whole number of them)."""
    if _native is not None:
        result: tuple[int, ...] = _native.checksums(buf, segment_bytes)
        return result
    if len(buf) % segment_bytes:
        raise ValueError(f"{len(buf)} bytes are not a whole number of {segment_bytes}-byte segments")
    return tuple(_numpy_checksum(buf[i:i + segment_bytes]) for i in range(0, len(buf), segment_bytes))


def checksum(buf: np.ndarray) -> int:
    """The checksum of one segment (a flat uint8 array)."""
    return checksums(buf, len(buf))[0]


def copy_checksums(dst: np.ndarray, src: np.ndarray, segment_bytes: int, head: int = 0) -> tuple[int, ...]:
    """Copy ``src`` into ``dst`` (flat uint8 arrays of one length) and return the checksum of each
    segment of the copy after its first ``head`` bytes (a page header: copied, not summed). One
    pass over the bytes with the native kernel."""
    if _native is not None:
        result: tuple[int, ...] = _native.copy_checksums(dst, src, segment_bytes, head)
        return result
    if len(dst) != len(src):
        raise ValueError(f"copy of {len(src)} bytes into {len(dst)}")
    np.copyto(dst, src)
    return checksums(dst[head:], segment_bytes)


def gather_checksums(dst: np.ndarray, srcs: Sequence[np.ndarray], stream: bool = False) -> tuple[int, ...]:
    """Copy each of ``srcs`` (flat uint8 arrays of ``len(dst) // len(srcs)`` bytes) into consecutive
    segments of ``dst`` and return the checksum of each copy, in one call. ``stream``: the native
    kernel may bypass the caches (for a tier slot, which nobody reads soon after it is written)."""
    if _native is not None:
        result: tuple[int, ...] = _native.gather_checksums(dst, srcs, stream)
        return result
    seg = len(dst) // max(len(srcs), 1)
    if not srcs or seg * len(srcs) != len(dst):
        raise ValueError(f"{len(dst)} bytes cannot hold {len(srcs)} equal segments")
    for i, src in enumerate(srcs):
        if len(src) != seg:
            raise ValueError(f"segment {i} has {len(src)} bytes, expected {seg}")
        np.copyto(dst[i * seg:(i + 1) * seg], src)
    return checksums(dst, seg)


def store_page(region: np.ndarray, offset: int, template: bytes, namespace: bytes, digest: bytes, generation: int,
               srcs: Sequence[Any], stream: bool = False) -> bool:
    """Write a whole format-v2 page into ``region[offset:]`` in one native call: each of ``srcs``
    (one segment per layer) copied and summed, then the header (``template``'s fixed fields, the
    key, ``generation``, the segment checksums and the header checksum) with its generation field
    zero, the generation word last (the tier's write protocol). ``template``: a header of the
    page's spec (:func:`pof_connector.pages.header_template`). ``False``: no native kernel here,
    nothing was written (the caller takes its Python path). Raises ``TypeError``/``BufferError``
    before writing anything when a segment has no buffer interface (a torch tensor)."""
    # a build from before the whole-page calls (an editable install not rebuilt) takes the Python path
    if _native is None or not hasattr(_native, "store_page"):
        return False
    _native.store_page(region, offset, template, namespace, digest, generation, srcs, stream)
    return True


def load_page(dst: np.ndarray, region: np.ndarray, offset: int, template: bytes, namespace: bytes, digest: bytes,
              generation: int) -> tuple[int, ...] | None:
    """Copy the page at ``region[offset:]`` into ``dst`` and check it in one native call, summing
    its segments as they are copied: the segment checksums when it is a format-v2 page of
    ``template``'s geometry holding this key at ``generation`` whose header and segment checksums
    hold and whose slot still has that live generation after the copy. ``None`` when anything
    differs, ``dst`` is too short or no native kernel is here: the caller then copies and checks on
    its Python path, which names the reason (and reads format-v1 pages)."""
    if _native is None or not hasattr(_native, "load_page"):
        return None
    result: tuple[int, ...] | None = _native.load_page(dst, region, offset, template, namespace, digest, generation)
    return result


def kt_copy_pages(cache: np.ndarray, pages: Sequence[tuple[np.ndarray, Sequence[int], int]], block_tokens: int,
                  heads: int, head_dim: int, itemsize: int, vnni: bool = False, threads: int = 1) -> list[int]:
    """Write canonical segments (K then V, each ``[blocks * block_tokens, heads, head_dim]``) into
    a vLLM CPU cache and return each segment's checksum, summed in the same pass. ``pages``: one
    ``(segment, block_ids, skip)`` per page; its block ``b >= skip`` goes to cache block
    ``block_ids[b - skip]`` (each block ``[heads, 2, block_tokens * head_dim]``: K^T then V per
    head; with ``vnni``, the ``amx`` ISA's bf16 tiles, see :mod:`pof_connector.adapters.vllm_layout`).
    ``cache``: the whole cache as writable bytes. ``threads > 1``: up to ``threads - 1`` helper
    threads of the kernel's own copy pages alongside the caller; a page goes to whoever is free
    first, and a page a descheduled helper holds is copied again by the caller, so a core the OS
    gives to another process delays the call by a page at most. Such a helper may write its page
    (the same bytes) after the call returned: :func:`settle` before the segments may change.
    Native kernel only (callers check :data:`NATIVE`)."""
    if _native is None:
        raise RuntimeError("kt_copy_pages needs the native kernel (pof_connector._pagesum)")
    result: list[int] = _native.kt_copy_pages(cache, pages, block_tokens, heads, head_dim, itemsize, vnni, threads)
    return result


def settle() -> None:
    """Return once no helper thread of :func:`kt_copy_pages` still copies a page of an earlier call
    (normally at once: only a helper the OS descheduled mid-page is late)."""
    if _native is not None:
        _native.settle()


def torch_checksums(segments: Any) -> Any:
    """The checksums of a ``[..., segment_bytes]`` uint8 tensor's last-dimension rows, computed by
    torch on the tensor's own device (CPU or GPU), as an int64 tensor of shape ``[...]`` holding
    each checksum's two's-complement value (compare with :func:`as_int64`). Only the last
    dimension must be contiguous: ``pages[:, header_bytes:].view(P, layers, seg)``-style views of
    whole pages are summed in place."""
    if segments.device.type == "cuda":
        got = _triton_checksums(segments)
        if got is not None:
            return got
    import torch  # only callers that already hold tensors get here

    seg = segments.shape[-1]
    pad = -seg % 4
    if pad:
        segments = torch.nn.functional.pad(segments, (0, pad))
    if segments.stride(-1) != 1 or any(st % 4 for st in segments.stride()[:-1]) or segments.storage_offset() % 4:
        segments = segments.contiguous()
    w = segments.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    n = w.shape[-1]
    weights = torch.arange(n, 0, -1, dtype=torch.int64, device=w.device)
    a = w.sum(dim=-1)
    b = (w * weights).sum(dim=-1)           # int64 arithmetic wraps: the sums are taken mod 2**64
    return a + _MIX_SIGNED * b


_triton_state = "untried"
"""``"ok"``: GPU tensors are summed by the Triton kernel; ``"off"``: by torch ops (no Triton here,
or its first launch failed)."""


def _triton_checksums(segments: Any) -> Any | None:
    """:func:`torch_checksums` by one Triton kernel (:mod:`pof_connector.page_sum_triton`: reads
    each byte once, where the torch ops read it several times); ``None``: use the torch ops."""
    global _triton_state
    if _triton_state == "off":
        return None
    try:
        from pof_connector import page_sum_triton
    except ImportError:
        _triton_state = "off"
        log.info("pof: no Triton here; pages on a GPU are checked by torch ops")
        return None
    if _triton_state == "ok":
        return page_sum_triton.checksums(segments, _MIX_SIGNED)
    try:        # the first launch compiles the kernel for this GPU
        got = page_sum_triton.checksums(segments, _MIX_SIGNED)
    except Exception as e:
        _triton_state = "off"
        log.warning("pof: the Triton checksum kernel failed to build or run here (%s: %s); pages on a GPU "
                    "are checked by torch ops instead (the same checksums, several times slower)",
                    type(e).__name__, e)
        return None
    if got is not None:
        _triton_state = "ok"
    return got


def as_int64(value: int) -> int:
    """A checksum (unsigned 64-bit) as the int64 that :func:`torch_checksums` returns for it."""
    return value - (1 << 64) if value >= 1 << 63 else value
