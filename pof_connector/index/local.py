"""An in-process locality index (``index_url: local``): one process, no server.

Several clients may share one :class:`LocalTable` (tests, a single-process deployment); each
client is bound to its node as with Redis.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pof_connector.index.base import (
    MEDIA,
    LocalityIndex,
    Location,
    NodeInfo,
    PrefixMatch,
    check_one_namespace,
    node_id_taken,
)
from pof_connector.pages.keys import PageKey


@dataclass
class _Node:
    incarnation: int
    info: NodeInfo
    expires: float


@dataclass
class LocalTable:
    """The shared state: key → {(incarnation, medium): (slot, generation)}."""

    entries: dict[PageKey, dict[tuple[int, int], tuple[int, int]]] = field(default_factory=dict)
    nodes: dict[str, _Node] = field(default_factory=dict)
    incarnations: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    lock: threading.Lock = field(default_factory=threading.Lock)
    pins: dict[str, str] = field(default_factory=dict)

    def live(self) -> dict[int, str]:
        now = time.monotonic()
        return {n.incarnation: node_id for node_id, n in self.nodes.items() if n.expires > now}


class LocalIndex(LocalityIndex):
    def __init__(self, node_id: str | None, table: LocalTable | None = None) -> None:
        super().__init__(node_id)
        self.table = table if table is not None else LocalTable()
        self._incarnation: int | None = None    # our live registration; None: not registered
        self._last: int | None = None           # the last one we had (a newer holder of our id displaced it)

    def heartbeat(self, info: NodeInfo, ttl_s: float) -> bool:
        t = self.table
        with t.lock:
            node = t.nodes.get(info.node_id)
            live = node is not None and node.expires > time.monotonic()
            fresh = not (live and node is not None and node.incarnation == self._incarnation)
            if fresh:
                if live and self._last is not None:     # a newer process holds our node id
                    self._incarnation = None
                    raise node_id_taken(info.node_id)
                # Replacing a live registration (a restarted node) ends its incarnation at once.
                self._incarnation = self._last = next(t.incarnations)
            assert self._incarnation is not None
            t.nodes[info.node_id] = _Node(self._incarnation, info, time.monotonic() + ttl_s)
            return fresh

    def publish(self, entries: Sequence[tuple[PageKey, Location]]) -> None:
        self._require_node()
        inc = self._incarnation
        if inc is None:
            return   # not registered yet: the first heartbeat re-publishes everything
        with self.table.lock:
            for key, loc in entries:
                owner = self._owner(inc, loc)
                if owner is not None:
                    holders = self.table.entries.setdefault(key, {})
                    holders[(owner, MEDIA.index(loc.medium))] = (loc.slot, loc.generation)

    def _owner(self, inc: int, loc: Location) -> int | None:
        """Under the lock: the incarnation a location is recorded under (another node's for a
        page spilled into its slots, as in the Redis index); ``None`` for an unknown node."""
        if loc.node == self.node_id:
            return inc
        node = self.table.nodes.get(loc.node)
        return None if node is None else node.incarnation

    def withdraw(self, entries: Sequence[tuple[PageKey, Location]]) -> None:
        self._require_node()
        inc = self._incarnation
        if inc is None:
            return
        with self.table.lock:
            for key, loc in entries:
                holders = self.table.entries.get(key)
                if not holders:
                    continue
                owner = self._owner(inc, loc)
                hk = (-1 if owner is None else owner, MEDIA.index(loc.medium))
                if holders.get(hk) == (loc.slot, loc.generation):
                    del holders[hk]
                if not holders:
                    del self.table.entries[key]

    def longest_prefix(self, keys: Sequence[PageKey]) -> dict[str, PrefixMatch]:
        if not keys:
            return {}
        check_one_namespace(keys)
        t = self.table
        runs: dict[int, list[tuple[int, int, int]]] = {}
        with t.lock:
            live = t.live()
            for i, key in enumerate(keys):
                holders = t.entries.get(key, {})
                for (inc, medium), (slot, gen) in sorted(holders.items()):
                    run = runs.setdefault(inc, [])
                    if inc in live and len(run) == i:
                        run.append((medium, slot, gen))
                if not any(len(r) == i + 1 for r in runs.values()):
                    break
        out = {}
        for inc, run in runs.items():
            if run and inc in live:
                arr = np.array(run, dtype=np.int64)
                out[live[inc]] = PrefixMatch(live[inc], arr[:, 0].astype(np.uint8), arr[:, 1], arr[:, 2])
        return out

    def nodes(self) -> list[NodeInfo]:
        with self.table.lock:
            live = self.table.live()
            return [n.info for node_id, n in self.table.nodes.items() if n.incarnation in live]

    def leave(self) -> None:
        node_id = self._require_node()
        with self.table.lock:
            node = self.table.nodes.get(node_id)
            if node is not None and node.incarnation == self._incarnation:
                del self.table.nodes[node_id]
        self._incarnation = None

    def stats(self) -> dict[str, int]:
        with self.table.lock:
            return {"locations": sum(len(h) for h in self.table.entries.values()), "memory_bytes": 0,
                    "nodes": len(self.table.live())}

    def put_pin(self, pin_id: str, record: str) -> None:
        with self.table.lock:
            self.table.pins[pin_id] = record

    def pins(self) -> dict[str, str]:
        with self.table.lock:
            return dict(self.table.pins)

    def remove_pin(self, pin_id: str) -> bool:
        with self.table.lock:
            return self.table.pins.pop(pin_id, None) is not None
