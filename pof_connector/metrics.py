"""Counters of one pool, readable as a snapshot (``pof stats``, engine stats hooks) and as
Prometheus metrics (``pof_*``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

Labels = tuple[tuple[str, str], ...]

COUNTERS: dict[str, str] = {
    "lookups": "Prefix lookups answered",
    "lookup_pages": "Pages asked for by lookups",
    "hit_pages": "Pages a lookup found loadable, by tier",
    "stored_pages": "Pages written, by tier",
    "stored_bytes": "Page bytes written, by tier",
    "loaded_pages": "Pages read and validated, by tier",
    "loaded_bytes": "Page bytes read and validated, by tier",
    "load_failures": "Pages rejected or unreadable (the engine recomputes them), by reason",
    "evicted_pages": "Pages evicted, by tier",
    "dropped_pages": "Pages written but never published: some rank failed a load under a block the step that "
                     "computed them read (the engine's scheduler said so), by tier",
    "demoted_pages": "Pages moved to the next tier on eviction, by tier",
    "given_slots": "Slots of a shared region this process gave to a writer shorter of room (pages in them "
                   "evicted), by tier",
    "adopted_slots": "Slots of a shared region other writers gave this process, by tier",
    "spilled_pages": "Pages evicted from the last tier and written into another node's granted slots, by tier",
    "spill_failures": "Evicted pages that could not be spilled (dropped instead), by reason",
    "index_refused": "Index records a lookup refused (cut short, an unknown medium: a corrupt or hostile index "
                     "writer); their pages are misses, by reason",
    "index_errors": "Failed calls to the locality index, by operation",
    "index_timeouts": "Calls to the locality index that timed out (counted in index_errors too: a miss, or a "
                      "publish sent again later; never a server restart), by operation",
    "index_restarts": "Embedded index servers this process started because the previous one's process had died "
                      "(reason server_died)",
    "registration_lapses": "Times this node's heartbeat reached the index after node_ttl_s: its pages were "
                           "invisible to lookups until it published them again",
    "tier_errors": "Tiers lost while running (their pages are dropped), by tier",
    "adapter_errors": "Unexpected errors in an engine adapter (the engine recomputed instead), by hook",
    "skipped_hooks": "Steps in which the engine skipped a per-layer hook for some layer (a full CUDA graph "
                     "replay): their loads were recomputed, their saves not stored, by hook",
    "audit_pages": "Pool pages the audit compared with the KV the engine computed for their keys",
    "audit_mismatches": "Audited pages that were not the KV the engine computed (withdrawn), by writer and reason",
    "audit_unread": "Audited pool pages that could not be read any more (nothing compared), by reason",
    "audit_revoked": "Pages of this node another node's audit found wrong, dropped here, by tier",
    "store_refused_pages": "Pages not stored because no page could be evicted for them (pinned by readers or "
                           "prefix pins, or kept for tenants within their quotas), by tenant and tier",
    "pin_copied_pages": "Pages of pinned prefixes this node copied from a holder (a pin's replicas)",
    "pin_copy_failures": "Pages of pinned prefixes this node was asked to copy and could not, by reason",
    "load_seconds": "Time spent loading pages",
}

COUNTER_LABELS: dict[str, str] = {
    "hit_pages": "tier", "stored_pages": "tier", "stored_bytes": "tier", "loaded_pages": "tier",
    "loaded_bytes": "tier", "load_failures": "reason", "evicted_pages": "tier", "dropped_pages": "tier",
    "demoted_pages": "tier", "given_slots": "tier", "adopted_slots": "tier",
    "spilled_pages": "tier", "spill_failures": "reason", "index_refused": "reason", "index_errors": "op",
    "index_timeouts": "op", "index_restarts": "reason", "tier_errors": "tier", "adapter_errors": "hook",
    "skipped_hooks": "hook", "audit_mismatches": "reason,writer", "audit_unread": "reason",
    "audit_revoked": "tier", "store_refused_pages": "tenant,tier", "pin_copy_failures": "reason",
}
"""The labels each labelled counter carries (comma-separated, sorted): what an engine's own metrics
endpoint exports."""

GAUGES: dict[str, str] = {
    "tier_used_bytes": "Bytes of slots this process holds pages in, by tier (a shared region: its own partition)",
    "tier_capacity_bytes": "Bytes of slots this process may write, by tier",
}
"""Gauges an engine's metrics endpoint exports (label ``tier``), read from the tiers as they are: a
bench reads a tier's use while it runs, and its evictions from ``evicted_pages``."""


