"""pof's counters on vLLM's own stats path: the worker returns a :class:`PoFConnectorStats`
each step (counter deltas and load latencies), vLLM aggregates them into its periodic log line
and calls :class:`PoFPromMetrics` to export them on the server's ``/metrics`` as ``vllm:pof_*``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from pof_connector.audit.auditor import ERROR_BUCKETS
from pof_connector.metrics import COUNTER_LABELS, COUNTERS, GAUGES

_SERIES = re.compile(r"^(\w+)\{((?:\w+=[^,}]*,?)+)\}$")
EXPORTED = {name: labels.split(",") for name, labels in COUNTER_LABELS.items()}   # pool counter -> its labels


LISTS = ("load_seconds", "wait_seconds", "audit_errors")
"""The per-event series a step's stats carry besides the counters."""


def series(key: str) -> tuple[str, dict[str, str]] | None:
    """``("name", {label: value})`` of a snapshot key ``name{a=x,b=y}``; ``None`` for a total."""
    m = _SERIES.match(key)
    if m is None:
        return None
    return m.group(1), dict(part.split("=", 1) for part in m.group(2).rstrip(",").split(","))


def counter_delta(now: dict[str, Any], before: dict[str, Any]) -> dict[str, float]:
    """Labelled series that moved since ``before`` (snapshots of :class:`PoolStats`)."""
    return {k: v - before.get(k, 0) for k, v in now.items() if "{" in k and v != before.get(k, 0)}


@dataclass
class PoFConnectorStats(KVConnectorStats):
    """``data = {"counters": {"loaded_pages{tier=cxl}": 3, ...}, "load_seconds": [0.01, ...],
    "wait_seconds": [0.008, ...], "gauges": {"tier_used_bytes{tier=cxl}": 4096.0, ...}}``: a
    request's load from its start to the end of the forward it ran in; the time the forward's thread
    spent in pof in a step that loaded; the worker's tier gauges when they changed (the newest wins
    when steps are aggregated: a gauge is a level, not a sum)."""

    def __post_init__(self) -> None:
        data: dict[str, Any] = self.data
        data.setdefault("counters", {})
        data.setdefault("gauges", {})
        for name in LISTS:
            data.setdefault(name, [])

    def reset(self) -> None:
        fresh: dict[str, Any] = {"counters": {}, "gauges": {}, **{name: [] for name in LISTS}}
        self.data = fresh

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        mine: dict[str, Any] = self.data
        theirs: dict[str, Any] = other.data
        for k, v in theirs.get("counters", {}).items():
            mine["counters"][k] = mine["counters"].get(k, 0) + v
        mine.setdefault("gauges", {}).update(theirs.get("gauges", {}))
        for name in LISTS:
            mine[name] = list(mine.get(name, [])) + list(theirs.get(name, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        data: dict[str, Any] = self.data
        for k, v in data["counters"].items():
            parsed = series(k)
            name = parsed[0] if parsed else k
            out[f"pof_{name}"] = out.get(f"pof_{name}", 0) + v
        lat = sorted(data["load_seconds"])
        if lat:
            out["pof_loads"] = len(lat)
            out["pof_load_ms_p50"] = round(lat[len(lat) // 2] * 1e3, 2)
        waits = sorted(data["wait_seconds"])
        if waits:
            out["pof_load_wait_ms_p50"] = round(waits[len(waits) // 2] * 1e3, 2)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in ("counters", "gauges", *LISTS))


class PoFPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(name=f"vllm:pof_{name}", documentation=f"pof: {COUNTERS[name]}",
                                    labelnames=[*labelnames, *labels])
            for name, labels in EXPORTED.items()
        }
        # the tiers' levels, set from the newest worker reading (vLLM's Gauge is multiprocess-safe)
        self._gauges = {
            name: self._gauge_cls(name=f"vllm:pof_{name}", documentation=f"pof: {doc}",
                                  labelnames=[*labelnames, "tier"], multiprocess_mode="mostrecent")
            for name, doc in GAUGES.items()
        }
        buckets = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
        hist = self._histogram_cls(name="vllm:pof_load_seconds", documentation="pof: one request's load, from "
                                   "opening its pages to the end of the forward they were copied in",
                                   labelnames=labelnames, buckets=buckets)
        self._load_seconds = create_metric_per_engine(hist, per_engine_labelvalues)
        wait = self._histogram_cls(name="vllm:pof_load_wait_seconds", documentation="pof: in a forward that "
                                   "loaded pages, the time the forward's thread spent in pof (opening the pages, "
                                   "the copies and checks it waited for, finishing)",
                                   labelnames=labelnames, buckets=buckets)
        self._wait_seconds = create_metric_per_engine(wait, per_engine_labelvalues)
        audit = self._histogram_cls(name="vllm:pof_audit_error", documentation="pof: per audited page, the largest "
                                    "normalised error (max |engine - pool| / max |engine| per layer and KV head) "
                                    "between the KV the engine computed and the pool's page of the same key",
                                    labelnames=labelnames, buckets=list(ERROR_BUCKETS))
        self._audit_error = create_metric_per_engine(audit, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        base = self.per_engine_labelvalues[engine_idx]
        for key, value in transfer_stats_data.get("counters", {}).items():
            parsed = series(key)
            if parsed is None or parsed[0] not in self._counters or sorted(parsed[1]) != EXPORTED[parsed[0]]:
                continue
            name, labels = parsed
            self._counters[name].labels(*base, *(labels[k] for k in EXPORTED[name])).inc(value)
        for key, value in transfer_stats_data.get("gauges", {}).items():
            parsed = series(key)
            if parsed is None or parsed[0] not in self._gauges or set(parsed[1]) != {"tier"}:
                continue
            self._gauges[parsed[0]].labels(*base, parsed[1]["tier"]).set(value)
        for s in transfer_stats_data.get("load_seconds", []):
            self._load_seconds[engine_idx].observe(s)
        for s in transfer_stats_data.get("wait_seconds", []):
            self._wait_seconds[engine_idx].observe(s)
        for e in transfer_stats_data.get("audit_errors", []):
            self._audit_error[engine_idx].observe(e)
