"""The Pool: the one object adapters call.

* :meth:`Pool.lookup` — how many leading pages of a prompt this node can load, and from where
  (its own tiers, a CXL region it shares with other nodes, other nodes' tiers over the fabric
  when ``fabric.enabled``), asking the locality index;
* :meth:`Pool.open_read` — a zero-copy, layer-by-layer read of those pages on the caller's
  thread (:class:`~pof_connector.pool.page_reader.PageReader`); :meth:`Pool.load` copies them into
  caller buffers on the I/O threads instead, the :class:`LoadHandle` letting the engine wait for
  one layer at a time; both validate each page;
* :meth:`Pool.store` — write pages into the first tier (moving evicted pages down the tier
  list), then publish them to the index and withdraw the evicted ones.

A pool runs in one of two roles. A ``worker`` owns tiers and heartbeats its node into the index.
A ``client`` (e.g. vLLM's scheduler process, a router) owns nothing; it answers lookups for
``config.node_id`` from the index alone.

Nothing here raises into an engine for a pool failure: an unreachable index answers "no pages",
a page that fails validation is reported in :attr:`LoadHandle.failed`, and every such event is
counted in :attr:`Pool.stats` and logged once.

The pool is a front: each concern lives in a part of its own — :mod:`~pof_connector.pool.lookup`
(what this node can read), :mod:`~pof_connector.pool.reads` (reading it), :mod:`~pof_connector.pool.placement`
(storing, demoting, spilling), :mod:`~pof_connector.pool.publisher` and :mod:`~pof_connector.pool.membership`
(what the index is told, heartbeats), :mod:`~pof_connector.index.guarded` (index calls that
never raise).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from pof_connector.config import PofConfig
from pof_connector.config.tenant_config import DEFAULT_TENANT
from pof_connector.fabric import require_nixl
from pof_connector.index import LocalityIndex, Location, NodeInfo, open_index
from pof_connector.index.guarded import INDEX_BATCH, IndexGuard, LogOnce
from pof_connector.metrics import PoolStats
from pof_connector.pages import page_sum
from pof_connector.pages.keys import PageKey, page_keys
from pof_connector.pages.layout import PageSpec
from pof_connector.pool.load_handle import LoadHandle
from pof_connector.pool.lookup import NODES_MISS_REFRESH_S, Lookup, SourceFinder
from pof_connector.pool.membership import Membership
from pof_connector.pool.node_parts import NodeParts
from pof_connector.pool.own_tiers import OwnTiers
from pof_connector.pool.page_reader import PageReader
from pof_connector.pool.placement import Placement
from pof_connector.pool.publisher import UNWITHDRAWN_MAX, Publisher
from pof_connector.pool.reads import Reads
from pof_connector.tiers import Tier, make_tier

if TYPE_CHECKING:
    from pof_connector.fabric.node import FabricNode

__all__ = ["INDEX_BATCH", "NODES_MISS_REFRESH_S", "UNWITHDRAWN_MAX", "LoadHandle", "Lookup", "Pool", "Role"]

Role = Literal["worker", "client"]

log = logging.getLogger("pof_connector.pool")     # the pool's one logger: filters set on it keep working
_kernel_logged = False


class Pool:
    def __init__(self, config: PofConfig, spec: PageSpec, namespace: bytes, *, role: Role = "worker",
                 index: LocalityIndex | None = None, meta: dict[str, str] | None = None) -> None:
        self.config = config
        self.spec = spec
        self.namespace = namespace
        self.node_id = config.node_id
        self.role = role
        # Routers turn a prompt into this pool's keys from these (see pof_connector.locality.api).
        self.meta = {"namespace": namespace.hex(), "page_tokens": str(spec.page_tokens),
                     "page_bytes": str(spec.page_bytes), **(meta or {})}
        self.stats = PoolStats()
        self.tiers: list[Tier] = []
        if role == "worker":
            _log_kernel()
            self.tiers = [make_tier(t, spec, config.runtime_dir) for t in config.tiers]
            for tier in self.tiers:
                tier.set_quotas(config.tenants.quotas_for(tier.medium))
        self._fabric: FabricNode | None = None    # None: fabric disabled, or a client (it reads nothing)
        if config.fabric.enabled:
            require_nixl()
            if role == "worker":
                from pof_connector.fabric.node import FabricNode

                self._fabric = FabricNode(config, spec, self.tiers)
                self.meta.update(self._fabric.meta_strings)
        if index is None:
            index = open_index(config, self.node_id if role == "worker" else None)
        self.index = index
        log_once = LogOnce()
        self._log_once = log_once
        index.on_refused = self._count_refused
        guard = IndexGuard(self.stats, republishes=role == "worker")
        own = OwnTiers(self.node_id, self.tiers)
        self._own = own
        self._publisher = Publisher(index, guard)
        self._guard = guard
        parts = NodeParts(config, spec, own, index, guard, self._publisher, self.stats, log_once, self._fabric)
        self._parts = parts
        self.finder = SourceFinder(parts)
        """What this node can read, and from where."""
        self._reads = Reads(parts, self.finder)
        self.placement = Placement(parts, self.finder)
        """Stores, demotions and spills (on the one store thread)."""
        self._membership = Membership(parts, self.meta, self.finder, self.placement, self._reads, namespace)
        self._closed = False
        if self._fabric is not None:
            self._fabric.start(self.finder.peer_meta)
        if role == "worker":
            self._membership.start()

    @property
    def fabric(self) -> FabricNode | None:
        """This node's fabric endpoint (NIXL agent, staging, reader, lender, spill writer); ``None``
        when the fabric is disabled or for a client."""
        return self._fabric

    # ---- keys --------------------------------------------------------------------------------

    def keys_for(self, tokens: Sequence[int] | np.ndarray, cache_salt: str | None = None) -> list[PageKey]:
        """Keys of the full pages of ``tokens`` in this pool's namespace."""
        return page_keys(self.namespace, tokens, self.spec.page_tokens, cache_salt=cache_salt)

    # ---- lookup and reads --------------------------------------------------------------------

    def lookup(self, keys: Sequence[PageKey], *, count: bool = True) -> Lookup:
        """Leading pages of ``keys`` this node can load (own tiers first, then the index).
        ``count=False``: a lookup on behalf of a hit already counted (another TP rank's pages for
        one request): it leaves ``lookups`` and ``hit_pages`` alone."""
        return self.finder.lookup(keys, count=count)

    def load(self, keys: Sequence[PageKey], sources: Sequence[Location], into: Sequence[Any]) -> LoadHandle:
        """Start copying page ``i`` of ``keys`` from ``sources[i]`` into ``into[i]`` (a writable
        buffer of ``spec.page_bytes``) on an I/O thread. Returns at once; the handle tracks
        progress."""
        return self._reads.load(keys, sources, into)

    def open_read(self, keys: Sequence[PageKey], sources: Sequence[Location]) -> PageReader:
        """Start a zero-copy read on the caller's thread (see :mod:`pof_connector.pool.page_reader`);
        only for sources this node maps. Close the reader when done."""
        return self._reads.open_read(keys, sources)

    # ---- store -------------------------------------------------------------------------------

    def store(self, items: Sequence[tuple[PageKey, Sequence[Any]]], *, hold: Hashable | None = None,
              ready: Callable[[], None] | None = None, tenant: str = DEFAULT_TENANT) -> Future[int]:
        """Write pages (key, per-layer segments in canonical layout) in the background.

        The segment buffers must stay unchanged until the future completes. The result is the
        number of pages written (keys already stored are skipped). ``hold``: a tag under which the
        written pages wait, unpublished and unreadable, until :meth:`release` (two-phase: an
        engine stores a step's pages before it knows whether that step computed on valid KV);
        ``None``: published as soon as they are written. ``ready``: called on the store thread
        before any segment is read, returns once they hold their bytes (a device-to-host copy
        still in flight when the caller returned); ``None``: they already do. ``tenant``: whose
        pages they are (:meth:`tenant_of` a request's salt), for the tiers' quotas.
        """
        if not self.tiers:
            raise RuntimeError("a client pool has no tiers to store into")
        return self.placement.store(items, hold, ready, tenant)

    def tenant_of(self, cache_salt: str | None) -> str:
        """The tenant a request's salt maps to (see :mod:`pof_connector.config.tenant_config`)."""
        return self.config.tenants.tenant_of(cache_salt)

    def release(self, hold: Hashable, publish: bool) -> Future[int]:
        """Publish or drop the pages stored under ``hold`` (after every store queued so far)."""
        return self.placement.release(hold, publish)

    def release_now(self, hold: Hashable) -> int:
        """Publish the pages stored under ``hold`` and make them readable here before returning
        (the index is told in the background). Only after the store under ``hold`` completed."""
        return self.placement.release_now(hold)

    def flush(self) -> None:
        """Wait until every store submitted so far is written and published."""
        self.placement.flush()

    def withdraw(self, key: PageKey, src: Location) -> None:
        """No node loads ``key`` from ``src`` again (a page found wrong): this node's own copy is
        dropped from its tier, and the index record is withdrawn whoever wrote it."""
        if src.node != self.node_id or not self._parts.drop_own(key, src.medium, src.slot):
            self._publisher.withdraw([(key, src)])

    def contains(self, key: PageKey) -> bool:
        """True when this node stores (or is storing) ``key``: storing it again is pointless."""
        return self._own.contains(key)

    # ---- node liveness -----------------------------------------------------------------------

    def node_info(self) -> NodeInfo:
        """What this node reports in its heartbeat (live tiers' usage, meta); sets the tier gauges."""
        return self._membership.node_info()

    def heartbeat(self) -> None:
        """One heartbeat: check the tiers, keep the node alive, re-publish when the index asks."""
        self._membership.heartbeat()

    # ---- plumbing ----------------------------------------------------------------------------

    def report_adapter_error(self, hook: str, err: BaseException) -> None:
        """An engine adapter hit an unexpected error in ``hook`` and fell back to recompute: count it,
        and log it once per hook with its traceback (a bug must be visible, not fatal)."""
        self.stats.add("adapter_errors", hook=hook)
        self._log_once(f"adapter-{hook}", logging.ERROR, "pof: unexpected error in %s; the engine recomputes "
                       "instead (further errors are counted in pof_adapter_errors_total)", hook, exc_info=err)

    def _count_refused(self, n: int, why: str) -> None:
        """The index client refused ``n`` records (``why``): count them, log once per reason."""
        self.stats.add("index_refused", n, reason=why)
        self._log_once(f"index-refused-{why}", logging.WARNING, "pof: refused %d index record(s) (%s: a corrupt or "
                       "hostile index writer); those pages are misses. Further ones are counted in "
                       "pof_index_refused_total", n, why)

    def close(self) -> None:
        """Stop threads, leave the index, release tiers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._membership.stop()
        self.placement.close()
        self._reads.close()
        if self._fabric is not None:
            self._fabric.close()
        if self.role == "worker":
            self._guard.call("leave", self.index.leave, default=None)
        self.index.close()
        for t in self.tiers:
            t.close()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _log_kernel() -> None:
    """Once per process, which kernel copies this node's pages (a warning for the numpy fallback)."""
    global _kernel_logged
    if not _kernel_logged:
        _kernel_logged = True
        log.log(*page_sum.kernel_line())