def tier_gauges(tiers: list[Any]) -> dict[str, float]:
    """:data:`GAUGES` of ``tiers`` now, keyed as a snapshot is (``"tier_used_bytes{tier=cxl}"``).
    ``tiers``: :class:`~pof_connector.tiers.Tier` objects (typed loosely: this module imports no tier)."""
    out: dict[str, float] = {}
    for t in tiers:
        out[f"tier_used_bytes{{tier={t.medium}}}"] = float(t.used_slots * t.slot_bytes)
        out[f"tier_capacity_bytes{{tier={t.medium}}}"] = float(t.capacity_slots * t.slot_bytes)
    return out


class PoolStats:
    """Thread-safe named counters with optional labels."""

    def __init__(self) -> None:
        self._values: dict[tuple[str, Labels], float] = {}
        self._gauges: dict[tuple[str, Labels], float] = {}
        self._lock = threading.Lock()

    def add(self, name: str, value: float = 1, **labels: str) -> None:
        assert name in COUNTERS, name
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._values[key] = self._values.get(key, 0) + value

    def set_gauge(self, name: str, value: float, **labels: str) -> None:
        with self._lock:
            self._gauges[(name, tuple(sorted(labels.items())))] = value

    def get(self, name: str, **labels: str) -> float:
        """A counter's value summed over the labels not given."""
        want = set(labels.items())
        with self._lock:
            return sum(v for (n, lab), v in self._values.items() if n == name and want <= set(lab))

    def snapshot(self) -> dict[str, Any]:
        """``{"name": total, "name{label=value}": value, ...}`` — plain data for logs and stats."""
        out: dict[str, Any] = {}
        with self._lock:
            items = list(self._values.items()) + list(self._gauges.items())
        for (name, labels), v in items:
            out[name] = out.get(name, 0) + v
            if labels:
                out[name + "{" + ",".join(f"{k}={val}" for k, val in labels) + "}"] = v
        return out

    def collect_prometheus(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        with self._lock:
            values = dict(self._values)
            gauges = dict(self._gauges)
        for name, doc in COUNTERS.items():
            series = [(lab, v) for (n, lab), v in values.items() if n == name]
            label_names = sorted({k for lab, _ in series for k, _ in lab})
            fam = CounterMetricFamily(f"pof_{name}", doc, labels=label_names)
            for lab, v in series:
                d = dict(lab)
                fam.add_metric([d.get(k, "") for k in label_names], v)
            yield fam
        for name in sorted({n for n, _ in gauges}):
            series = [(lab, v) for (n, lab), v in gauges.items() if n == name]
            label_names = sorted({k for lab, _ in series for k, _ in lab})
            g = GaugeMetricFamily(f"pof_{name}", name.replace("_", " "), labels=label_names)
            for lab, v in series:
                d = dict(lab)
                g.add_metric([d.get(k, "") for k in label_names], v)
            yield g


class _StatsCollector(Collector):
    def __init__(self, stats: PoolStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        return self.stats.collect_prometheus()


def register_prometheus(stats: PoolStats, registry: CollectorRegistry) -> Collector:
    """Expose ``stats`` as ``pof_*`` metrics in ``registry``."""
    collector = _StatsCollector(stats)
    registry.register(collector)
    return collector
