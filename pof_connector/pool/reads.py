"""Reading pages for an engine: the :class:`~pof_connector.pool.page_reader.PageSource` the page reader
reads through (which tier and slot a source is, what only the fabric reaches, what to forget when
a page of ours is corrupt), and the two ways in: a zero-copy :class:`PageReader` on the caller's
thread, a :class:`LoadHandle` filled on the I/O threads."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from pof_connector.fabric import PeerMeta
from pof_connector.index import Location
from pof_connector.metrics import PoolStats
from pof_connector.pages.keys import PageKey
from pof_connector.pages.layout import PageError, PageSpec, as_array
from pof_connector.pool.load_handle import LoadHandle, copy_layers, finished
from pof_connector.pool.lookup import SourceFinder
from pof_connector.pool.node_parts import NodeParts
from pof_connector.pool.page_reader import PageReader
from pof_connector.tiers import SlotRef, Tier

if TYPE_CHECKING:
    from pof_connector.fabric.remote_reader import RemoteLoad


class Reads:
    """Reads of node ``own.node_id`` (a client's pool has no tiers: every read fails "unreachable")."""

    def __init__(self, parts: NodeParts, finder: SourceFinder) -> None:
        self._parts = parts
        self._spec = parts.spec
        self._stats = parts.stats
        self.node_id = parts.own.node_id
        self.own = parts.own
        self.finder = finder
        self.publisher = parts.publisher
        self.log_once = parts.log_once
        self.fabric = parts.fabric
        self._io = ThreadPoolExecutor(parts.config.io_threads, thread_name_prefix="pof-io")

    @property
    def spec(self) -> PageSpec:
        return self._spec

    @property
    def stats(self) -> PoolStats:
        return self._stats

    def open_read(self, keys: Sequence[PageKey], sources: Sequence[Location]) -> PageReader:
        if len(keys) != len(sources):
            raise ValueError(f"open_read: {len(keys)} keys, {len(sources)} sources")
        return PageReader(self, list(keys), list(sources))

    def load(self, keys: Sequence[PageKey], sources: Sequence[Location], into: Sequence[Any]) -> LoadHandle:
        if not len(keys) == len(sources) == len(into):
            raise ValueError(f"load: {len(keys)} keys, {len(sources)} sources, {len(into)} buffers")
        handle = LoadHandle(len(keys), self._spec.num_layers)
        if not keys:
            return finished(handle)
        try:
            self._io.submit(self._load, handle, list(keys), list(sources), list(into))
        except RuntimeError:    # executor shut down: the pool is closing
            finished(handle, "closed")
        return handle

    def _load(self, handle: LoadHandle, keys: list[PageKey], sources: list[Location], into: list[Any]) -> None:
        spec = self._spec
        reader: PageReader | None = None
        try:
            pages = [as_array(buf) for buf in into]
            reader = PageReader(self, keys, sources, headers=[p[:spec.header_bytes] for p in pages])
            copy_layers(handle, reader, pages, spec)
        except Exception as e:   # a bug or a broken buffer: fail this load loudly, keep the engine alive
            self.log_once("load-crash", logging.ERROR, "pof: load failed unexpectedly; pages will be recomputed",
                          exc_info=e)
            self._stats.add("load_failures", len(keys), reason="error")
        finally:
            if reader is not None:
                reader.close()
            finished(handle, "error")

    def close(self) -> None:
        """Wait for the loads in flight; later ones finish at once as "closed"."""
        self._io.shutdown(wait=True)

    # ---- PageSource --------------------------------------------------------------------------

    def fetch_remote(self, keys: list[PageKey], sources: list[Location]) -> tuple[RemoteLoad | None, dict[int, int]]:
        """Start fetching, in one batch, the pages of ``sources`` that only the fabric reaches (see
        :mod:`pof_connector.fabric.remote_reader`). Returns the load in flight (``None`` when no
        page needs the fabric) and, per such page index, its position in that load."""
        if self.fabric is None:
            return None, {}
        picked: list[int] = []
        metas: list[PeerMeta] = []
        for i, src in enumerate(sources):
            if src.node == self.node_id or self.finder.readable(src.node, src.medium):
                continue
            meta = self.finder.remote_meta(src.node, src.medium, in_backoff=True)
            if meta is not None:
                picked.append(i)
                metas.append(meta)
        if not picked:
            return None, {}
        load = self.fabric.reader.start([keys[i] for i in picked], [sources[i] for i in picked], metas)
        return load, {i: pos for pos, i in enumerate(picked)}

    def resolve(self, key: PageKey, src: Location) -> tuple[Tier, SlotRef, bool]:
        tier = self.own.get(src.medium)
        if tier is None or self.own.is_broken(src.medium):
            raise PageError("unreachable", f"this node has no usable {src.medium} tier")
        if src.node == self.node_id:
            ref = tier.find(key, pin=True)
            if ref is not None:
                return tier, ref, True
            if tier.is_lent(src.slot):
                # Another node spilled the page into a slot we lent it and published it as ours:
                # not in our books, read like a shared slot (header, generation, checksums); a
                # lease that ends meanwhile bumps the generation first, so the read then misses.
                return tier, SlotRef(src.slot, src.generation), False
            raise PageError("evicted", f"{key.hex()} is no longer in {src.medium}")
        if not self.finder.readable(src.node, src.medium):
            raise PageError("unreachable", f"{src.node}'s {src.medium} is not shared with this node")
        return tier, SlotRef(src.slot, src.generation), False

    def drop_if_corrupt(self, key: PageKey, src: Location, err: PageError, ref: SlotRef, own: bool) -> None:
        """A page of ours that fails its checksums is garbage: forget it so nobody is offered it
        again (a stale or evicted page is merely gone and needs nothing). ``ref`` is the slot the
        read copied from; ``own``: a page of our books (else a slot of ours another node wrote)."""
        if err.reason not in ("bad_checksum", "bad_header") or src.node != self.node_id:
            return
        tier = self.own.get(src.medium)
        if tier is None:
            return
        if own:
            self._parts.drop_own(key, src.medium, ref.slot)
        elif tier.is_lent(ref.slot):
            # Spilled into a slot we lent and published as ours: the writer's entry leads only to
            # misses. The slot stays the writer's until its lease ends.
            self.publisher.withdraw([(key, src)])

    def count_load_failure(self, err: PageError) -> None:
        self._stats.add("load_failures", reason=err.reason)
        self.log_once(f"load-{err.reason}", logging.WARNING,
                      "pof: rejected a page (%s); it will be recomputed. Further rejections are counted in "
                      "pof_load_failures_total", err)
