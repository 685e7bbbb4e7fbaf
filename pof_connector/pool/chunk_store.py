"""Whole KV chunks of an engine-side cache (LMCache's) kept as pof pages.

An LMCache chunk is one array ``[kv, layers, tokens, hidden]`` (``kv`` = 2 for K and V, 1 for an
MLA latent) keyed by LMCache's own chunk hash. :class:`ChunkStore` stores it as one pof page of
``layers`` segments, segment ``l`` being ``chunk[:, l]`` — K then V of layer ``l``, each
``[tokens, hidden]``: pof's canonical MHA segment — so the page carries pof's header, per-layer
checksums and generation, lives in pof's tiers and is published in pof's locality index like any
other page. Loading copies each layer straight from tier memory (or the fabric's staging) into the
caller's array and checks it (:class:`~pof_connector.pool.page_reader.PageReader`): one copy, and a
chunk that fails any check is a miss.

Keys (:func:`chunk_key`): the namespace is a digest of everything that makes a chunk's bytes
differ for the same hash (model, world size, worker rank, dtype, chunk geometry — the page's
:class:`~pof_connector.pages.layout.PageSpec`, layers included — the operator's ``namespace`` and the
cache's tags, e.g. a tenant), the digest is a sha256 of the chunk hash. The
chunk hash is the engine cache's: a pof page key of vLLM or SGLang (a chain over token ids) can
never equal it, so these pages live beside native ones and are never mistaken for them.

Nothing here imports an engine or torch: arrays are numpy ``uint8`` views that the adapter makes.
No method raises for a pool failure: misses and ``False`` instead, counted in the pool's stats.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from pof_connector.pages.keys import Namespace, PageKey
from pof_connector.pages.layout import KIND_MHA, KIND_MLA, PageSpec
from pof_connector.pool.pool import Pool
from pof_connector.pool.staging import StagingPool

log = logging.getLogger("pof_connector.chunk_store")     # its name before the move to pool/: filters keep working

_DIGEST_TAG = b"pof-lmcache-chunk-v1"


@dataclass(frozen=True)
class ChunkGeometry:
    """The shape of one full chunk: ``[kv, layers, tokens, hidden_bytes]`` as bytes."""

    kv: int
    layers: int
    tokens: int
    hidden_bytes: int

    def __post_init__(self) -> None:
        if self.kv not in (1, 2):
            raise ValueError(f"kv must be 1 (MLA) or 2 (K and V), got {self.kv}")
        if min(self.layers, self.tokens, self.hidden_bytes) < 1:
            raise ValueError(f"chunk geometry must be positive: {self}")

    @property
    def spec(self) -> PageSpec:
        return PageSpec(self.layers, self.kv * self.tokens * self.hidden_bytes, self.tokens,
                        KIND_MHA if self.kv == 2 else KIND_MLA)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.kv, self.layers, self.tokens, self.hidden_bytes)

    @property
    def layout(self) -> str:
        return f"lmcache:kv={self.kv}:hidden_bytes={self.hidden_bytes}"


@dataclass(frozen=True)
class ChunkOwner:
    """Who a chunk belongs to: the fields of an LMCache ``CacheEngineKey`` other than its hash.
    ``tags``: the cache's tags as sorted ``(name, value)`` pairs (``()``: none)."""

    model: str
    world_size: int
    worker_id: int
    dtype: str
    tags: tuple[tuple[str, str], ...] = ()

    def namespace(self, geometry: ChunkGeometry, extra: str = "") -> bytes:
        """The pof namespace of this owner's chunks; ``extra``: the operator's ``namespace``."""
        tagged = json.dumps([extra, [list(t) for t in self.tags]], separators=(",", ":"))
        return Namespace(self.model, self.dtype, geometry.layout, geometry.spec, self.worker_id,
                         self.world_size, tagged).digest


def chunk_digest(chunk_hash: int) -> bytes:
    """The 32-byte page digest of an engine cache's integer chunk hash (any sign or size)."""
    n = (chunk_hash.bit_length() + 8) // 8 + 1
    return hashlib.sha256(_DIGEST_TAG + chunk_hash.to_bytes(n, "little", signed=True)).digest()


