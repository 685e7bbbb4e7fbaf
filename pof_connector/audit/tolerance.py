"""How far a recomputed page may be from the pool's copy and still be the same KV.

The same model computes a prefix's K and V slightly differently in another batch (other matrix
shapes, other kernel blockings, bf16 rounding on CPUs with AMX and on GPUs), so an audit cannot
ask for equal bytes. It asks for a small **normalised error**: per layer and KV head,
``max |engine - pool| / max |engine|``, and takes the largest over the page. Rounding moves that
by a few units of the dtype's last place; any real fault (another prefix's KV, a stale or never
filled page, swapped layers or heads) moves it to the order of 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
WORST = 1e9
"""The error reported where a page holds a NaN or infinity the engine's KV does not."""


def as_floats(segment: np.ndarray, dtype: str) -> np.ndarray | None:
    """A segment's bytes as float32 values (``None``: not a float dtype we compare numerically)."""
    raw = np.ascontiguousarray(segment).view(np.uint8)
    dtype = dtype.removeprefix("torch.")
    if dtype == "float32":
        return raw.view(np.float32)
    if dtype == "float16":
        return raw.view(np.float16).astype(np.float32)
    if dtype == "bfloat16":      # numpy has no bfloat16: its 16 bits are a float32's upper half
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return None


def normalised_error(engine: np.ndarray, pool: np.ndarray, dtype: str, heads: int = 1, head_dim: int = 0) -> float:
    """``max |engine - pool| / max |engine|`` per KV head of a canonical ``[K/V, tokens, heads,
    head_dim]`` segment, the largest over the heads (``head_dim`` 0: the segment as one head).
    For a dtype that is not a float: 0 when the bytes are equal, else 1."""
    a, b = as_floats(engine, dtype), as_floats(pool, dtype)
    if a is None or b is None or a.size != b.size:
        same = np.array_equal(np.asarray(engine).view(np.uint8), np.asarray(pool).view(np.uint8))
        return 0.0 if same else 1.0
    if head_dim <= 0 or a.size % (heads * head_dim):
        heads, head_dim = 1, a.size
    a, b = a.reshape(-1, heads, head_dim), b.reshape(-1, heads, head_dim)
    with np.errstate(invalid="ignore", over="ignore"):
        finite = np.isfinite(a)
        delta = np.abs(a - b)
        if not np.isfinite(delta).all():
            if (~np.isfinite(delta) & finite).any():
                return WORST
            delta = np.where(finite, delta, 0.0)
        scale = np.abs(np.where(finite, a, 0.0)).max(axis=(0, 2))
        worst = delta.max(axis=(0, 2))
    tiny = float(np.finfo(np.float32).tiny)
    per_head = np.where(scale > tiny, worst / np.maximum(scale, tiny), np.where(worst > 0, 1.0, 0.0))
    return float(min(WORST, per_head.max(initial=0.0)))


def page_errors(engine: Sequence[np.ndarray], pool: Sequence[np.ndarray], dtype: str, heads: int = 1,
                head_dim: int = 0) -> list[float]:
    """:func:`normalised_error` of each layer."""
    return [normalised_error(e, p, dtype, heads, head_dim) for e, p in zip(engine, pool, strict=True)]


def classify(engine: Sequence[np.ndarray], pool: Sequence[np.ndarray], errors: Sequence[float], bound: float,
             dtype: str, heads: int = 1, head_dim: int = 0) -> str:
    """What a mismatched page looks like, for the operator: ``unfilled`` (a layer of the pool's
    page is all zero bytes: staging that was never written), ``layers_swapped`` (a layer of the
    pool's page matches another layer of the engine's), else ``values``."""
    for layer, err in enumerate(errors):
        if err > bound and not np.asarray(pool[layer]).view(np.uint8).any():
            return "unfilled"
    for layer, err in enumerate(errors):
        if err <= bound:
            continue
        for other, seg in enumerate(engine):
            if other != layer and normalised_error(seg, pool[layer], dtype, heads, head_dim) <= bound:
                return "layers_swapped"
    return "values"
