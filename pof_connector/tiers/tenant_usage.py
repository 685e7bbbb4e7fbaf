"""What each tenant holds of this node's tiers, against its quota: gauges and the heartbeat's meta."""

from __future__ import annotations

import json

from pof_connector.metrics import PoolStats
from pof_connector.tiers.base import Tier

META_KEY = "tenants"
"""The node meta field carrying ``{tenant: {medium: [used bytes, quota bytes or null]}}`` (names only:
no salt, nor its digest, leaves the node)."""


class TenantUsage:
    """Sets ``pof_tenant_used_bytes`` / ``pof_tenant_quota_bytes`` {tenant, tier} on each report;
    a tenant whose pages are gone reads 0, not its last value."""

    def __init__(self, stats: PoolStats) -> None:
        self.stats = stats
        self._seen: set[tuple[str, str]] = set()

    def report(self, tiers: list[Tier]) -> str:
        """Set the gauges; returns the meta field's JSON."""
        table: dict[str, dict[str, list[int | None]]] = {}
        now: set[tuple[str, str]] = set()
        for tier in tiers:
            for tenant, (used, quota) in tier.tenant_use().items():
                table.setdefault(tenant, {})[tier.medium] = [used, quota]
                now.add((tenant, tier.medium))
                self.stats.set_gauge("tenant_used_bytes", used, tenant=tenant, tier=tier.medium)
                if quota is not None:
                    self.stats.set_gauge("tenant_quota_bytes", quota, tenant=tenant, tier=tier.medium)
        for tenant, medium in self._seen - now:
            self.stats.set_gauge("tenant_used_bytes", 0, tenant=tenant, tier=medium)
        self._seen |= now
        return json.dumps(table, separators=(",", ":"), sort_keys=True)


def parse_meta(raw: str | None) -> dict[str, dict[str, tuple[int, int | None]]]:
    """The meta field back, for ``pof stats``; a malformed one (a hostile writer) reads as empty."""
    if not raw:
        return {}
    try:
        data = json.loads(raw)
        out: dict[str, dict[str, tuple[int, int | None]]] = {}
        for tenant, media in data.items():
            out[str(tenant)] = {str(m): (int(v[0]), None if v[1] is None else int(v[1])) for m, v in media.items()}
        return out
    except (ValueError, TypeError, IndexError, AttributeError):
        return {}
