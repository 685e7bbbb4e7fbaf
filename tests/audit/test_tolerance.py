"""The audit's error measure: rounding is small, every kind of wrong KV is large."""

from __future__ import annotations

import numpy as np
import pytest

from pof_connector.audit.tolerance import WORST, as_floats, classify, normalised_error
from pof_connector.config.audit_config import DEFAULT_BOUNDS

HEADS, DIM, TOKENS = 4, 32, 16


def kv(seed: int, dtype: str) -> np.ndarray:
    """A canonical segment ``[2, tokens, heads, dim]`` of KV-like values (heads of different scales), as bytes."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, TOKENS, HEADS, DIM)).astype(np.float32) * rng.uniform(0.1, 8.0, size=(1, 1, HEADS, 1))
    return to_bytes(x.astype(np.float32), dtype)


def to_bytes(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return x.astype(np.float32).view(np.uint8).reshape(-1)
    if dtype == "float16":
        return x.astype(np.float16).view(np.uint8).reshape(-1)
    bits = x.astype(np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)      # round to nearest even
    return rounded.view(np.uint8).reshape(-1)


def err(a: np.ndarray, b: np.ndarray, dtype: str) -> float:
    return normalised_error(a, b, dtype, HEADS, DIM)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_rounding_is_within_the_bound_and_faults_are_far_outside(dtype: str) -> None:
    page = kv(1, dtype)
    x = as_floats(page, dtype)
    assert x is not None
    # The same KV computed in another batch: a relative perturbation of a few units in the last place.
    ulp = {"float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}[dtype]
    noisy = to_bytes((x * (1 + 4 * ulp * np.random.default_rng(2).uniform(-1, 1, x.shape))).reshape(x.shape), dtype)
    assert err(page, page, dtype) == 0.0
    assert err(page, noisy, dtype) <= DEFAULT_BOUNDS[dtype]
    other = kv(3, dtype)                                       # another prefix's KV under this key
    swapped = as_floats(page, dtype).reshape(2, TOKENS, HEADS, DIM)[:, :, [1, 0, 2, 3]].copy()
    for wrong in (other, np.zeros_like(page), to_bytes(swapped, dtype)):
        assert err(page, wrong, dtype) >= 0.3


def test_a_nan_in_the_pool_where_the_engine_has_a_number_is_the_worst_error() -> None:
    page = kv(1, "float32")
    bad = page.copy().view(np.float32)
    bad[5] = np.nan
    assert normalised_error(page, bad.view(np.uint8), "float32") == WORST


def test_a_dtype_without_a_float_view_compares_bytes() -> None:
    a = np.arange(64, dtype=np.uint8)
    assert normalised_error(a, a.copy(), "float8_e4m3fn") == 0.0
    b = a.copy()
    b[3] ^= 1
    assert normalised_error(a, b, "float8_e4m3fn") == 1.0


def test_mismatches_are_named() -> None:
    layers = [kv(i, "bfloat16") for i in range(3)]
    bound = DEFAULT_BOUNDS["bfloat16"]

    def name(pool: list[np.ndarray]) -> str:
        errors = [err(e, p, "bfloat16") for e, p in zip(layers, pool, strict=True)]
        return classify(layers, pool, errors, bound, "bfloat16", HEADS, DIM)

    assert name([layers[0], np.zeros_like(layers[1]), layers[2]]) == "unfilled"
    assert name([layers[1], layers[0], layers[2]]) == "layers_swapped"
    assert name([layers[0], kv(9, "bfloat16"), layers[2]]) == "values"
