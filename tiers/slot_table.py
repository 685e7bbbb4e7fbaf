"""The books of one tier: which key sits in which slot, LRU order and pins. Moves no bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict

from pof_connector.keys import PageKey


class SlotTable:
    """Slot bookkeeping with a two-phase store.

    ``prepare_store`` reserves a slot (evicting the least recently used unpinned page when none is
    free); the page becomes visible to :meth:`lookup` only after ``complete_store(ok=True)``.
    A pinned slot is never evicted nor freed, so a local reader can copy from it safely: a page
    removed while pinned is hidden from :meth:`lookup` at once and its slot is handed back at the
    last :meth:`unpin` (see :meth:`detach`).
    """

    def __init__(self, slots: range) -> None:
        self._free = list(reversed(slots))
        self._capacity = len(slots)
        self._ready: OrderedDict[PageKey, int] = OrderedDict()   # LRU order: oldest first
        self._pending: dict[PageKey, int] = {}
        self._pins: dict[int, int] = {}          # slot -> readers (a plain dict: Counter's __missing__ is Python)
        self._lent: set[int] = set()          # granted to other nodes' writers (fabric spill)
        self._detached: set[int] = set()      # removed, not free yet: pinned, or being invalidated
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return self._capacity

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
                if pin:
                    self._pins[slot] = self._pins.get(slot, 0) + 1
            return slot

    def contains(self, key: PageKey) -> bool:
        """True when ``key`` is stored or being stored (so storing it again is pointless)."""
        with self._lock:
            return key in self._ready or key in self._pending

    def can_allocate(self) -> bool:
        with self._lock:
            return bool(self._free) or self._victim() is not None

    def prepare_store(self, key: PageKey) -> tuple[int, PageKey | None] | None:
        """Reserve a slot for ``key``.

        Returns ``(slot, evicted)``, where ``evicted`` is the key whose page was dropped to make
        room (the caller withdraws it from the index), or ``None`` when ``key`` is already
        stored or in flight, or every slot is pinned or pending.
        """
        with self._lock:
            if key in self._ready or key in self._pending:
                return None
            evicted = None
            if self._free:
                slot = self._free.pop()
            else:
                evicted = self._victim()
                if evicted is None:
                    return None
                slot = self._ready.pop(evicted)
            self._pending[key] = slot
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
            else:
                self._free.append(slot)

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

    def victim(self) -> tuple[PageKey, int] | None:
        """The least recently used unpinned page, left in place; ``None`` when all are pinned."""
        with self._lock:
            key = self._victim()
            return None if key is None else (key, self._ready[key])

    def items(self) -> list[tuple[PageKey, int]]:
        """Every stored page, oldest first."""
        with self._lock:
            return list(self._ready.items())

    def _victim(self) -> PageKey | None:
        for k, s in self._ready.items():      # a loop, not next(genexpr): this runs on every full-tier store
            if s not in self._pins:
                return k
        return None