def chunk_key(namespace: bytes, chunk_hash: int) -> PageKey:
    return PageKey(namespace, chunk_digest(chunk_hash))


class ChunkStore:
    """Chunks of one geometry in one pool (the adapter owns the pool and closes it)."""

    def __init__(self, pool: Pool, geometry: ChunkGeometry, *, staging_bytes: int = 256 << 20) -> None:
        if pool.spec != geometry.spec:
            raise ValueError(f"pool pages are {pool.spec}, chunks need {geometry.spec}")
        self.pool = pool
        self.geometry = geometry
        # Page-order copies wait in reused buffers until the pool wrote them (fresh ones fault).
        self.staging = StagingPool(keep_bytes=staging_bytes)

    def count_prefix(self, keys: Sequence[PageKey]) -> int:
        """How many leading chunks of ``keys`` this node can load (its tiers, shared regions,
        other nodes' tiers it reaches), from the locality index; 0 when the index is down."""
        if not keys:
            return 0
        return self.pool.lookup(keys).pages

    def put(self, items: Sequence[tuple[PageKey, np.ndarray]]) -> Future[int]:
        """Store chunks (``uint8`` arrays of :attr:`ChunkGeometry.shape`) in the background.
        The arrays are copied into page order here, so the caller may reuse them at once.
        Keys this node already holds are skipped. The future's result: pages written."""
        g = self.geometry
        for _, chunk in items:
            if chunk.shape != g.shape:
                raise ValueError(f"chunk of shape {chunk.shape}, expected {g.shape}")
        todo: list[tuple[PageKey, list[np.ndarray]]] = []
        bufs: list[np.ndarray] = []
        for key, chunk in items:
            if self.pool.contains(key):
                continue
            buf = self.staging.take(chunk.nbytes)
            bufs.append(buf)
            # [kv, L, T, H] -> [L, kv, T, H]: one copy makes every layer's K|V contiguous.
            by_layer = buf.reshape(g.layers, g.kv, g.tokens, g.hidden_bytes)
            np.copyto(by_layer, chunk.transpose(1, 0, 2, 3))
            todo.append((key, [by_layer[layer].reshape(-1) for layer in range(g.layers)]))
        if not todo:
            done: Future[int] = Future()
            done.set_result(0)
            return done
        try:
            stored = self.pool.store(todo)
        except BaseException:
            for buf in bufs:
                self.staging.give(buf)
            raise
        stored.add_done_callback(lambda _: self._give(bufs))
        return stored

    def _give(self, bufs: list[np.ndarray]) -> None:
        for buf in bufs:
            self.staging.give(buf)

    def get(self, keys: Sequence[PageKey], into: Sequence[np.ndarray]) -> list[bool]:
        """Load chunk ``i`` of ``keys`` into ``into[i]`` (a writable ``uint8`` array of
        :attr:`ChunkGeometry.shape`). ``result[i]`` is ``True`` only when every layer arrived and
        passed its checks; a ``False`` chunk's array holds undefined bytes and must not be used."""
        ok = [False] * len(keys)
        if not keys:
            return ok
        found = self.pool.lookup(keys)
        if not found.pages:
            return ok
        # Each key on its own: a chunk missing in the middle does not hide the ones after it
        # (LMCache asks for runs it already found by prefix, so this is the rare path).
        have = list(range(found.pages))
        sources = list(found.sources)
        for i in range(found.pages, len(keys)):
            one = self.pool.lookup([keys[i]], count=False)
            if one.pages:
                have.append(i)
                sources.append(one.sources[0])
        reader = self.pool.open_read([keys[i] for i in have], sources)
        try:
            for layer in range(self.geometry.layers):
                for j, i in enumerate(have):
                    seg = reader.segment(j, layer)
                    if seg is None:
                        continue
                    dst = into[i][:, layer]
                    np.copyto(dst, seg.reshape(dst.shape))
                    # summed from where the bytes landed (a strided slice of the caller's chunk)
                    reader.check(j, layer, reader.landed_sum(j, np.ascontiguousarray(dst).reshape(-1).view(np.uint8)))
        finally:
            reader.close()
        for j, i in enumerate(have):
            ok[i] = j not in reader.failed
        return ok
