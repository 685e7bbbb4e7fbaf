"""Index calls that never raise into their caller: an unreachable index answers a default.

:class:`IndexGuard` counts each failure, logs the outage once (and its end), and backs off 1 s
so that a down index costs one timeout a second, not one per call. :class:`LogOnce` is the
log-once used alongside it: the first event of a kind is logged, the rest only counted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from pof_connector.index.base import IndexTimeout, IndexUnavailable, Location
from pof_connector.metrics import PoolStats
from pof_connector.pages.keys import PageKey

log = logging.getLogger("pof_connector.pool")
T = TypeVar("T")
INDEX_BATCH = 1000
"""Entries per publish or withdraw call when a node sends many at once (a re-publish)."""
BACKOFF_S = 1.0
"""After a failed call, calls return their default at once for this long."""


class LogOnce:
    """Logs the first event of each kind (``what``); later ones are left to the counters until
    :meth:`clear` re-arms the kind (a relay that cannot reach the index for an hour writes one line)."""

    def __init__(self, logger: logging.Logger = log) -> None:
        self._log = logger
        self._logged: set[str] = set()

    def __call__(self, what: str, level: int, msg: str, *args: Any, exc_info: BaseException | None = None) -> None:
        if what in self._logged:
            return
        self._logged.add(what)
        self._log.log(level, msg, *args, exc_info=exc_info)

    def clear(self, what: str) -> bool:
        """Re-arm ``what``; ``True`` when it had been logged (the caller may log the recovery)."""
        if what not in self._logged:
            return False
        self._logged.discard(what)
        return True


def batches(entries: Sequence[T]) -> Iterator[list[T]]:
    """``entries`` in slices of :data:`INDEX_BATCH` (one publish or withdraw call each)."""
    entries = list(entries)
    for start in range(0, len(entries), INDEX_BATCH):
        yield entries[start:start + INDEX_BATCH]


class IndexGuard:
    """Calls an index on behalf of one client; failures are counted in ``stats`` (``index_errors``,
    ``index_timeouts`` by ``op``). ``republishes``: the caller publishes again what it published
    during an outage (the outage's log line says so)."""

    def __init__(self, stats: PoolStats, *, republishes: bool) -> None:
        self.stats = stats
        self.republishes = republishes
        self.last_error = ""
        """The last failure's message ("" until one)."""
        self._down_until = 0.0
        self._failing = False

    def call(self, op: str, fn: Callable[..., T], *args: Any, default: Any) -> Any:
        """Call the index; on failure count it, log the outage once, back off 1 s, return ``default``."""
        if time.monotonic() < self._down_until:
            return default
        try:
            result = fn(*args)
        except IndexUnavailable as e:
            self.stats.add("index_errors", op=op)
            if isinstance(e, IndexTimeout):
                self.stats.add("index_timeouts", op=op)
            self.last_error = str(e)
            self._down_until = time.monotonic() + BACKOFF_S
            if not self._failing:
                self._failing = True
                log.error("pof: locality index unavailable (%s); serving only what this node finds itself, "
                          "engines recompute the rest%s", e,
                          "; pages published meanwhile are published again once it answers"
                          if self.republishes else "")
            return default
        if self._failing:
            self._failing = False
            log.warning("pof: locality index reachable again")
        return result

    def retry_now(self) -> None:
        """End the back-off: the next call goes to the index (e.g. a server was just restarted)."""
        self._down_until = 0.0

    def send_in_batches(self, op: str, fn: Callable[[list[tuple[PageKey, Location]]], Any],
                        entries: Sequence[tuple[PageKey, Location]]) -> int:
        """Send ``entries`` to the index in batches of :data:`INDEX_BATCH`, stopping at the first
        batch it does not take; returns how many leading entries it took."""
        sent = 0
        for batch in batches(entries):
            if self.call(op, fn, batch, default=False) is False:
                break
            sent += len(batch)
        return sent
