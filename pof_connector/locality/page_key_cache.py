"""A prompt's page keys computed once per shared prefix: what :class:`~pof_connector.locality.locator.Locator`
hashes per lookup.

The keys of a 2,900-token prompt (180 chained SHA-256 digests and their :class:`PageKey` objects)
cost a router lookup about 180 us, though most prompts begin with a system prompt seen before. So
the keys are kept per segment of :data:`~pof_connector.pages.keys.SEGMENT_PAGES` pages, under the
segment's own token bytes and the digest the chain enters it with (the seed for segment 0): a
later prompt that begins with the same tokens walks its segments in the cache and hashes only the
rest.

Exact, not an estimate: a page's chain digest is a function of exactly the prior digest and its
tokens, and a segment's keys (their places included: a segment is its own head) of exactly the
digest before it, its tokens, its position and the namespace, all of which are the cache key.
The least recently used segments are forgotten past ``max_segments``.

A segment is kept the second time it is computed, not the first: most prompts end in a segment no
other prompt has (a question after a shared system prompt), and keeping those (16 keys each, per
request) only churned the cache and the garbage collector, which walked them in every collection
until they were forgotten (issue 42). The first time leaves a hash of the segment's cache key.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from pof_connector.pages.keys import SEGMENT_PAGES, PageKey, _token_bytes, chain_digests, chain_keys, storage_seed

MAX_SEGMENTS = 4096
"""Segments kept at most: ~4 KB each (16 keys and 1 KB of tokens at 16-token pages)."""

_Entry = tuple[bytes, int, bytes | None, int, bytes]
"""(namespace, page tokens, digest entering the segment, segment number, its token bytes)."""


class PageKeyCache:
    """:func:`~pof_connector.pages.keys.page_keys` with the keys of leading segments kept."""

    def __init__(self, max_segments: int = MAX_SEGMENTS) -> None:
        self.max_segments = max_segments
        self._kept: OrderedDict[_Entry, list[PageKey]] = OrderedDict()
        self._seen: OrderedDict[int, None] = OrderedDict()
        """Hashes of segments computed once and not kept (as many as ``max_segments`` at most)."""
        self._lock = threading.Lock()

    def __call__(self, namespace: bytes, tokens: Sequence[int] | np.ndarray, page_tokens: int, *,
                 cache_salt: str | None = None) -> list[PageKey]:
        """The keys of the full pages of ``tokens``: what ``page_keys(namespace, tokens,
        page_tokens, cache_salt=cache_salt)`` returns."""
        if page_tokens <= 0:
            raise ValueError(f"page_tokens must be positive, got {page_tokens}")
        data = _token_bytes(tokens)
        stride = 4 * page_tokens * SEGMENT_PAGES
        whole = len(data) // stride                 # segments of SEGMENT_PAGES full pages
        prior = seed = storage_seed(None, cache_salt)
        keys: list[PageKey] = []
        seg = 0
        with self._lock:
            kept = self._kept
            while seg < whole:
                entry = (namespace, page_tokens, prior, seg, data[seg * stride:(seg + 1) * stride])
                got = kept.get(entry)
                if got is None:
                    break
                kept.move_to_end(entry)
                keys += got
                prior = got[-1].digest
                seg += 1
        # the pages past the kept segments, chained on from the last kept digest (the seed at none)
        rest = chain_keys(namespace, keys, chain_digests(np.frombuffer(data, "<u4", offset=seg * stride),
                                                         page_tokens, prior))
        new = [(seg + i, rest[i * SEGMENT_PAGES:(i + 1) * SEGMENT_PAGES]) for i in range(whole - seg)]
        if new:
            with self._lock:
                before = keys[-1].digest if keys else seed
                seen = self._seen
                for s, got in new:
                    entry = (namespace, page_tokens, before, s, data[s * stride:(s + 1) * stride])
                    mark = hash(entry)
                    if mark in seen:
                        del seen[mark]
                        self._kept[entry] = got
                    else:
                        seen[mark] = None
                    before = got[-1].digest
                while len(self._kept) > self.max_segments:
                    self._kept.popitem(last=False)
                while len(seen) > self.max_segments:
                    seen.popitem(last=False)
        return keys + rest
