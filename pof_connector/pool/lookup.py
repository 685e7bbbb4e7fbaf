"""Which sources this node can read: its own tiers, tiers it shares with other nodes (equal
``domain``), other nodes' tiers over the fabric; and :meth:`SourceFinder.lookup`, the leading
pages of a prompt it can load from them (the rule itself: :mod:`pof_connector.index.reach`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pof_connector.fabric import PeerMeta
from pof_connector.fabric.meta import has_fabric_meta
from pof_connector.index import MEDIA, Location, NodeInfo
from pof_connector.index.reach import Reach, Run, gather_runs, reach
from pof_connector.pages.keys import PageKey
from pof_connector.pool.node_parts import NodeParts

if TYPE_CHECKING:
    pass

NODES_MISS_REFRESH_S = 0.05
"""Least age of the node list before an unknown node triggers a refresh."""


@dataclass
class Lookup:
    """The answer to "which leading pages of ``keys`` can this node load?".

    ``sources[i]`` is where page ``i`` will be read from, for ``i < pages``. ``elsewhere`` counts,
    per node, leading pages that exist on that node but that this node cannot read (yet):
    routers use it, loaders ignore it.
    """

    keys: list[PageKey]
    sources: list[Location]
    elsewhere: dict[str, int] = field(default_factory=dict)

    @property
    def pages(self) -> int:
        return len(self.sources)

    def per_tier(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.sources:
            out[s.medium] = out.get(s.medium, 0) + 1
        return out


class SourceFinder:
    """Answers, for node ``own.node_id``, what it can read and from where, from the index and a
    node list at most a heartbeat old. ``fabric``: this node's fabric endpoint (``None``: fabric
    disabled, or a client, which reads nothing itself)."""

    def __init__(self, parts: NodeParts) -> None:
        self.config = parts.config
        self.node_id = parts.own.node_id
        self.own = parts.own
        self.index = parts.index
        self.guard = parts.guard
        self.stats = parts.stats
        self.fabric = parts.fabric
        self.log_once = parts.log_once
        self._nodes_cache: tuple[float, dict[str, NodeInfo]] = (0.0, {})
        self._quarantined: set[str] = set()
        """Writers whose pages this node no longer loads (the audit found too many wrong), until
        they leave the node list and register again."""
        self._peer_metas: dict[str, tuple[dict[str, str], PeerMeta | None]] = {}

    def lookup(self, keys: Sequence[PageKey], *, count: bool = True) -> Lookup:
        """Leading pages of ``keys`` this node can load (own tiers first, then the index).
        ``count=False``: a lookup on behalf of a hit already counted (another TP rank's pages for
        one request): it leaves ``lookups`` and ``hit_pages`` alone."""
        keys = list(keys)
        if count:
            self.stats.add("lookups")
            self.stats.add("lookup_pages", len(keys))
        own: list[Location] = []
        while len(own) < len(keys) and (loc := self.own.find(keys[len(own)])) is not None:
            own.append(loc)
        for key in reversed(keys[:len(own)]):
            self.own.touch(key)       # the prefix head ends most recently used
        got = reach(self.node_id, [], near={}, far={}, own=own)
        if len(own) < len(keys):
            def covered(runs: list[Run]) -> int:
                nonlocal got          # the last round's answer is the lookup's: not computed twice
                got = self._reach(runs, own, len(keys))
                return got.pages

            gather_runs(keys, lambda ks: self.guard.call("lookup", self.index.longest_prefix, ks, default={}),
                        covered)
        result = Lookup(keys, got.sources, got.elsewhere)
        for medium, n in result.per_tier().items() if count else ():
            self.stats.add("hit_pages", n, tier=medium)
        return result

    def quarantine(self, node: str) -> bool:
        """Stop loading ``node``'s pages until it registers again; False if it already was."""
        if node in self._quarantined or node == self.node_id:
            return False
        self._quarantined.add(node)
        return True

    def _reach(self, runs: list[Run], own: list[Location], length: int) -> Reach:
        if self._quarantined:
            runs = [r for r in runs if r[1].node not in self._quarantined]
        holders = {m.node for _, m in runs}
        near = {n: [m for m in MEDIA if self.readable(n, m)] for n in holders}
        far = {n: [m for m in MEDIA if self.remote_meta(n, m) is not None] for n in holders}
        # reach() reads the chosen holders' slot records from the index: guarded as a lookup is
        # (an index lost since the lookup leaves this node's own pages, and is counted once).
        got: Reach | None = self.guard.call(
            "records", lambda: reach(self.node_id, runs, near=near, far=far, own=own, length=length), default=None)
        return got if got is not None else reach(self.node_id, [], near={}, far={}, own=own, length=length)

    def readable(self, node: str, medium: str) -> bool:
        """Can this node read ``node``'s ``medium`` tier with plain loads?"""
        if node == self.node_id:
            return True
        mine = self._domains(self.node_id)
        theirs = self._domains(node)
        return medium in mine and mine[medium] == theirs.get(medium)

    def _domains(self, node: str) -> dict[str, str]:
        if node == self.node_id and self.own.all:
            return {t.medium: t.domain for t in self.own.all}
        info = self.node_info(node)
        return {} if info is None else {m: t.domain for m, t in info.tiers.items()}

    def node_info(self, node: str) -> NodeInfo | None:
        """What ``node`` last reported (from a node list at most a heartbeat old); ``None`` when
        it is not alive in the index."""
        stamp, cache = self._nodes_cache
        age = time.monotonic() - stamp
        # A node we have not heard of yet (the scheduler's lookup may have seen it first) is worth
        # an early refresh: otherwise its pages would be refused as unreachable for up to a second.
        if age > min(1.0, self.config.heartbeat_s) or (node not in cache and age > NODES_MISS_REFRESH_S):
            cache = self.refresh_nodes()
        return cache.get(node)

    def all_nodes(self) -> dict[str, NodeInfo]:
        """Live nodes, from a node list at most a heartbeat old."""
        stamp, cache = self._nodes_cache
        if time.monotonic() - stamp > min(1.0, self.config.heartbeat_s):
            cache = self.refresh_nodes()
        return cache

    def refresh_nodes(self) -> dict[str, NodeInfo]:
        """Read the node list now (on failure keep the last one); returns it."""
        cache = self._nodes_cache[1]
        nodes = self.guard.call("nodes", self.index.nodes, default=None)
        if nodes is not None:
            cache = {n.node_id: n for n in nodes}
            self._quarantined &= cache.keys()     # gone from the list: back with a new incarnation
            if self.fabric is not None:
                self.fabric.peers.retain(cache)    # peers whose heartbeat expired are dropped
        self._nodes_cache = (time.monotonic(), cache)
        return cache

    def remote_meta(self, node: str, medium: str, *, in_backoff: bool = False) -> PeerMeta | None:
        """How to read ``node``'s ``medium`` over the fabric; ``None`` when not that way (fabric
        off, our own node, the node publishes no such region, or, unless ``in_backoff``, it failed
        recently: a lookup then does not offer its pages)."""
        if not self.config.fabric.enabled or node == self.node_id:
            return None
        info = self.node_info(node)
        if info is None:
            return None
        memo = self._peer_metas.get(node)
        if memo is None or memo[0] is not info.meta:
            memo = (info.meta, PeerMeta.from_meta(info.meta))    # decoded once per node list
            self._peer_metas[node] = memo
            if memo[1] is None and has_fabric_meta(info.meta):
                self.stats.add("index_refused", reason="node_meta")
                self.log_once("index-refused-node_meta", logging.WARNING, "pof: refused the fabric metadata "
                              "of node %s (malformed or out of bounds); its pages are not read over the fabric. "
                              "Further ones are counted in pof_index_refused_total", node)
        meta = memo[1]
        if meta is None or medium not in meta.regions:
            return None
        if not in_backoff and self.fabric is not None and not self.fabric.peers.usable(node):
            return None
        return meta

    def peer_meta(self, node: str) -> PeerMeta | None:
        """What ``node`` publishes for the fabric now; ``None`` when it is not alive or publishes none."""
        info = self.node_info(node)
        return None if info is None else PeerMeta.from_meta(info.meta)
