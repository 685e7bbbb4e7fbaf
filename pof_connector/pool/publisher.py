"""What this node tells the index about its pages, and what it owes it after a failed call:
withdrawals sent again by the heartbeat, a full re-publish when a publish was lost."""

from __future__ import annotations

import threading

from pof_connector.index import LocalityIndex, Location
from pof_connector.index.guarded import IndexGuard
from pof_connector.pages.keys import PageKey

UNWITHDRAWN_MAX = 1 << 16
"""Withdrawals kept for sending again while the index does not take them (see :meth:`Publisher.publish`)."""
Event = tuple[bool, PageKey, Location]
"""(publish? else withdraw, key, location)."""


class Publisher:
    """Publishes and withdraws through ``guard``; safe to call from any thread."""

    def __init__(self, index: LocalityIndex, guard: IndexGuard) -> None:
        self.index = index
        self.guard = guard
        self._republish = False
        self._unwithdrawn: list[tuple[PageKey, Location]] = []     # withdrawals the index did not take
        self._unwithdrawn_lock = threading.Lock()

    def publish(self, events: list[Event]) -> None:
        """Send (publish?, key, location) events; within a batch only the last per key and medium
        counts (a page may be stored and then evicted by the same batch)."""
        final: dict[tuple[PageKey, str, str], tuple[bool, Location]] = {}
        for pub, key, loc in events:
            final[(key, loc.node, loc.medium)] = (pub, loc)
        out = [(k, loc) for (k, _, _), (pub, loc) in final.items() if not pub]
        put = [(k, loc) for (k, _, _), (pub, loc) in final.items() if pub]
        if out:
            self.withdraw(out)
        if put and self.guard.call("publish", self.index.publish, put, default=False) is False:
            self._republish = True            # the heartbeat publishes everything again

    def withdraw(self, entries: list[tuple[PageKey, Location]]) -> None:
        """Withdraw ``entries``; what the index does not take is sent again by the heartbeat (a
        withdrawal removes exactly its records, so a late one never removes a newer page's)."""
        if entries and self.guard.call("withdraw", self.index.withdraw, entries, default=False) is False:
            with self._unwithdrawn_lock:
                # Past the cap (a long outage) the oldest are given up: a stale record costs a
                # failed load (its generation does not match), never a wrong page.
                self._unwithdrawn = (self._unwithdrawn + entries)[-UNWITHDRAWN_MAX:]

    def publish_all(self, entries: list[tuple[PageKey, Location]]) -> None:
        """Publish many (a re-publish) in batches; what the index does not take is asked for again."""
        if self.guard.send_in_batches("publish", self.index.publish, entries) < len(entries):
            self._republish = True

    def take_republish(self) -> bool:
        """Whether a publish was lost since the last call (then everything is to be published again)."""
        owed, self._republish = self._republish, False
        return owed

    def retry_withdraws(self, fresh: bool) -> None:
        """Send again the withdrawals that failed (the index did not answer in time). After a new
        registration they are moot: the old incarnation's records are dead with it."""
        with self._unwithdrawn_lock:
            pending, self._unwithdrawn = self._unwithdrawn, []
        if fresh:
            return
        sent = self.guard.send_in_batches("withdraw", self.index.withdraw, pending)
        if sent < len(pending):
            with self._unwithdrawn_lock:
                self._unwithdrawn = (pending[sent:] + self._unwithdrawn)[-UNWITHDRAWN_MAX:]
