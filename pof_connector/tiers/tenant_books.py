"""Which tenant each page of a tier belongs to, what each tenant uses, and its quota (in slots).

Kept beside the :class:`~pof_connector.tiers.slot_table.SlotTable` (which calls it under its own
lock), not in the page key: a key's chain seed already covers the salt, but one cannot tell a
tenant from a digest, and the books must, to evict by tenant.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping

from pof_connector.config.tenant_config import DEFAULT_TENANT
from pof_connector.pages.keys import PageKey


class TenantBooks:
    """Per tenant: its pages (stored ones in LRU order, oldest first) and its quota in slots
    (absent: unlimited). Not thread-safe: the slot table's lock covers it."""

    def __init__(self, quotas: Mapping[str, int] | None = None) -> None:
        self.quotas: dict[str, int] = dict(quotas or {})
        self._owner: dict[PageKey, str] = {}
        self._use: dict[str, int] = {}
        self._lru: dict[str, OrderedDict[PageKey, None]] = {}

    def owner(self, key: PageKey) -> str:
        return self._owner.get(key, DEFAULT_TENANT)

    def use(self, tenant: str) -> int:
        """Slots ``tenant``'s pages take (stored and being stored)."""
        return self._use.get(tenant, 0)

    def usage(self) -> dict[str, int]:
        return {t: n for t, n in self._use.items() if n}

    def at_quota(self, tenant: str) -> bool:
        """One more page of ``tenant`` would take it over its quota: it must give one of its own first."""
        q = self.quotas.get(tenant)
        return q is not None and self._use.get(tenant, 0) >= q

    def protected(self, tenant: str) -> bool:
        """``tenant``'s pages may not be evicted for another tenant: it has a quota and is within it."""
        q = self.quotas.get(tenant)
        return q is not None and self._use.get(tenant, 0) <= q

    def reserve(self, key: PageKey, tenant: str) -> None:
        """A store of ``key`` for ``tenant`` began: its slot counts from now on."""
        self._owner[key] = tenant
        self._use[tenant] = self._use.get(tenant, 0) + 1

    def stored(self, key: PageKey) -> None:
        """The store of ``key`` completed: it joins its tenant's LRU order, as the newest."""
        self._lru.setdefault(self.owner(key), OrderedDict())[key] = None

    def drop(self, key: PageKey) -> None:
        """``key`` left the tier (evicted, removed, or its store failed)."""
        tenant = self._owner.pop(key, None)
        if tenant is None:
            return
        self._use[tenant] -= 1
        lru = self._lru.get(tenant)
        if lru is not None:
            lru.pop(key, None)

    def touch(self, key: PageKey) -> None:
        lru = self._lru.get(self._owner.get(key, DEFAULT_TENANT))
        if lru is not None and key in lru:
            lru.move_to_end(key)

    def oldest(self, tenant: str) -> Iterator[PageKey]:
        """``tenant``'s stored pages, least recently used first."""
        return iter(self._lru.get(tenant, ()))
