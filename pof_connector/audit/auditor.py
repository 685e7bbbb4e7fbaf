"""Comparisons of recomputed pages with the pool's, on a thread of their own, and what a mismatch does."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from pof_connector.audit.revocations import KEEP, REVOKED_META, encode
from pof_connector.audit.tolerance import classify, page_errors
from pof_connector.config.audit_config import AuditConfig
from pof_connector.index.base import Location
from pof_connector.pages.keys import PageKey
from pof_connector.pages.layout import VERSION
from pof_connector.pool import Pool

log = logging.getLogger(__name__)

RECENT = 32
"""Mismatches a node's summary lists (the newest)."""
ERROR_BUCKETS = (1e-6, 1e-5, 1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)
"""Upper bounds of the normalised-error histogram (``pof_audit_error``)."""


@dataclass(frozen=True)
class AuditResult:
    """One audited page: its largest normalised error over layers and heads, at ``layer``;
    ``reason`` is ``None`` when it matched, else what the mismatch looks like
    (:func:`~pof_connector.audit.tolerance.classify`)."""

    key: PageKey
    source: Location
    error: float
    layer: int
    reason: str | None


class Auditor:
    """Compares pages the engine computed with the pool's pages of the same keys.

    ``dtype``: the KV's dtype (``bfloat16``...); ``heads`` / ``head_dim``: a canonical segment's
    ``[K/V, tokens, heads, head_dim]`` (errors are normalised per head). A mismatched page is
    withdrawn (no node loads it from there again), counted
    (``pof_audit_mismatches_total{writer,reason}``), and its writer's provenance logged once; after
    ``quarantine_after`` mismatches a writer's pages are no longer loaded here until it registers
    again. The running summary is in this node's index record (``pof audit`` reads it)."""

    def __init__(self, pool: Pool, config: AuditConfig, dtype: str, heads: int = 1, head_dim: int = 0) -> None:
        self.pool, self.config = pool, config
        self.dtype = dtype.removeprefix("torch.")
        self.bound = config.bound(self.dtype)
        self.heads, self.head_dim = heads, head_dim
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pof-audit")
        self._lock = threading.Lock()
        self._errors: list[float] = []          # since the last take_errors (the engine's stats path)
        self._pages = 0
        self._max_error = 0.0
        self._buckets = [0] * (len(ERROR_BUCKETS) + 1)
        self._mismatches: dict[str, dict[str, int]] = {}      # writer -> reason -> pages
        self._revoked: deque[tuple[PageKey, Location]] = deque(maxlen=KEEP)
        self._recent: deque[dict[str, object]] = deque(maxlen=RECENT)     # the newest mismatches, for pof audit
        self._logged: set[str] = set()

    def submit(self, key: PageKey, source: Location, layers: Sequence[np.ndarray],
               ready: Callable[[], None] | None = None) -> Future[AuditResult | None]:
        """Compare the engine's page (``layers``: its canonical segments, unchanged until the
        future completes) with the pool's page of ``key`` at ``source``, in the background.
        ``ready``: returns once ``layers`` hold their bytes (a device copy in flight). The result
        is ``None`` when the pool's page could not be read any more (evicted, rewritten): nothing
        was compared, nothing is counted as audited."""
        return self._thread.submit(self._audit, key, source, layers, ready)

    def _audit(self, key: PageKey, source: Location, layers: Sequence[np.ndarray],
               ready: Callable[[], None] | None) -> AuditResult | None:
        if ready is not None:
            ready()
        spec = self.pool.spec
        page = np.empty(spec.page_bytes, dtype=np.uint8)
        handle = self.pool.load([key], [source], [page])
        if not handle.wait(self.pool.config.load_timeout_s) or handle.failed:
            self.pool.stats.add("audit_unread", reason=handle.failed.get(0, "timeout"))
            return None
        pool_layers = [page[spec.segment_offset(i):spec.segment_offset(i) + spec.segment_bytes]
                       for i in range(spec.num_layers)]
        errors = page_errors(layers, pool_layers, self.dtype, self.heads, self.head_dim)
        worst = int(np.argmax(errors))
        reason = None
        if errors[worst] > self.bound:
            reason = classify(layers, pool_layers, errors, self.bound, self.dtype, self.heads, self.head_dim)
        result = AuditResult(key, source, float(errors[worst]), worst, reason)
        self._count(result)
        if reason is not None:
            self._mismatch(result)
        return result

    def _count(self, r: AuditResult) -> None:
        self.pool.stats.add("audit_pages")
        with self._lock:
            self._pages += 1
            self._errors.append(r.error)
            self._max_error = max(self._max_error, r.error)
            self._buckets[next((i for i, b in enumerate(ERROR_BUCKETS) if r.error <= b), len(ERROR_BUCKETS))] += 1
            if r.reason is not None:
                by = self._mismatches.setdefault(r.source.node, {})
                by[r.reason] = by.get(r.reason, 0) + 1
                self._recent.append({"page": r.key.digest.hex()[:16], "writer": r.source.node,
                                     "tier": r.source.medium, "reason": r.reason, "error": r.error,
                                     "layer": r.layer, "at": round(time.time(), 3)})
        self.pool.meta["audit"] = json.dumps(self.summary())     # in this node's next heartbeat

    def _mismatch(self, r: AuditResult) -> None:
        writer = r.source.node
        self.pool.stats.add("audit_mismatches", writer=writer, reason=r.reason or "values")
        self.pool.withdraw(r.key, r.source)
        if writer != self.pool.node_id:         # its writer finds it in its own books first: told through the index
            self._revoked.append((r.key, r.source))
            self.pool.meta[REVOKED_META] = encode(self._revoked)
        if writer not in self._logged:
            self._logged.add(writer)
            info = self.pool.finder.node_info(writer)
            meta = info.meta if info is not None else {}
            log.error("pof audit: the pool's page %s from writer %s (tier %s, slot %d, generation %d; engine %s, "
                      "model %s, page format v%d) is not the KV this engine computed for its key: normalised "
                      "error %.3g at layer %d (bound %.3g for %s), looks like %s. It was withdrawn; further "
                      "mismatches from this writer are counted in pof_audit_mismatches_total",
                      r.key.digest.hex()[:16], writer, r.source.medium, r.source.slot, r.source.generation,
                      meta.get("engine", "?"), meta.get("model", "?"), VERSION, r.error, r.layer, self.bound,
                      self.dtype, r.reason)
        k = self.config.quarantine_after
        if k and sum(self._mismatches.get(writer, {}).values()) >= k and self.pool.finder.quarantine(writer):
            log.error("pof audit: writer %s mismatched %d pages; its pages are not loaded here until it "
                      "registers again", writer, k)

    def summary(self) -> dict[str, object]:
        """What ``pof audit`` shows: pages audited, the error histogram, mismatches by writer."""
        with self._lock:
            return {"pages": self._pages, "dtype": self.dtype, "bound": self.bound,
                    "sample_rate": self.config.sample_rate, "max_error": self._max_error,
                    "buckets": dict(zip([*map(str, ERROR_BUCKETS), "inf"], self._buckets, strict=True)),
                    "mismatches": {w: dict(r) for w, r in self._mismatches.items()},
                    "recent": list(self._recent)}

    def take_errors(self) -> list[float]:
        """The errors measured since the last call (for the engine's metrics histogram)."""
        with self._lock:
            out, self._errors = self._errors, []
        return out

    def drain(self) -> None:
        """Wait for every comparison submitted so far."""
        self._thread.submit(lambda: None).result()

    def close(self) -> None:
        self._thread.shutdown(wait=True)
