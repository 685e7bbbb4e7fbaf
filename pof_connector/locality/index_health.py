"""Whether `pof router` or the locality API answers from the locality index right now.

Answering without it (the index unreachable; for the router also an index that names no node of
the model) turns cache-aware routing off, and that must never be silent: one log line when it
starts, one when the index is back, a gauge ``pof_index_available`` (1 from the index, 0
without it) and a counter ``pof_index_lost_total{reason}`` (times it started or its reason changed, by reason). The
router's answers also say it per request (``x-pof-reason: fallback:<reason>``), the API's 503s too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class IndexHealth(Collector):
    """Transitions between answering from the index and without it; register it in a Prometheus
    registry for the metrics."""

    def __init__(self, who: str, logger: logging.Logger) -> None:
        self.who = who
        self.log = logger
        self._lost_since: float | None = None      # None: answering from the index
        self._reason = ""
        self._lost: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        return self._lost_since is None

    def lost(self, reason: str, detail: str, consequence: str) -> None:
        """An answer was given without the index because of ``reason`` (e.g. the exception's name)."""
        with self._lock:
            if self._lost_since is not None and reason == self._reason:
                return
            first = self._lost_since is None
            if first:
                self._lost_since = time.monotonic()
            self._reason = reason
            self._lost[reason] = self._lost.get(reason, 0) + 1
        self.log.warning("%s: answering without the locality index (%s: %s); %s", self.who, reason, detail,
                         consequence if first else "the reason changed")

    def ok(self) -> None:
        """An answer came from the index."""
        if self._lost_since is None:       # the common case: no lock
            return
        with self._lock:
            since, self._lost_since = self._lost_since, None
        if since is not None:
            self.log.warning("%s: the locality index answers again after %.1fs without it", self.who,
                             time.monotonic() - since)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        gauge = GaugeMetricFamily("pof_index_available", "1 while answers come from the locality index, 0 while "
                                                         "they are given without it")
        gauge.add_metric([], float(self.available))
        yield gauge
        lost = CounterMetricFamily("pof_index_lost", "Times answers started to be given without the locality "
                                                     "index (or the reason changed), by reason", labels=["reason"])
        with self._lock:
            for reason, n in sorted(self._lost.items()):
                lost.add_metric([reason], n)
        yield lost
