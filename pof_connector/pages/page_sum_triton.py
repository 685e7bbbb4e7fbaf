"""Format v3's segment checksum as one Triton kernel, for pages already on a GPU.

:func:`pof_connector.pages.page_sum.torch_checksums` in plain torch ops materialises the words as int64
and reads them several times (NH's two key offsets, the element and weight tensors): on a GPU that
would verify pages at a fraction of the speed the same GPU copies them at. This kernel reads each
word once from memory (a tile of 1 KiB NH blocks, split into the even and odd words in registers)
and keeps everything else in registers: both NH sums of each block, then the block's four
elements times their polynomial weights ``r**(E - t)`` from a small device-side table (so no
sequential Horner chain: the blocks of a segment are independent), each product reduced mod
``p = 2**61 - 1`` and split into its low 32 bits and the rest. A segment is split over several
programs (a single page's 32 segments would otherwise leave most of the GPU idle), and each
program adds its two partial sums into the segment's with ``atomic_add``: both stay below
``2**54`` for any segment (``E <= 2**22`` terms below ``2**32`` each), so int64 atomics never
wrap, and a last elementwise pass (:func:`pof_connector.pages.page_sum.combine_halves`) folds them into
the checksum.

Same values as the definition in :mod:`pof_connector.pages.page_sum` (NH's int64 products and sums wrap,
which is the mod 2**64 the definition asks for). Used only for CUDA tensors whose segments are
whole 32-bit words at 4-byte-aligned addresses; :func:`checksums` returns ``None`` for anything
else and the caller takes the torch path. ``TRITON_INTERPRET=1`` runs it on CPU tensors (the CI
test).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import triton
import triton.language as tl

from pof_connector.pages import page_sum

_BLOCKS = 4        # NH blocks one program loads per step: a [4, 256]-word tile
_CHUNK = 32        # NH blocks per program: a 256 KiB segment is summed by 8 programs at once


@triton.jit  # type: ignore[untyped-decorator]
def _segment_sums(words, keys, weights, rows, sums, n_segments, inner, stride_outer, stride_inner,  # type: ignore[no-untyped-def]
                  n_words, n_blocks, key_stride, weight_stride,
                  PER_ROW: tl.constexpr, BLOCKS: tl.constexpr, CHUNK: tl.constexpr):
    # Program (segment, chunk) adds the halves of its blocks' weighted elements to
    # sums[segment] (low 32 bits) and sums[n + segment] (the rest): each element's weight is
    # indexed by its place in the whole segment, so partial sums just add up.
    # literals: 0xFFFFFFFF is 2**32 - 1, 0x1FFFFFFFFFFFFFFF is p = 2**61 - 1
    seg = tl.program_id(0)
    first = tl.program_id(1) * CHUNK
    if seg < n_segments:
        base = words + (seg // inner).to(tl.int64) * stride_outer + (seg % inner).to(tl.int64) * stride_inner
        row = tl.load(rows + seg).to(tl.int64) if PER_ROW else 0      # PER_ROW is constexpr: one branch is built
        kb = keys + row * key_stride
        wb = weights + row * weight_stride
        pairs = tl.arange(0, 128)
        ke0 = tl.load(kb + 2 * pairs)[None, :]
        ko0 = tl.load(kb + 2 * pairs + 1)[None, :]
        ke2 = tl.load(kb + 2 * pairs + 2)[None, :]
        ko2 = tl.load(kb + 2 * pairs + 3)[None, :]
        lo = tl.zeros([BLOCKS], dtype=tl.int64)
        hi = tl.zeros([BLOCKS], dtype=tl.int64)
        for step in range(0, CHUNK, BLOCKS):
            blk = first + step + tl.arange(0, BLOCKS)
            at = blk[:, None] * 256 + tl.arange(0, 256)[None, :]
            x = tl.load(base + at, mask=at < n_words, other=0).to(tl.int64) & 0xFFFFFFFF    # zero-padded words
            even, odd = tl.split(tl.reshape(x, [BLOCKS, 128, 2]))
            h1 = tl.sum(((even + ke0) & 0xFFFFFFFF) * ((odd + ko0) & 0xFFFFFFFF), axis=1)
            h2 = tl.sum(((even + ke2) & 0xFFFFFFFF) * ((odd + ko2) & 0xFFFFFFFF), axis=1)
            live = blk < n_blocks
            for c in tl.static_range(4):
                if c == 0:
                    e = h1 & 0xFFFFFFFF
                elif c == 1:
                    e = (h1 >> 32) & 0xFFFFFFFF
                elif c == 2:
                    e = h2 & 0xFFFFFFFF
                else:
                    e = (h2 >> 32) & 0xFFFFFFFF
                w = tl.load(wb + 4 * blk + c, mask=live, other=0)       # 0 past the segment: no term
                a = e * (w & 0x7FFFFFFF)                                 # < 2**63
                a = (a & 0x1FFFFFFFFFFFFFFF) + (a >> 61)
                b = e * (w >> 31)                                        # < 2**62, times 2**31 mod p:
                b = ((b & 0x3FFFFFFF) << 31) + (b >> 30)                 # the 61-bit residue rotated
                t = a + b
                lo += t & 0xFFFFFFFF
                hi += t >> 32
        tl.atomic_add(sums + seg, tl.sum(lo, axis=0))
        tl.atomic_add(sums + n_segments + seg, tl.sum(hi, axis=0))


def checksums(segments: Any, seed: int | Sequence[int]) -> Any | None:
    """The checksums of a ``[..., seg]`` uint8 tensor's rows as int64 ``[...]`` under ``seed`` (one
    seed, or one per index of the first dimension; see
    :func:`pof_connector.pages.page_sum.torch_checksums`); ``None`` when the layout does not suit the
    kernel (segment not whole words, a misaligned view, leading dims that do not fold into two)."""
    import torch

    seg = segments.shape[-1]
    lead = tuple(segments.shape[:-1])
    if seg % 4 or seg == 0 or segments.stride(-1) != 1 or segments.storage_offset() % 4:
        return None
    if segments.dim() == 1:
        segments = segments.view(1, 1, seg)
    elif segments.dim() == 2:
        segments = segments.unsqueeze(0)
    elif segments.dim() > 3:
        try:
            segments = segments.view(-1, segments.shape[-2], seg)
        except RuntimeError:
            return None
    if segments.stride(0) % 4 or segments.stride(1) % 4:
        return None
    outer, inner = segments.shape[0], segments.shape[1]
    n, n_words = outer * inner, seg // 4
    n_blocks = -(-n_words // page_sum.NH_WORDS)
    keys, weights, rows = page_sum.seed_tables(seed, lead, 4 * n_blocks, segments.device)
    sums = torch.zeros(2 * n, dtype=torch.int64, device=segments.device)     # low halves of each, then the rest
    if n:
        words = segments.view(torch.int32)        # strides in words from here
        grid = (n, triton.cdiv(n_blocks, _CHUNK))
        _segment_sums[grid](words, keys, weights, keys if rows is None else rows, sums, n, inner, words.stride(0),
                            words.stride(1), n_words, n_blocks, keys.stride(0), weights.stride(0),
                            PER_ROW=rows is not None, BLOCKS=_BLOCKS, CHUNK=_CHUNK)
    return page_sum.combine_halves(sums[:n], sums[n:]).view(lead)
