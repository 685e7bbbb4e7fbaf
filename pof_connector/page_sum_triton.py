"""Format v2's segment checksum as one Triton kernel, for pages already on a GPU.

:func:`pof_connector.page_sum.torch_checksums` in plain torch ops materialises the words as int64
and reads them four times: on an H200 that verifies pages at ~250 GB/s, a tenth of what the same
GPU copies them at, so the check would cost more than the DMA it follows. This kernel reads each
word once and keeps both sums in registers; a segment is split over several programs (a single
page's 32 segments would otherwise leave most of the GPU idle), whose partial sums add up.

Same values as the definition in :mod:`pof_connector.page_sum` (int64 arithmetic wraps, which is
the mod 2**64 the definition asks for). Used only for CUDA tensors whose segments are whole
32-bit words at 4-byte-aligned addresses; :func:`checksums` returns ``None`` for anything else
and the caller takes the torch path. ``TRITON_INTERPRET=1`` runs it on CPU tensors (the CI test).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

_BLOCK = 2048      # words one program loads per step
_CHUNK = 8192      # words per program: a 256 KiB segment is summed by 8 programs at once


@triton.jit  # type: ignore[untyped-decorator]
def _segment_sums(words, sums, n_segments, inner, stride_outer, stride_inner, n_words,  # type: ignore[no-untyped-def]
                  BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    # Program (segment, chunk) adds its words' A and B terms to sums[segment] and sums[n + segment]:
    # B's weights (n - i) use the word's index in the whole segment, so partial sums just add up.
    seg = tl.program_id(0)
    first = tl.program_id(1) * CHUNK
    if seg < n_segments:
        base = words + (seg // inner).to(tl.int64) * stride_outer + (seg % inner).to(tl.int64) * stride_inner
        a = tl.zeros([BLOCK], dtype=tl.int64)
        b = tl.zeros([BLOCK], dtype=tl.int64)
        for step in range(0, CHUNK, BLOCK):
            offs = first + step + tl.arange(0, BLOCK)
            w = tl.load(base + offs, mask=offs < n_words, other=0).to(tl.int64) & 0xFFFFFFFF
            a += w
            b += w * (n_words - offs).to(tl.int64)
        tl.atomic_add(sums + seg, tl.sum(a, axis=0))
        tl.atomic_add(sums + n_segments + seg, tl.sum(b, axis=0))


def checksums(segments: Any, mix_signed: int) -> Any | None:
    """The checksums of a ``[..., seg]`` uint8 tensor's rows as int64 ``[...]`` (see
    :func:`pof_connector.page_sum.torch_checksums`); ``None`` when the layout does not suit the
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
    sums = torch.zeros(2 * n, dtype=torch.int64, device=segments.device)      # A of each, then B of each
    if n:
        words = segments.view(torch.int32)        # strides in words from here
        grid = (n, triton.cdiv(n_words, _CHUNK))
        _segment_sums[grid](words, sums, n, inner, words.stride(0), words.stride(1), n_words,
                            BLOCK=_BLOCK, CHUNK=_CHUNK)
    return torch.add(sums[:n], sums[n:], alpha=mix_signed).view(lead)      # A + MIX * B, one launch
