"""Where this node's pages go: stored into the first tier, the LRU page of a full tier moved
down to the next one (or dropped), and, past the last tier, spilled into a slot another node
grants over the fabric. Everything runs on the one store thread, which is also the spill
writer's only thread; the index learns of each batch once it is written."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from pof_connector.config.tenant_config import DEFAULT_TENANT
from pof_connector.cpu_affinity import unpin
from pof_connector.index import Location
from pof_connector.pages.keys import PageKey
from pof_connector.pages.layout import PageError
from pof_connector.pool.lookup import SourceFinder
from pof_connector.pool.node_parts import NodeParts
from pof_connector.pool.publisher import Event
from pof_connector.tiers import SlotRef, Tier

if TYPE_CHECKING:
    pass

T = TypeVar("T")


class Placement:
    """Stores and moves the pages of ``own``'s tiers; ``fabric``: spills past the last tier
    through its writer (``None``, or no writer: the last tier drops its LRU page)."""

    def __init__(self, parts: NodeParts, finder: SourceFinder) -> None:
        self.spec = parts.spec
        self.node_id = parts.own.node_id
        self.own = parts.own
        self.finder = finder
        self.publisher = parts.publisher
        self.stats = parts.stats
        self.log_once = parts.log_once
        self.fabric = parts.fabric
        self._store = ThreadPoolExecutor(1, thread_name_prefix="pof-store", initializer=unpin)
        self._staging = np.empty(parts.spec.page_bytes, dtype=np.uint8)    # store thread only
        self._spill_buf = np.empty(parts.spec.page_bytes, dtype=np.uint8)  # store thread only
        self._maintaining = threading.Event()     # a spill-lease upkeep is queued on the store thread
        self._balancing = threading.Event()       # a trade of shared-region slots is queued there
        # Pages written under a hold tag and not released yet (store thread only): in their slots,
        # invisible to lookups and to the index, never evicted, until release() says publish or drop.
        self._held: dict[Hashable, list[tuple[Tier, PageKey, SlotRef]]] = {}
        self._held_lock = threading.Lock()     # release_now runs on the caller's thread

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn`` on the store thread (after what is queued). Raises ``RuntimeError`` once closed."""
        return self._store.submit(fn, *args)

    def store(self, items: Sequence[tuple[PageKey, Sequence[Any]]], hold: Hashable | None = None,
              ready: Callable[[], None] | None = None, tenant: str = DEFAULT_TENANT) -> Future[int]:
        return self._store.submit(self._store_batch, list(items), hold, ready, tenant)

    def store_packed(self, items: list[tuple[PageKey, np.ndarray]], tenant: str = DEFAULT_TENANT) -> Future[int]:
        """Store whole pages already packed and checked (copies of another node's pages, read
        through the pool's read path), re-stamped with this node's slot generations."""
        return self._store.submit(self._store_batch, items, None, None, tenant, True)

    def release(self, hold: Hashable, publish: bool) -> Future[int]:
        """Publish (``publish``) or drop the pages stored under ``hold``, after every store queued
        so far; the result is how many pages were published."""
        return self._store.submit(self._release, hold, publish)

    def release_now(self, hold: Hashable) -> int:
        """Make the pages stored under ``hold`` readable by this node at once (its own lookups and
        loads find them when this returns); the index learns of them on the store thread. The
        stores themselves must have completed (:meth:`flush`, or the store future)."""
        with self._held_lock:
            entries = self._held.pop(hold, [])
        events: list[Event] = []
        for tier, key, ref in entries:
            self._commit(tier, key, ref, events)
        if events:
            self._store.submit(self.publisher.publish, events)
        return len(events)

    def flush(self) -> None:
        """Wait until every store submitted so far is written and published."""
        self._store.submit(lambda: None).result()

    def _store_batch(self, items: list[tuple[PageKey, Any]], hold: Hashable | None = None,
                     ready: Callable[[], None] | None = None, tenant: str = DEFAULT_TENANT,
                     packed: bool = False) -> int:
        """Write ``items``, pages of ``tenant``, into the first live tier; with ``hold``, keep them
        unpublished and invisible until :meth:`release` (the pages' evictions are published at once
        all the same). ``ready``: waited for before a segment is read (see :meth:`Pool.store`).
        ``packed``: each item's second part is a whole checked page (:meth:`store_packed`), not
        per-layer segments."""
        if ready is not None:
            ready()
        events: list[Event] = []
        live = self.own.live()
        if not live:
            return 0
        first = live[0]
        level = self.own.all.index(first)
        written = 0
        self._adopt_given(live)
        try:
            # Tail pages first: LRU then evicts a chain from its end and keeps the shared head longest.
            for key, layers in reversed(items):
                if self.own.contains(key):
                    continue
                self._make_room(level, events, tenant)
                write = (functools.partial(first.write_page, page=layers) if packed
                         else functools.partial(_write_layers, first, key, layers))
                if hold is not None:
                    got = self._put_held(first, key, write, hold, events, tenant)
                    written += got
                    if not got:
                        self.stats.add("store_refused_pages", tenant=tenant, tier=first.medium)
                    continue
                if self._put(first, key, write, events, tenant) is None:
                    # Every page it may evict is kept: by readers, by pins, or by other tenants'
                    # quotas (a tenant at its quota with none of its own pages to give).
                    self.stats.add("store_refused_pages", tenant=tenant, tier=first.medium)
                    continue
                self.stats.add("stored_pages", tier=first.medium)
                self.stats.add("stored_bytes", self.spec.page_bytes, tier=first.medium)
                written += 1
        finally:
            self._complete_spills(events)
            self.publisher.publish(events)
        return written

    def _put(self, tier: Tier, key: PageKey, write: Callable[[SlotRef], None], events: list[Event],
             tenant: str = DEFAULT_TENANT) -> Location | None:
        """Prepare a slot of ``tier`` for ``key`` (a page of ``tenant``), ``write`` it, complete the
        store (a failed write leaves no page) and queue the publication; ``None`` when the tier
        takes no page now."""
        got = tier.prepare_store(key, tenant)
        if got is None:
            return None
        ref, evicted = got
        if evicted is not None:
            events.append((False, evicted, Location(self.node_id, tier.medium, ref.slot, ref.generation - 1)))
            self.stats.add("evicted_pages", tier=tier.medium)
        ok = False
        try:
            write(ref)
            ok = True
        finally:
            tier.complete_store(key, ok)
        loc = Location(self.node_id, tier.medium, ref.slot, ref.generation)
        events.append((True, key, loc))
        return loc

    def _put_held(self, tier: Tier, key: PageKey, write: Callable[[SlotRef], None], hold: Hashable,
                  events: list[Event], tenant: str = DEFAULT_TENANT) -> int:
        """:meth:`_put` that leaves the written page pending under ``hold``; 1 when it was written."""
        got = tier.prepare_store(key, tenant)
        if got is None:
            return 0
        ref, evicted = got
        if evicted is not None:
            events.append((False, evicted, Location(self.node_id, tier.medium, ref.slot, ref.generation - 1)))
            self.stats.add("evicted_pages", tier=tier.medium)
        try:
            write(ref)
        except BaseException:
            tier.cancel_store(key)
            raise
        with self._held_lock:
            self._held.setdefault(hold, []).append((tier, key, ref))
        return 1

    def _release(self, hold: Hashable, publish: bool) -> int:
        with self._held_lock:
            entries = self._held.pop(hold, [])
        events: list[Event] = []
        for tier, key, ref in entries:
            if publish:
                self._commit(tier, key, ref, events)
            else:
                tier.cancel_store(key)
                self.stats.add("dropped_pages", tier=tier.medium)
        self.publisher.publish(events)
        return len(events)

    def _commit(self, tier: Tier, key: PageKey, ref: SlotRef, events: list[Event]) -> None:
        """A held page becomes a stored one (unless its tier was lost meanwhile: then dropped)."""
        if self.own.is_broken(tier.medium):
            tier.cancel_store(key)
            return
        tier.complete_store(key, True)
        events.append((True, key, Location(self.node_id, tier.medium, ref.slot, ref.generation)))
        self.stats.add("stored_pages", tier=tier.medium)
        self.stats.add("stored_bytes", self.spec.page_bytes, tier=tier.medium)

    def held(self) -> list[Hashable]:
        """The hold tags with pages not released yet."""
        with self._held_lock:
            return list(self._held)

    def _make_room(self, level: int, events: list[Event], tenant: str = DEFAULT_TENANT) -> None:
        """Free one slot of ``tiers[level]`` for a page of ``tenant`` by moving the page it would
        evict (see :class:`~pof_connector.tiers.slot_table.SlotTable`) to the next live tier, or
        past the last live one spilling it over the fabric (or, without a spill writer, dropping
        it). The moved page stays its own tenant's, and that tenant's quota rules the tier below."""
        tiers = self.own.all
        tier = tiers[level]
        if not tier.needs_room(tenant):
            return
        victim = tier.lru_victim(tenant)
        if victim is None:
            return
        key, ref = victim
        owner = tier.page_tenant(key)
        # A broken tier is stepped over: the next live one takes the page, and with none left the
        # page spills (a lost CXL region must not turn the tier above it into the last stop).
        below = next((i for i in range(level + 1, len(tiers)) if not self.own.is_broken(tiers[i].medium)), None)
        if below is not None:
            lower = tiers[below]
            try:
                tier.read(ref, key, self._staging)
                self._make_room(below, events, owner)
                if self._put(lower, key, lambda ref2: lower.write_page(ref2, self._staging), events,
                             owner) is not None:
                    self.stats.add("demoted_pages", tier=tier.medium)
            except PageError as e:
                self.log_once("demote", logging.WARNING, "pof: could not move a page down a tier: %s", e)
        elif self.fabric is not None and self.fabric.writer is not None:
            self._spill(tier, key, ref, events)
        removed = tier.evict(key)
        if removed is not None:
            events.append((False, key, Location(self.node_id, tier.medium, removed.slot, removed.generation)))
            self.stats.add("evicted_pages", tier=tier.medium)

    def _spill(self, tier: Tier, key: PageKey, ref: SlotRef, events: list[Event]) -> None:
        """The last live tier is full: write its LRU page into a slot another node grants (see
        :mod:`pof_connector.fabric.spill_writer`) instead of dropping it. Any failure drops it."""
        assert self.fabric is not None and self.fabric.writer is not None
        writer = self.fabric.writer
        target = writer.choose(self.finder.all_nodes().values(), [t.medium for t in self.own.all])
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

    def _complete_spills(self, events: list[Event]) -> None:
        """Write the pages staged by :meth:`_spill` (one WRITE per owner) and queue their publication."""
        if self.fabric is None or self.fabric.writer is None or not self.fabric.writer.pending:
            return
        for key, got in self.fabric.writer.complete_spills():
            if isinstance(got, PageError):
                self._count_spill_failure(got)
            else:
                events.append((True, key, got))
                self.stats.add("spilled_pages", tier=got.medium)

    def _count_spill_failure(self, err: PageError) -> None:
        self.stats.add("spill_failures", reason=err.reason)
        self.log_once(f"spill-{err.reason}", logging.WARNING, "pof: could not spill a page (%s); it is dropped "
                      "and recomputed when needed. Further failures are counted in pof_spill_failures_total", err)

    # ---- slots traded with a shared region's other writers, asked for by the heartbeat -------

    def balance_soon(self) -> None:
        """Queue a trade of slots with the other writers of a shared region on the store thread
        (see :mod:`pof_connector.tiers.cxl`), unless one is queued or no tier trades."""
        if any(t.trades for t in self.own.all):
            self._submit_once(self._balancing, self._balance)

    def _balance(self) -> None:
        """On the store thread: give slots to a writer shorter of room; the pages dropped for them
        are withdrawn like evicted ones."""
        self._balancing.clear()
        events: list[Event] = []
        live = self.own.live()
        self._adopt_given(live)
        for tier in live:
            if not tier.trades:
                continue
            _, given, dropped = tier.balance()
            for key, ref in dropped:
                events.append((False, key, Location(self.node_id, tier.medium, ref.slot, ref.generation)))
                self.stats.add("evicted_pages", tier=tier.medium)
            if given:
                self.stats.add("given_slots", given, tier=tier.medium)
        self.publisher.publish(events)

    def _adopt_given(self, live: Sequence[Tier]) -> None:
        for tier in live:
            if tier.trades and (n := tier.adopt_given()):
                self.stats.add("adopted_slots", n, tier=tier.medium)

    # ---- spill upkeep, asked for by the heartbeat --------------------------------------------

    def maintain_spills_soon(self) -> None:
        """Queue a lease upkeep on the store thread (the spill writer's only thread), unless one is queued."""
        if self.fabric is not None and self.fabric.writer is not None:
            self._submit_once(self._maintaining, self._maintain_spill)

    def _submit_once(self, queued: threading.Event, fn: Callable[[], None]) -> None:
        """Queue ``fn`` on the store thread unless ``queued`` says it is queued already (``fn``
        clears it first thing)."""
        if queued.is_set():
            return
        queued.set()
        try:
            self._store.submit(fn)
        except RuntimeError:         # the store thread is shut down: closing
            pass

    def _maintain_spill(self) -> None:
        """On the store thread: renew leases, withdraw lost pages."""
        self._maintaining.clear()
        if self.fabric is not None and self.fabric.writer is not None:
            ended = self.fabric.writer.maintain()
            if ended:
                self.publisher.withdraw(ended)

    def republish_spills_soon(self) -> None:
        """After an index restart or outage: the pages this node spilled are published again (queued
        on the writer's own thread)."""
        if self.fabric is None or self.fabric.writer is None:
            return
        try:
            self._store.submit(self._republish_spilled)
        except RuntimeError:     # closing
            pass

    def _republish_spilled(self) -> None:
        if self.fabric is not None and self.fabric.writer is not None:
            self.publisher.publish_all(self.fabric.writer.entries())

    def close(self) -> None:
        """Drop the pages still held, give back the spilled pages' slots (withdrawing them), then
        stop the store thread once what is queued ran."""
        for hold in self._store.submit(self.held).result():    # after the stores queued so far
            self.release(hold, publish=False)
        if self.fabric is not None and self.fabric.writer is not None:
            gone = self._store.submit(self.fabric.writer.close).result()    # the writer's own thread
            if gone:
                self.publisher.withdraw(gone)
        self._store.shutdown(wait=True)


def _write_layers(tier: Tier, key: PageKey, layers: Sequence[Any], ref: SlotRef) -> None:
    tier.write(ref, key, layers)
