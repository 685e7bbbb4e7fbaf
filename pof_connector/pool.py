"""The Pool: the one object adapters call.

* :meth:`Pool.lookup` — how many leading pages of a prompt this node can load, and from where
  (its own tiers, a CXL region it shares with other nodes, other nodes' tiers over the fabric
  when ``fabric.enabled``), asking the locality index;
* :meth:`Pool.load` — copy those pages into caller buffers on the I/O threads, layer by layer,
  validating each page; the :class:`LoadHandle` lets the engine wait for one layer at a time;
* :meth:`Pool.store` — write pages into the first tier (moving evicted pages down the tier
  list), then publish them to the index and withdraw the evicted ones.

A pool runs in one of two roles. A ``worker`` owns tiers and heartbeats its node into the index.
A ``client`` (e.g. vLLM's scheduler process, a router) owns nothing; it answers lookups for
``config.node_id`` from the index alone.

Nothing here raises into an engine for a pool failure: an unreachable index answers "no pages",
a page that fails validation is reported in :attr:`LoadHandle.failed`, and every such event is
counted in :attr:`Pool.stats` and logged once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import numpy as np

from pof_connector.config import PofConfig
from pof_connector.fabric import PeerMeta, require_nixl
from pof_connector.index import (
    LOOKUP_ROUNDS,
    MEDIA,
    IndexTimeout,
    IndexUnavailable,
    LocalityIndex,
    Location,
    NodeIdTaken,
    NodeInfo,
    PrefixMatch,
    TierUsage,
    open_index,
)
from pof_connector.keys import PageKey, page_keys
from pof_connector.metrics import PoolStats
from pof_connector.page_reader import PageReader
from pof_connector.pages import PageError, PageSpec, as_array
from pof_connector.tiers import SlotRef, Tier, make_tier

if TYPE_CHECKING:
    from pof_connector.fabric.node import FabricNode
    from pof_connector.fabric.remote_reader import RemoteLoad

log = logging.getLogger(__name__)
T = TypeVar("T")
NODES_MISS_REFRESH_S = 0.05
"""Least age of the node list before an unknown node triggers a refresh."""
Role = Literal["worker", "client"]
INDEX_BATCH = 1000
"""Entries per publish or withdraw call when a node sends many at once (a re-publish)."""
UNWITHDRAWN_MAX = 1 << 16
"""Withdrawals kept for sending again while the index does not take them (see :meth:`Pool._publish`)."""


@dataclass
class Lookup:
    """The answer to "which leading pages of ``keys`` can this node load?".

    ``sources[i]`` is where page ``i`` will be read from, for ``i < pages``. ``elsewhere`` counts,
    per node, leading pages that exist on that node but that this node cannot read (yet):
    routers use it, loaders ignore it.
    """

    keys: list[PageKey]
    sources: list[Location]
    elsewhere: dict[str, int] = field(default_factory=dict)

    @property
    def pages(self) -> int:
        return len(self.sources)

    def per_tier(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.sources:
            out[s.medium] = out.get(s.medium, 0) + 1
        return out


class LoadHandle:
    """Progress of one :meth:`Pool.load`.

    Layers complete in order; after :meth:`wait_layer` returns ``True`` for layer ``l``, segment
    ``l`` of every page not in :attr:`failed` is in its buffer and was validated. A failed page's
    buffer content is undefined: the engine must recompute it.
    """

    def __init__(self, num_pages: int, num_layers: int) -> None:
        self.num_pages = num_pages
        self._layers = [threading.Event() for _ in range(num_layers)]
        self._done = threading.Event()
        self._failed: dict[int, str] = {}
        self._lock = threading.Lock()

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        """Wait until ``layer`` of every page arrived; ``False`` on timeout."""
        return self._layers[layer].wait(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def failed(self) -> dict[int, str]:
        """Page index → reason, for pages the engine must recompute."""
        with self._lock:
            return dict(self._failed)

    def _fail(self, page: int, reason: str) -> None:
        with self._lock:
            self._failed.setdefault(page, reason)

    def _finish(self, reason: str = "aborted") -> None:
        """Release every waiter; pages whose layers did not all arrive count as failed."""
        for i, ev in enumerate(self._layers):
            if not ev.is_set():
                for p in range(self.num_pages):
                    self._fail(p, reason)
                for later in self._layers[i:]:
                    later.set()
                break
        self._done.set()


class Pool:
    def __init__(self, config: PofConfig, spec: PageSpec, namespace: bytes, *, role: Role = "worker",
                 index: LocalityIndex | None = None, meta: dict[str, str] | None = None) -> None:
        self.config = config
        self.spec = spec
        self.namespace = namespace
        self.node_id = config.node_id
        self.role = role
        # Routers turn a prompt into this pool's keys from these (see pof_connector.router.api).
        self.meta = {"namespace": namespace.hex(), "page_tokens": str(spec.page_tokens),
                     "page_bytes": str(spec.page_bytes), **(meta or {})}
        self.stats = PoolStats()
        self._logged: set[str] = set()
        self.tiers: list[Tier] = []
        if role == "worker":
            self.tiers = [make_tier(t, spec, config.runtime_dir) for t in config.tiers]
        self._by_medium = {t.medium: t for t in self.tiers}
        self._broken: set[str] = set()           # media lost while running: never read or written again
        self._fabric: FabricNode | None = None    # None: fabric disabled, or a client (it reads nothing)
        if config.fabric.enabled:
            require_nixl()
            if role == "worker":
                from pof_connector.fabric.node import FabricNode

                self._fabric = FabricNode(config, spec, self.tiers)
                self.meta.update(self._fabric.meta_strings)
        self._peer_metas: dict[str, tuple[dict[str, str], PeerMeta | None]] = {}
        self._next_index_restart = 0.0
        if index is None:
            index = open_index(config, self.node_id if role == "worker" else None)
        self.index = index
        self._index_down_until = 0.0
        self._index_failing = False
        self._index_last_error = ""
        self._republish = False
        self._unwithdrawn: list[tuple[PageKey, Location]] = []     # withdrawals the index did not take
        self._unwithdrawn_lock = threading.Lock()
        self._nodes_cache: tuple[float, dict[str, NodeInfo]] = (0.0, {})
        self._io = ThreadPoolExecutor(config.io_threads, thread_name_prefix="pof-io")
        self._store = ThreadPoolExecutor(1, thread_name_prefix="pof-store")
        self._staging = np.empty(spec.page_bytes, dtype=np.uint8)    # store thread only
        self._spill_buf = np.empty(spec.page_bytes, dtype=np.uint8)  # store thread only
        self._closed = threading.Event()
        self._maintaining = threading.Event()     # a spill-lease upkeep is queued on the store thread
        if self._fabric is not None:
            self._fabric.start(self._peer_meta)
        self._heartbeat_thread: threading.Thread | None = None
        if role == "worker":
            # Registered before the constructor returns (unless the index is down): until then the
            # node is not in the node list and its publishes are dropped, so a page stored at once
            # was invisible to other nodes until the heartbeat thread first ran.
            self._beat()
            self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, name="pof-heartbeat",
                                                      daemon=True)
            self._heartbeat_thread.start()

    # ---- keys --------------------------------------------------------------------------------

    def keys_for(self, tokens: Sequence[int] | np.ndarray, cache_salt: str | None = None) -> list[PageKey]:
        """Keys of the full pages of ``tokens`` in this pool's namespace."""
        return page_keys(self.namespace, tokens, self.spec.page_tokens, cache_salt=cache_salt)

    # ---- lookup ------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[PageKey], *, count: bool = True) -> Lookup:
        """Leading pages of ``keys`` this node can load (own tiers first, then the index).
        ``count=False``: a lookup on behalf of a hit already counted (another TP rank's pages for
        one request): it leaves ``lookups`` and ``hit_pages`` alone."""
        keys = list(keys)
        if count:
            self.stats.add("lookups")
            self.stats.add("lookup_pages", len(keys))
        sources: list[Location | None] = [None] * len(keys)
        own = 0
        while own < len(keys) and (loc := self._find_own(keys[own])) is not None:
            sources[own] = loc
            own += 1
        for key in reversed(keys[:own]):
            self._touch_own(key)       # the prefix head ends most recently used
        elsewhere: dict[str, int] = {}
        start, rounds = 0, 0
        while own < len(keys) and rounds < LOOKUP_ROUNDS:
            matches = self._index_call("lookup", self.index.longest_prefix, keys[start:], default={})
            self._merge(matches, sources, elsewhere, start)
            rounds += 1
            found = next((i for i, s in enumerate(sources) if s is None), len(sources))
            if found == len(keys) or found <= start:
                break
            # The index counts each node's pages from the first key it is asked for, so a chain
            # whose head stayed on one node and whose tail lives on another (spilled, or evicted
            # there and kept here) ends every run where the head's holder stops: ask again from
            # there (one more round trip, only for a partial hit).
            start = found
        run = next((i for i, s in enumerate(sources) if s is None), len(sources))
        result = Lookup(keys, [s for s in sources[:run] if s is not None], elsewhere)
        for medium, n in result.per_tier().items() if count else ():
            self.stats.add("hit_pages", n, tier=medium)
        return result

    def _live_tiers(self) -> list[Tier]:
        return [t for t in self.tiers if t.medium not in self._broken]

    def _find_own(self, key: PageKey) -> Location | None:
        for tier in self._live_tiers():
            ref = tier.find(key, touch=False)
            if ref is not None:
                return Location(self.node_id, tier.medium, ref.slot, ref.generation)
        return None

    def _touch_own(self, key: PageKey) -> None:
        for tier in self._live_tiers():
            if tier.find(key) is not None:
                return

    def _merge(self, matches: dict[str, PrefixMatch], sources: list[Location | None],
               elsewhere: dict[str, int], offset: int = 0) -> None:
        """Fill ``sources[offset + i]`` from page ``i`` of each match this node can read."""
        for node, match in matches.items():
            readable = [self._readable(node, MEDIA[c]) or self._remote_meta(node, MEDIA[c]) is not None
                        for c in range(len(MEDIA))]
            usable = 0
            for i in range(min(match.pages, len(sources) - offset)):
                if not readable[int(match.media[i])]:
                    break
                usable = i + 1
                if sources[offset + i] is None:
                    sources[offset + i] = match.location(i)
            if usable < match.pages:
                elsewhere[node] = max(elsewhere.get(node, 0), offset + match.pages)

    def _readable(self, node: str, medium: str) -> bool:
        """Can this node read ``node``'s ``medium`` tier with plain loads?"""
        if node == self.node_id:
            return True
        mine = self._domains(self.node_id)
        theirs = self._domains(node)
        return medium in mine and mine[medium] == theirs.get(medium)

    def _domains(self, node: str) -> dict[str, str]:
        if node == self.node_id and self.tiers:
            return {t.medium: t.domain for t in self.tiers}
        info = self._node_info(node)
        return {} if info is None else {m: t.domain for m, t in info.tiers.items()}

    def _node_info(self, node: str) -> NodeInfo | None:
        """What ``node`` last reported (from a node list at most a heartbeat old); ``None`` when
        it is not alive in the index."""
        stamp, cache = self._nodes_cache
        age = time.monotonic() - stamp
        # A node we have not heard of yet (the scheduler's lookup may have seen it first) is worth
        # an early refresh: otherwise its pages would be refused as unreachable for up to a second.
        if age > min(1.0, self.config.heartbeat_s) or (node not in cache and age > NODES_MISS_REFRESH_S):
            cache = self._refresh_nodes()
        return cache.get(node)

    def _refresh_nodes(self) -> dict[str, NodeInfo]:
        cache = self._nodes_cache[1]
        nodes = self._index_call("nodes", self.index.nodes, default=None)
        if nodes is not None:
            cache = {n.node_id: n for n in nodes}
            if self._fabric is not None:
                self._fabric.reader.retain(cache)    # peers whose heartbeat expired are dropped
        self._nodes_cache = (time.monotonic(), cache)
        return cache

    def _remote_meta(self, node: str, medium: str, *, in_backoff: bool = False) -> PeerMeta | None:
        """How to read ``node``'s ``medium`` over the fabric; ``None`` when not that way (fabric
        off, our own node, the node publishes no such region, or, unless ``in_backoff``, it failed
        recently: a lookup then does not offer its pages)."""
        if not self.config.fabric.enabled or node == self.node_id:
            return None
        info = self._node_info(node)
        if info is None:
            return None
        memo = self._peer_metas.get(node)
        if memo is None or memo[0] is not info.meta:
            memo = (info.meta, PeerMeta.from_meta(info.meta))    # decoded once per node list
            self._peer_metas[node] = memo
        meta = memo[1]
        if meta is None or medium not in meta.regions:
            return None
        if not in_backoff and self._fabric is not None and not self._fabric.reader.usable(node):
            return None
        return meta

    def _peer_meta(self, node: str) -> PeerMeta | None:
        """What ``node`` publishes for the fabric now; ``None`` when it is not alive or publishes none."""
        info = self._node_info(node)
        return None if info is None else PeerMeta.from_meta(info.meta)

    def _fetch_remote(self, keys: list[PageKey], sources: list[Location]) -> tuple[RemoteLoad | None, dict[int, int]]:
        """Start fetching, in one batch, the pages of ``sources`` that only the fabric reaches (see
        :mod:`pof_connector.fabric.remote_reader`). Returns the load in flight (``None`` when no
        page needs the fabric) and, per such page index, its position in that load."""
        if self._fabric is None:
            return None, {}
        picked: list[int] = []
        metas: list[PeerMeta] = []
        for i, src in enumerate(sources):
            if src.node == self.node_id or self._readable(src.node, src.medium):
                continue
            meta = self._remote_meta(src.node, src.medium, in_backoff=True)
            if meta is not None:
                picked.append(i)
                metas.append(meta)
        if not picked:
            return None, {}
        load = self._fabric.reader.start([keys[i] for i in picked], [sources[i] for i in picked], metas)
        return load, {i: pos for pos, i in enumerate(picked)}

    # ---- load --------------------------------------------------------------------------------

    def load(self, keys: Sequence[PageKey], sources: Sequence[Location], into: Sequence[Any]) -> LoadHandle:
        """Start copying page ``i`` of ``keys`` from ``sources[i]`` into ``into[i]`` (a writable
        buffer of ``spec.page_bytes``) on an I/O thread. Returns at once; the handle tracks
        progress."""
        if not len(keys) == len(sources) == len(into):
            raise ValueError(f"load: {len(keys)} keys, {len(sources)} sources, {len(into)} buffers")
        handle = LoadHandle(len(keys), self.spec.num_layers)
        if not keys:
            handle._finish()
            return handle
        try:
            self._io.submit(self._load, handle, list(keys), list(sources), list(into))
        except RuntimeError:    # executor shut down: the pool is closing
            handle._finish("closed")
        return handle

    def _load(self, handle: LoadHandle, keys: list[PageKey], sources: list[Location], into: list[Any]) -> None:
        """The I/O-thread flavour of a :class:`PageReader` read: each layer of each page is copied
        into its buffer and checked, and the handle releases a layer once every page has it."""
        spec = self.spec
        reader: PageReader | None = None
        try:
            pages = [as_array(buf) for buf in into]
            reader = PageReader(self, keys, sources, headers=[p[:spec.header_bytes] for p in pages])
            for layer in range(spec.num_layers):
                for i, page in enumerate(pages):
                    seg = reader.segment(i, layer)
                    if seg is not None:
                        np.copyto(spec.segment(page, layer), seg)
                        reader.check(i, layer)
                for i, reason in reader.failed.items():
                    handle._fail(i, reason)
                handle._layers[layer].set()
        except Exception as e:   # a bug or a broken buffer: fail this load loudly, keep the engine alive
            self._log_once("load-crash", logging.ERROR, "pof: load failed unexpectedly; pages will be recomputed",
                           exc_info=e)
            self.stats.add("load_failures", len(keys), reason="error")
        finally:
            if reader is not None:
                reader.close()
            handle._finish("error")

    def _resolve(self, key: PageKey, src: Location) -> tuple[Tier, SlotRef, bool]:
        tier = self._by_medium.get(src.medium)
        if tier is None or src.medium in self._broken:
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
        if not self._readable(src.node, src.medium):
            raise PageError("unreachable", f"{src.node}'s {src.medium} is not shared with this node")
        return tier, SlotRef(src.slot, src.generation), False

    def _drop_if_corrupt(self, key: PageKey, src: Location, err: PageError, ref: SlotRef, own: bool) -> None:
        """A page of ours that fails its checksums is garbage: forget it so nobody is offered it
        again (a stale or evicted page is merely gone and needs nothing). ``ref`` is the slot the
        read copied from; ``own``: a page of our books (else a slot of ours another node wrote)."""
        if err.reason not in ("bad_checksum", "bad_header") or src.node != self.node_id:
            return
        tier = self._by_medium.get(src.medium)
        if tier is None:
            return
        if own:
            gone = tier.remove(key, slot=ref.slot)     # only that copy: the key may be stored anew elsewhere
            if gone is not None:
                self._index_call("withdraw", self.index.withdraw,
                                 [(key, Location(self.node_id, src.medium, gone.slot, gone.generation))], default=None)
        elif tier.is_lent(ref.slot):
            # Spilled into a slot we lent and published as ours: the writer's entry leads only to
            # misses. The slot stays the writer's until its lease ends.
            self._index_call("withdraw", self.index.withdraw, [(key, src)], default=None)

    def _count_load_failure(self, err: PageError) -> None:
        self.stats.add("load_failures", reason=err.reason)
        self._log_once(f"load-{err.reason}", logging.WARNING,
                       "pof: rejected a page (%s); it will be recomputed. Further rejections are counted in "
                       "pof_load_failures_total", err)

    def open_read(self, keys: Sequence[PageKey], sources: Sequence[Location]) -> PageReader:
        """Start a zero-copy read on the caller's thread (see :mod:`pof_connector.page_reader`);
        only for sources this node maps. Close the reader when done."""
        if len(keys) != len(sources):
            raise ValueError(f"open_read: {len(keys)} keys, {len(sources)} sources")
        return PageReader(self, list(keys), list(sources))

    # ---- store -------------------------------------------------------------------------------

    def store(self, items: Sequence[tuple[PageKey, Sequence[Any]]]) -> Future[int]:
        """Write pages (key, per-layer segments in canonical layout) in the background.

        The segment buffers must stay unchanged until the future completes. The result is the
        number of pages written (keys already stored are skipped).
        """
        if not self.tiers:
            raise RuntimeError("a client pool has no tiers to store into")
        return self._store.submit(self._store_batch, list(items))

    def flush(self) -> None:
        """Wait until every store submitted so far is written and published."""
        self._store.submit(lambda: None).result()

    def contains(self, key: PageKey) -> bool:
        """True when this node stores (or is storing) ``key``: storing it again is pointless."""
        return any(t.contains(key) for t in self._live_tiers())

    def _store_batch(self, items: list[tuple[PageKey, Sequence[Any]]]) -> int:
        events: list[tuple[bool, PageKey, Location]] = []
        live = self._live_tiers()
        if not live:
            return 0
        first = live[0]
        level = self.tiers.index(first)
        written = 0
        try:
            # Tail pages first: LRU then evicts a chain from its end and keeps the shared head longest.
            for key, layers in reversed(items):
                if self.contains(key):
                    continue
                self._make_room(level, events)
                got = first.prepare_store(key)
                if got is None:
                    continue
                ref, evicted = got
                if evicted is not None:
                    events.append((False, evicted, Location(self.node_id, first.medium, ref.slot, ref.generation - 1)))
                    self.stats.add("evicted_pages", tier=first.medium)
                ok = False
                try:
                    first.write(ref, key, layers)
                    ok = True
                finally:
                    first.complete_store(key, ok)
                events.append((True, key, Location(self.node_id, first.medium, ref.slot, ref.generation)))
                self.stats.add("stored_pages", tier=first.medium)
                self.stats.add("stored_bytes", self.spec.page_bytes, tier=first.medium)
                written += 1
        finally:
            self._complete_spills(events)
            self._publish(events)
        return written

    def _make_room(self, level: int, events: list[tuple[bool, PageKey, Location]]) -> None:
        """Free one slot of ``tiers[level]`` by moving its LRU page to the next tier (or dropping it)."""
        tier = self.tiers[level]
        if tier.free_slots > 0:
            return
        victim = tier.lru_victim()
        if victim is None:
            return
        key, ref = victim
        if level + 1 < len(self.tiers) and self.tiers[level + 1].medium not in self._broken:
            lower = self.tiers[level + 1]
            try:
                tier.read(ref, key, self._staging)
                self._make_room(level + 1, events)
                got = lower.prepare_store(key)
                if got is not None:
                    ref2, evicted2 = got
                    if evicted2 is not None:
                        events.append((False, evicted2, Location(self.node_id, lower.medium, ref2.slot,
                                                                 ref2.generation - 1)))
                        self.stats.add("evicted_pages", tier=lower.medium)
                    ok = False
                    try:
                        lower.write_page(ref2, self._staging)
                        ok = True
                    finally:
                        lower.complete_store(key, ok)
                    events.append((True, key, Location(self.node_id, lower.medium, ref2.slot, ref2.generation)))
                    self.stats.add("demoted_pages", tier=tier.medium)
            except PageError as e:
                self._log_once("demote", logging.WARNING, "pof: could not move a page down a tier: %s", e)
        elif level + 1 == len(self.tiers) and self._fabric is not None and self._fabric.writer is not None:
            self._spill(tier, key, ref, events)
        removed = tier.remove(key)
        if removed is not None:
            events.append((False, key, Location(self.node_id, tier.medium, removed.slot, removed.generation)))
            self.stats.add("evicted_pages", tier=tier.medium)

    def _spill(self, tier: Tier, key: PageKey, ref: SlotRef, events: list[tuple[bool, PageKey, Location]]) -> None:
        """The last tier is full: write its LRU page into a slot another node grants (see
        :mod:`pof_connector.fabric.spill_writer`) instead of dropping it. Any failure drops it."""
        assert self._fabric is not None and self._fabric.writer is not None
        writer = self._fabric.writer
        target = writer.choose(self._node_info_all().values(), [t.medium for t in self.tiers])
        if target is None:
            self.stats.add("spill_failures", reason="no_target")
            return
        if writer.pending >= writer.batch_limit:
            self._complete_spills(events)
        try:
            # Its own buffer: the caller may hold a page being demoted in self._staging.
            tier.read(ref, key, self._spill_buf)
            writer.prepare_spill(key, self._spill_buf, target)
        except PageError as e:
            self._count_spill_failure(e)

    def _complete_spills(self, events: list[tuple[bool, PageKey, Location]]) -> None:
        """Write the pages staged by :meth:`_spill` (one WRITE per owner) and queue their publication."""
        if self._fabric is None or self._fabric.writer is None or not self._fabric.writer.pending:
            return
        for key, got in self._fabric.writer.complete_spills():
            if isinstance(got, PageError):
                self._count_spill_failure(got)
            else:
                events.append((True, key, got))
                self.stats.add("spilled_pages", tier=got.medium)

    def _count_spill_failure(self, err: PageError) -> None:
        self.stats.add("spill_failures", reason=err.reason)
        self._log_once(f"spill-{err.reason}", logging.WARNING, "pof: could not spill a page (%s); it is dropped "
                       "and recomputed when needed. Further failures are counted in pof_spill_failures_total", err)

    def _node_info_all(self) -> dict[str, NodeInfo]:
        """Live nodes, from a node list at most a heartbeat old."""
        stamp, cache = self._nodes_cache
        if time.monotonic() - stamp > min(1.0, self.config.heartbeat_s):
            cache = self._refresh_nodes()
        return cache

    def _maintain_spill(self) -> None:
        """On the store thread (the spill writer's only thread): renew leases, withdraw lost pages."""
        self._maintaining.clear()
        if self._fabric is not None and self._fabric.writer is not None:
            ended = self._fabric.writer.maintain()
            if ended:
                self._index_call("withdraw", self.index.withdraw, ended, default=None)

    def _republish_spilled(self) -> None:
        """After an index restart or outage: the pages this node spilled are published again."""
        if self._fabric is not None and self._fabric.writer is not None:
            entries = self._fabric.writer.entries()
            if self._send_in_batches("publish", self.index.publish, entries) < len(entries):
                self._republish = True

    def _publish(self, events: list[tuple[bool, PageKey, Location]]) -> None:
        """Send (publish?, key, location) events; within a batch only the last per key and medium
        counts (a page may be stored and then evicted by the same batch)."""
        final: dict[tuple[PageKey, str, str], tuple[bool, Location]] = {}
        for pub, key, loc in events:
            final[(key, loc.node, loc.medium)] = (pub, loc)
        out = [(k, loc) for (k, _, _), (pub, loc) in final.items() if not pub]
        put = [(k, loc) for (k, _, _), (pub, loc) in final.items() if pub]
        if out and self._index_call("withdraw", self.index.withdraw, out, default=False) is False:
            with self._unwithdrawn_lock:
                # Sent again by the heartbeat. Past the cap (a long outage) the oldest are given up:
                # a stale record costs a failed load (its generation does not match), never a wrong page.
                self._unwithdrawn = (self._unwithdrawn + out)[-UNWITHDRAWN_MAX:]
        if put and self._index_call("publish", self.index.publish, put, default=False) is False:
            self._republish = True            # the heartbeat publishes everything again

    # ---- node liveness -----------------------------------------------------------------------

    def node_info(self) -> NodeInfo:
        tiers = {t.medium: TierUsage(t.capacity_slots * t.slot_bytes, t.free_slots * t.slot_bytes, t.domain)
                 for t in self._live_tiers()}
        for t in self.tiers:
            self.stats.set_gauge("tier_used_bytes", t.used_slots * t.slot_bytes, tier=t.medium)
            self.stats.set_gauge("tier_capacity_bytes", t.capacity_slots * t.slot_bytes, tier=t.medium)
        meta = self.meta if self._fabric is None else {**self.meta, **self._fabric.lend_meta()}
        return NodeInfo(self.node_id, tiers, meta)

    def heartbeat(self) -> None:
        """One heartbeat: check the tiers, keep the node alive, re-publish when the index asks."""
        self._check_tiers()
        if self._fabric is not None and self._fabric.reader.peers:
            self._refresh_nodes()        # drop connections to peers that left or restarted
        if self._fabric is not None and self._fabric.lender is not None:
            gone = self._fabric.lender.reclaim_expired()
            if gone:         # published by writers as ours; the slots are invalid now
                self._index_call("withdraw", self.index.withdraw, gone, default=None)
        if self._fabric is not None and self._fabric.writer is not None and not self._maintaining.is_set():
            self._maintaining.set()
            try:
                self._store.submit(self._maintain_spill)
            except RuntimeError:         # the store thread is shut down: closing
                pass
        try:
            fresh = self._index_call("heartbeat", self.index.heartbeat, self.node_info(), self.config.node_ttl_s,
                                     default=None)
        except NodeIdTaken as e:
            # Taking the id back would end the other process's registration, which would take it
            # back in turn: every heartbeat a new incarnation and a full re-publish on both.
            self.stats.add("index_errors", op="node_id_taken")
            self._log_once("node-id-taken", logging.ERROR, "pof: %s. Until it stops, this process serves its "
                           "pages only to itself (they are not published)", e)
            return                       # once the id is ours again, a fresh registration re-publishes
        if fresh is None:
            self._restart_embedded_index()
            return
        self._retry_withdraws(fresh)
        if fresh or self._republish:
            self._republish = False
            entries = [(key, Location(self.node_id, t.medium, ref.slot, ref.generation))
                       for t in self._live_tiers() for key, ref in t.stored()]
            if self._send_in_batches("publish", self.index.publish, entries) < len(entries):
                self._republish = True
            if entries:
                log.info("pof: published %d pages to the index (%s)", len(entries),
                         "new registration" if fresh else "after an index outage")
            if self._fabric is not None and self._fabric.writer is not None:
                try:
                    self._store.submit(self._republish_spilled)     # the writer's own thread
                except RuntimeError:     # closing
                    pass

    def _retry_withdraws(self, fresh: bool) -> None:
        """Send again the withdrawals that failed (the index did not answer in time). After a new
        registration they are moot: the old incarnation's records are dead with it."""
        with self._unwithdrawn_lock:
            pending, self._unwithdrawn = self._unwithdrawn, []
        if fresh:
            return
        sent = self._send_in_batches("withdraw", self.index.withdraw, pending)
        if sent < len(pending):
            with self._unwithdrawn_lock:
                self._unwithdrawn = (pending[sent:] + self._unwithdrawn)[-UNWITHDRAWN_MAX:]

    def _send_in_batches(self, op: str, fn: Callable[[list[tuple[PageKey, Location]]], Any],
                         entries: list[tuple[PageKey, Location]]) -> int:
        """Send ``entries`` to the index in batches of :data:`INDEX_BATCH`, stopping at the first
        batch it does not take; returns how many leading entries it took."""
        for start in range(0, len(entries), INDEX_BATCH):
            if self._index_call(op, fn, entries[start:start + INDEX_BATCH], default=False) is False:
                return start
        return len(entries)

    def _check_tiers(self) -> None:
        for tier in self.tiers:
            if tier.medium in self._broken or tier.healthy():
                continue
            self._broken.add(tier.medium)
            self.stats.add("tier_errors", tier=tier.medium)
            entries = [(key, Location(self.node_id, tier.medium, ref.slot, ref.generation))
                       for key, ref in tier.stored()]
            log.error("pof: the %s tier was lost (%s); dropping its %d pages, engines recompute them",
                      tier.medium, getattr(tier, "path", tier.domain), len(entries))
            self._index_call("withdraw", self.index.withdraw, entries, default=None)

    def _restart_embedded_index(self) -> None:
        """The embedded server is this host's to run: if its process died, start it again (every
        5 s at most). Whether it died is asked of its processes (see
        :func:`~pof_connector.index.embedded.embedded_alive`), never concluded from a failed call:
        a server that a busy host makes slow keeps its books, and a second one would split them."""
        if self.config.index_url != "embedded" or time.monotonic() < self._next_index_restart:
            return
        from pof_connector.index.embedded import embedded_alive, restart_embedded

        if embedded_alive(self.config.runtime_dir):
            return                         # slow or frozen, not dead: its calls were counted, they are retried
        self._next_index_restart = time.monotonic() + 5.0
        reason = f"node {self.node_id}: no index server process runs; last error: {self._index_last_error}"
        try:
            started = restart_embedded(self.config.runtime_dir, reason)
        except (OSError, TimeoutError, RuntimeError) as e:
            self._log_once("embedded-restart", logging.ERROR, "pof: could not restart the embedded index: %s", e)
            return
        if started:
            self.stats.add("index_restarts", reason="server_died")
        self._index_down_until = 0.0       # try it at once

    def _beat(self) -> None:
        try:
            self.heartbeat()
        except Exception as e:   # keep heartbeating; a bug here must not silently stop liveness
            self._log_once("heartbeat", logging.ERROR, "pof: heartbeat failed", exc_info=e)

    def _heartbeat_loop(self) -> None:
        while not self._closed.wait(self.config.heartbeat_s):
            self._beat()

    # ---- plumbing ----------------------------------------------------------------------------

    def _index_call(self, op: str, fn: Callable[..., T], *args: Any, default: Any) -> Any:
        """Call the index; on failure count it, log the outage once, back off 1 s, return ``default``."""
        if time.monotonic() < self._index_down_until:
            return default
        try:
            result = fn(*args)
        except IndexUnavailable as e:
            self.stats.add("index_errors", op=op)
            if isinstance(e, IndexTimeout):
                self.stats.add("index_timeouts", op=op)
            self._index_last_error = str(e)
            self._index_down_until = time.monotonic() + 1.0
            if not self._index_failing:
                self._index_failing = True
                log.error("pof: locality index unavailable (%s); serving only what this node finds itself, "
                          "engines recompute the rest%s", e,
                          "; pages published meanwhile are published again once it answers"
                          if self.role == "worker" else "")
            return default
        if self._index_failing:
            self._index_failing = False
            log.warning("pof: locality index reachable again")
        return result

    def report_adapter_error(self, hook: str, err: BaseException) -> None:
        """An engine adapter hit an unexpected error in ``hook`` and fell back to recompute: count it,
        and log it once per hook with its traceback (a bug must be visible, not fatal)."""
        self.stats.add("adapter_errors", hook=hook)
        self._log_once(f"adapter-{hook}", logging.ERROR, "pof: unexpected error in %s; the engine recomputes "
                       "instead (further errors are counted in pof_adapter_errors_total)", hook, exc_info=err)

    def _log_once(self, what: str, level: int, msg: str, *args: Any, exc_info: BaseException | None = None) -> None:
        if what in self._logged:
            return
        self._logged.add(what)
        log.log(level, msg, *args, exc_info=exc_info)

    def close(self) -> None:
        """Stop threads, leave the index, release tiers. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(timeout=5)
        if self._fabric is not None and self._fabric.writer is not None:
            writer = self._fabric.writer
            gone = self._store.submit(writer.close).result()    # the writer's own thread
            if gone:
                self._index_call("withdraw", self.index.withdraw, gone, default=None)
        self._store.shutdown(wait=True)
        self._io.shutdown(wait=True)
        if self._fabric is not None:
            self._fabric.close()
        if self.role == "worker":
            self._index_call("leave", self.index.leave, default=None)
        self.index.close()
        for t in self.tiers:
            t.close()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
