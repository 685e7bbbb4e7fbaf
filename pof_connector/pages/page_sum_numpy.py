"""Format v3's segment checksum in numpy: the key material of a seed and the reference
implementation, also the fallback where the native kernel is not built.

The definition, the bound and its honest limits are in :mod:`pof_connector.pages.page_sum`, which
re-exports these names; everything here follows it bit for bit (the native kernel and the torch
and Triton paths are tested against this module).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

NH_WORDS = 256
"""``B``: 32-bit words per NH block (1 KiB)."""
NH_KEY_WORDS = NH_WORDS + 2
PRIME = (1 << 61) - 1
"""``p``: the outer polynomial's modulus."""
_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


class SumKeys(NamedTuple):
    """The key material of one seed."""

    nh: np.ndarray
    """``K``: the 258 NH key words (uint64 holding 32-bit values; read-only)."""
    r: int
    """The polynomial's point, ``2 <= r < p``."""


def _check_seed(seed: int) -> int:
    if not 0 <= seed <= _M64:
        raise ValueError(f"checksum seed {seed} is not a 64-bit unsigned integer")
    return seed


@functools.lru_cache(maxsize=64)
def keys(seed: int) -> SumKeys:
    """The key material of ``seed`` (SplitMix64, see :mod:`pof_connector.pages.page_sum`), cached."""
    state = _check_seed(seed)

    def next64() -> int:
        nonlocal state
        state = (state + _GAMMA) & _M64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        return z ^ (z >> 31)

    nh = np.array([next64() & _M32 for _ in range(NH_KEY_WORDS)], dtype=np.uint64)
    nh.flags.writeable = False
    while True:
        v = next64() & PRIME
        if 2 <= v < PRIME:
            return SumKeys(nh, v)


def _fold(x: np.ndarray) -> np.ndarray:
    """``x mod p`` up to one ``p``: ``x < 2**64`` becomes ``< 2**61 + 8``."""
    return (x & np.uint64(PRIME)) + (x >> np.uint64(61))


def _mulmod(a: np.ndarray, b: np.ndarray | np.uint64) -> np.ndarray:
    """``a * b mod p`` elementwise for uint64 values below ``2**61`` (reduced to ``[0, p)``):
    32-bit halves, so every partial product fits in 64 bits. With ``2**61 = 1 (mod p)``:
    ``a1*b1*2**64 = 8*a1*b1`` and a middle term ``mid*2**32 = (mid >> 29) + (mid mod 2**29)*2**32``."""
    m32, s32 = np.uint64(_M32), np.uint64(32)
    a0, a1 = a & m32, a >> s32                        # a1, b1 < 2**29
    b0, b1 = b & m32, b >> s32
    mid = a0 * b1 + a1 * b0                            # < 2**62
    s = (np.uint64(8) * (a1 * b1) + (mid >> np.uint64(29)) + ((mid & np.uint64((1 << 29) - 1)) << s32)
         + _fold(a0 * b0))                             # < 2**61 + 2**33 + 2**61 + 2**61 + 8 < 2**63
    s = _fold(s)
    return np.where(s >= np.uint64(PRIME), s - np.uint64(PRIME), s)


@functools.lru_cache(maxsize=32)
def _powers(seed: int, count: int) -> np.ndarray:
    """``r**1 .. r**count`` mod p of ``seed``'s point (uint64, read-only), by doubling: each step
    multiplies the table so far by its last entry, a vectorised pass instead of a loop per power."""
    r = np.uint64(keys(seed).r)
    table = np.array([r], dtype=np.uint64)
    while len(table) < count:
        table = np.concatenate([table, _mulmod(table, table[-1])])
    table = table[:count]
    table.flags.writeable = False
    return table


def weights(seed: int, elements: int) -> np.ndarray:
    """The polynomial's weights of ``elements`` elements: ``r**(E - t)`` for ``t = 0 .. E - 1``."""
    return _powers(seed, elements)[::-1]


def _nh(words: np.ndarray, nh: np.ndarray) -> np.ndarray:
    """The elements of ``[..., m * B]`` uint64 words (32-bit values): ``[..., 4 * m]`` uint64."""
    m32 = np.uint64(_M32)
    blocks = words.reshape(*words.shape[:-1], -1, NH_WORDS)
    even, odd = blocks[..., 0::2], blocks[..., 1::2]
    with np.errstate(over="ignore"):       # mod 2**64 is the definition
        h1 = (((even + nh[0:NH_WORDS:2]) & m32) * ((odd + nh[1:NH_WORDS:2]) & m32)).sum(axis=-1, dtype=np.uint64)
        h2 = (((even + nh[2:NH_KEY_WORDS:2]) & m32) * ((odd + nh[3:NH_KEY_WORDS:2]) & m32)).sum(axis=-1,
                                                                                              dtype=np.uint64)
    s32 = np.uint64(32)
    elements = np.stack([h1 & m32, h1 >> s32, h2 & m32, h2 >> s32], axis=-1)
    return elements.reshape(*elements.shape[:-2], -1)


def _numpy_checksums(buf: np.ndarray, segment_bytes: int, seed: int) -> tuple[int, ...]:
    """The numpy fallback over every segment of ``buf`` at once (no loop per word)."""
    count = len(buf) // segment_bytes
    if count == 0:
        return ()
    k = keys(seed)
    n = -(-segment_bytes // 4)
    m = max(1, -(-n // NH_WORDS))
    rows = np.zeros((count, 4 * m * NH_WORDS), dtype=np.uint8)   # zero-padded to whole NH blocks
    rows[:, :segment_bytes] = buf[:count * segment_bytes].reshape(count, segment_bytes)
    words = rows.view("<u4").astype(np.uint64)
    e = _nh(words, k.nh)                                           # [count, E], each < 2**32
    w = weights(seed, 4 * m)
    m32, s32 = np.uint64(_M32), np.uint64(32)
    lo = e * (w & m32)                                             # < 2**64
    hi = e * (w >> s32)                                            # < 2**61, times 2**32 below
    # each term e * w mod p (up to a few p), then summed in 32-bit halves so no sum overflows
    term = _fold(lo) + ((hi & np.uint64((1 << 29) - 1)) << s32) + (hi >> np.uint64(29))    # < 2**62 + 2**33
    lo_sum = (term & m32).sum(axis=-1, dtype=np.uint64)            # < E * 2**32
    hi_sum = (term >> s32).sum(axis=-1, dtype=np.uint64)
    return tuple(((int(h) << 32) + int(lo_)) % PRIME for h, lo_ in zip(hi_sum, lo_sum, strict=True))


def _numpy_checksum(seg: np.ndarray, seed: int) -> int:
    return _numpy_checksums(seg, len(seg), seed)[0]
