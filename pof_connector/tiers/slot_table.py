"""The books of one tier: which key sits in which slot, LRU order, pins, and whose page it is.
Moves no bytes."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping

from pof_connector.config.tenant_config import DEFAULT_TENANT
from pof_connector.pages.keys import PageKey
from pof_connector.tiers.tenant_books import TenantBooks

KEEP_NONE, KEEP_SOFT, KEEP_HARD = 0, 1, 2
"""What a prefix pin asks of a page (see :meth:`SlotTable.set_keep`): nothing; evict it last; never
evict it."""


class SlotTable:
    """Slot bookkeeping with a two-phase store.

    ``prepare_store`` reserves a slot (evicting the least recently used unpinned page when none is
    free); the page becomes visible to :meth:`lookup` only after ``complete_store(ok=True)``.
    A pinned slot is never evicted nor freed, so a local reader can copy from it safely: a page
    removed while pinned is hidden from :meth:`lookup` at once and its slot is handed back at the
    last :meth:`unpin` (see :meth:`detach`).

    Eviction by tenant (each page carries its tenant in :class:`TenantBooks`): a tenant at its
    quota gives one of its own pages for each new one; a tenant within its quota never loses a
    page to another tenant's store. Otherwise the order is LRU. A page a prefix pin keeps
    (:meth:`set_keep`) is evicted after every other candidate (soft) or not at all (hard).

    The slots themselves may change hands (a shared region's writers trading memory, see
    :mod:`pof_connector.tiers.cxl`): :meth:`give` takes free slots and cold pages' slots out of
    this table, :meth:`adopt` takes slots in. Each page's last use is kept for that
    (:meth:`coldest_age`, :attr:`evicted_age`).
    """

    def __init__(self, slots: Iterable[int]) -> None:
        self._free = list(reversed(list(slots)))
        self._capacity = len(self._free)
        self._ready: OrderedDict[PageKey, int] = OrderedDict()   # LRU order: oldest first
        self._used_at: dict[PageKey, float] = {}     # last use (monotonic s) of each page in _ready
        self.evicted_age: float | None = None
        """How long the page the last store evicted had gone unused (s); ``None``: none evicted yet."""
        self._pending: dict[PageKey, int] = {}
        self._pins: dict[int, int] = {}          # slot -> readers (a plain dict: Counter's __missing__ is Python)
        self._lent: set[int] = set()          # granted to other nodes' writers (fabric spill)
        self._detached: set[int] = set()      # removed, not free yet: pinned, or being invalidated
        self._tenants = TenantBooks()
        self._keep: Callable[[PageKey], int] | None = None
        self._lock = threading.Lock()

    def set_quotas(self, quotas: Mapping[str, int]) -> None:
        """Tenant -> the most slots its pages may take (a tenant not named: unlimited)."""
        with self._lock:
            self._tenants.quotas = dict(quotas)

    def set_keep(self, keep: Callable[[PageKey], int] | None) -> None:
        """``keep(key)``: :data:`KEEP_NONE`, :data:`KEEP_SOFT` or :data:`KEEP_HARD` for a stored page
        (called under this table's lock, on eviction only: it must be fast and take no lock that
        waits for this table)."""
        with self._lock:
            self._keep = keep

    def tenant_use(self) -> dict[str, int]:
        """Slots each tenant's pages take (tenants with none left out)."""
        with self._lock:
            return self._tenants.usage()

    def quotas(self) -> dict[str, int]:
        """Tenant -> slots it may take (tenants not named: unlimited)."""
        with self._lock:
            return dict(self._tenants.quotas)

    def owner(self, key: PageKey) -> str:
        """The tenant of a stored (or being stored) page."""
        with self._lock:
            return self._tenants.owner(key)

    @property
    def capacity(self) -> int:
        with self._lock:
            return self._capacity

    def coldest_age(self, now: float) -> float | None:
        """How long the page a store would evict next has gone unused (s): ``inf`` when a slot is
        free; ``None`` when no page may be evicted."""
        with self._lock:
            if self._free:
                return float("inf")
            key = self._victim(DEFAULT_TENANT)
            return None if key is None else now - self._used_at.get(key, now)

    def unused_for(self, key: PageKey, now: float) -> float | None:
        """How long stored page ``key`` has gone unused (s); ``None``: not stored."""
        with self._lock:
            used = self._used_at.get(key)
            return None if used is None else now - used

    def give(self, n: int, unused_for: float, now: float) -> tuple[list[int], list[tuple[PageKey, int]]]:
        """Take up to ``n`` slots out of this table for good: free ones first, then those of pages
        a store would evict that have gone unused for at least ``unused_for`` s (never a pinned,
        pending, lent or detached one). Returns the slots and the ``(key, slot)`` of each page
        dropped; the caller invalidates every slot before anyone else may write it."""
        with self._lock:
            slots = self._free[len(self._free) - min(n, len(self._free)):]
            del self._free[len(self._free) - len(slots):]
            dropped: list[tuple[PageKey, int]] = []
            while len(slots) < n:
                key = self._victim(DEFAULT_TENANT)
                if key is None or now - self._used_at.get(key, now) < unused_for:
                    break
                slot = self._ready.pop(key)
                self._used_at.pop(key, None)
                self._tenants.drop(key)
                dropped.append((key, slot))
                slots.append(slot)
            self._capacity -= len(slots)
            return slots, dropped

    def adopt(self, slots: Iterable[int]) -> int:
        """Take ``slots`` in as free slots (invalidated by whoever gave them); returns how many."""
        with self._lock:
            got = list(slots)
            self._free.extend(got)
            self._capacity += len(got)
            return len(got)

    @property
    def used(self) -> int:
        with self._lock:
            return len(self._ready) + len(self._pending) + len(self._lent) + len(self._detached)

    @property
    def lent(self) -> int:
        """Slots granted to other nodes (counted in :attr:`used`)."""
        with self._lock:
            return len(self._lent)

    def lend(self, n: int) -> list[int]:
        """Take up to ``n`` free slots out of this table for another node to write (never evicts
        our own pages for it); they stay out of use until :meth:`take_back`."""
        with self._lock:
            got = self._free[len(self._free) - min(n, len(self._free)):]
            del self._free[len(self._free) - len(got):]
            self._lent.update(got)
            return got

    def is_lent(self, slot: int) -> bool:
        with self._lock:
            return slot in self._lent

    def take_back(self, slot: int) -> bool:
        """Return a lent slot to the free list; ``False`` when it was not lent."""
        with self._lock:
            if slot not in self._lent:
                return False
            self._lent.discard(slot)
            self._free.append(slot)
            return True

    def lookup(self, key: PageKey, *, touch: bool = True, pin: bool = False) -> int | None:
        """The slot holding ``key``; ``None`` when it is absent or still being written.

        ``pin`` pins the slot in the same step, so it cannot be evicted before the caller reads.
        """
        with self._lock:
            slot = self._ready.get(key)
            if slot is not None:
                if touch:
                    self._ready.move_to_end(key)
                    self._used_at[key] = time.monotonic()
                    self._tenants.touch(key)
                if pin:
                    self._pins[slot] = self._pins.get(slot, 0) + 1
            return slot

    def contains(self, key: PageKey) -> bool:
        """True when ``key`` is stored or being stored (so storing it again is pointless)."""
        with self._lock:
            return key in self._ready or key in self._pending

    def can_allocate(self, tenant: str = DEFAULT_TENANT) -> bool:
        with self._lock:
            return not self._needs_room(tenant) or self._victim(tenant) is not None

    def needs_room(self, tenant: str = DEFAULT_TENANT) -> bool:
        """Whether a store for ``tenant`` must evict a page first (no free slot, or it is at its quota)."""
        with self._lock:
            return self._needs_room(tenant)

    def _needs_room(self, tenant: str) -> bool:
        return not self._free or self._tenants.at_quota(tenant)

    def prepare_store(self, key: PageKey, tenant: str = DEFAULT_TENANT) -> tuple[int, PageKey | None] | None:
        """Reserve a slot for ``key``, a page of ``tenant``.

        Returns ``(slot, evicted)``, where ``evicted`` is the key whose page was dropped to make
        room (the caller withdraws it from the index), or ``None`` when ``key`` is already
        stored or in flight, or no page may be evicted for it (all pinned or pending, or kept
        for tenants within their quotas, or by hard prefix pins).
        """
        with self._lock:
            if key in self._ready or key in self._pending:
                return None
            evicted = None
            if not self._needs_room(tenant):
                slot = self._free.pop()
            else:
                evicted = self._victim(tenant)
                if evicted is None:
                    return None
                slot = self._ready.pop(evicted)
                used = self._used_at.pop(evicted, None)
                self.evicted_age = None if used is None else time.monotonic() - used
                self._tenants.drop(evicted)
            self._pending[key] = slot
            self._tenants.reserve(key, tenant)
            return slot, evicted

    def pending_slot(self, key: PageKey) -> int | None:
        """The slot reserved for ``key`` by :meth:`prepare_store` and not completed yet; ``None``:
        no store of ``key`` is in flight."""
        with self._lock:
            return self._pending.get(key)

    def complete_store(self, key: PageKey, ok: bool) -> None:
        with self._lock:
            slot = self._pending.pop(key, None)
            if slot is None:
                return
            if ok:
                self._ready[key] = slot
                self._used_at[key] = time.monotonic()
                self._tenants.stored(key)
            else:
                self._free.append(slot)
                self._tenants.drop(key)

    def detach(self, key: PageKey, at: int | None = None) -> tuple[int, bool] | None:
        """Hide ``key`` from :meth:`lookup` and take its slot out of use without freeing it: the
        caller invalidates the slot, then gives it back with :meth:`release`. Returns ``(slot,
        pinned)``, ``None`` when ``key`` is not stored (or not in slot ``at``, when given).
        ``pinned``: readers still copy from the slot; the caller must leave its bytes alone, and
        the last :meth:`unpin` hands it back."""
        with self._lock:
            slot = self._ready.get(key)
            if slot is None or (at is not None and slot != at):
                return None
            del self._ready[key]
            self._used_at.pop(key, None)
            self._tenants.drop(key)
            self._detached.add(slot)
            return slot, slot in self._pins

    def release(self, slot: int) -> None:
        """Free a slot :meth:`detach` took out of use (invalidated by now)."""
        with self._lock:
            if slot in self._detached:
                self._detached.discard(slot)
                self._free.append(slot)

    def pin(self, slot: int) -> None:
        with self._lock:
            self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> bool:
        """Drop one pin. ``True`` when that was the last pin of a detached slot: the caller
        invalidates it and calls :meth:`release`."""
        with self._lock:
            left = self._pins.get(slot, 0) - 1
            if left > 0:
                self._pins[slot] = left
                return False
            self._pins.pop(slot, None)
            return slot in self._detached

    def victim(self, tenant: str = DEFAULT_TENANT) -> tuple[PageKey, int] | None:
        """The page a store for ``tenant`` would evict (the least recently used one it may),
        left in place; ``None`` when it may evict none."""
        with self._lock:
            key = self._victim(tenant)
            return None if key is None else (key, self._ready[key])

    def items(self) -> list[tuple[PageKey, int]]:
        """Every stored page, oldest first."""
        with self._lock:
            return list(self._ready.items())

    def _victim(self, tenant: str) -> PageKey | None:
        books, keep = self._tenants, self._keep
        if not books.quotas and keep is None:
            for k, s in self._ready.items():      # a loop, not next(genexpr): this runs on every full-tier store
                if s not in self._pins:
                    return k
            return None
        own_only = books.at_quota(tenant)
        soft = None
        for k in (books.oldest(tenant) if own_only else self._ready):
            if self._ready[k] in self._pins:
                continue
            if not own_only and books.quotas:
                owner = books.owner(k)
                if owner != tenant and books.protected(owner):
                    continue
            level = KEEP_NONE if keep is None else keep(k)
            if level == KEEP_NONE:
                return k
            if level == KEEP_SOFT and soft is None:
                soft = k
        return soft
