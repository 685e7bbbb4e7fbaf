"""PageKeyCache gives exactly page_keys' keys (digests and places), however prompts share prefixes."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pof_connector.locality.page_key_cache import PageKeyCache
from pof_connector.pages.keys import SEGMENT_PAGES, page_keys

NS = bytes(range(16))


def _same(got: list, want: list) -> None:
    assert [(k.namespace, k.digest, k.place) for k in got] == [(k.namespace, k.digest, k.place) for k in want]


@pytest.mark.parametrize("page", [1, 4, 16])
def test_random_prompts_sharing_prefixes_get_plain_keys(page: int) -> None:
    rnd = random.Random(page)
    cache = PageKeyCache()
    heads = [[rnd.randrange(1 << 32) for _ in range(rnd.randrange(0, 40 * page * SEGMENT_PAGES // 16))]
             for _ in range(5)]
    for _ in range(300):
        tokens = rnd.choice(heads)[:rnd.randrange(0, 1 + 3 * page * SEGMENT_PAGES)]
        tokens = tokens + [rnd.randrange(1 << 32) for _ in range(rnd.randrange(0, 3 * page * SEGMENT_PAGES))]
        if rnd.random() < 0.1 and tokens:
            tokens[rnd.randrange(len(tokens))] ^= 1            # differs from its head somewhere
        salt = rnd.choice([None, None, "tenant-a", "tenant-b"])
        ns = rnd.choice([NS, bytes(16)])
        as_array = rnd.random() < 0.2
        _same(cache(ns, np.array(tokens, dtype=np.int64) if as_array else tokens, page, cache_salt=salt),
              page_keys(ns, tokens, page, cache_salt=salt))


def test_salt_and_namespace_are_part_of_the_key() -> None:
    cache = PageKeyCache()
    tokens = list(range(SEGMENT_PAGES * 4 * 3))
    plain = cache(NS, tokens, 4)
    salted = cache(NS, tokens, 4, cache_salt="s")
    other = cache(bytes(16), tokens, 4)
    assert {k.digest for k in plain}.isdisjoint(k.digest for k in salted)
    _same(other, page_keys(bytes(16), tokens, 4))
    _same(cache(NS, tokens, 4, cache_salt="s"), page_keys(NS, tokens, 4, cache_salt="s"))


def test_bounded_and_still_exact_after_forgetting() -> None:
    cache = PageKeyCache(max_segments=3)
    rnd = random.Random(1)
    prompts = [[rnd.randrange(50000) for _ in range(16 * SEGMENT_PAGES * 2 + 5)] for _ in range(4)]
    for tokens in prompts * 3:
        _same(cache(NS, tokens, 16), page_keys(NS, tokens, 16))
        assert len(cache._kept) <= 3


def test_refuses_what_page_keys_refuses() -> None:
    cache = PageKeyCache()
    with pytest.raises(ValueError):
        cache(NS, [1, 2, 3], 0)
    with pytest.raises(ValueError):
        cache(NS, [1 << 32], 1)
