"""The locality index contract: which node holds which page, in which tier, and who is alive.

An index client is bound to at most one node (the one it publishes for); routers and
schedulers use an unbound client that only looks up. Entries of a node whose heartbeat expired
are never returned, and a node that comes back gets a new incarnation: :meth:`heartbeat` then
returns ``True`` and the node re-publishes what it holds. That is also how lookups recover
after the index server restarts empty.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

import numpy as np

from pof_connector.index import record_runs
from pof_connector.pages.keys import PageKey

MEDIA = ("cpu_dram", "cxl", "gpu_hbm", "peer_hbm", "disk", "engine")
"""Media codes stored in the index (position = code). Only append: codes are persistent.
"engine" is an engine's own prefix cache (published by `pof relay`): no pool reads it."""


class IndexUnavailable(RuntimeError):
    """The index could not be reached or answered badly. Callers treat it as a miss."""


class NodeIdTaken(RuntimeError):
    """Another live process registered this client's node id after this client did (a restarted
    node looks the same, so the newer registration holds the id). Raised by
    :meth:`LocalityIndex.heartbeat`; until that registration ends, this client is not registered:
    its publish and withdraw do nothing, and each heartbeat raises again."""


class IndexTimeout(IndexUnavailable):
    """The index did not answer in time: it may be slow (a busy host), not gone. A lookup that
    timed out is a miss, a publish is sent again later; neither is a reason to restart a server."""


@dataclass(frozen=True, slots=True)
class Location:
    """A page's place: ``slot`` of ``node``'s ``medium`` tier, written with ``generation``."""

    node: str
    medium: str
    slot: int
    generation: int


@dataclass(frozen=True)
class TierUsage:
    capacity_bytes: int
    free_bytes: int
    domain: str
    """Who can read this tier with plain loads: equal domains on two nodes mean one shared region."""


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    tiers: dict[str, TierUsage] = field(default_factory=dict)
    meta: dict[str, str] = field(default_factory=dict)
    """Free-form facts peers need (e.g. NIXL agent metadata, the engine's URL)."""

    def to_json(self) -> dict[str, object]:
        return {"node_id": self.node_id, "meta": self.meta,
                "tiers": {m: [t.capacity_bytes, t.free_bytes, t.domain] for m, t in self.tiers.items()}}

    @classmethod
    def from_json(cls, raw: object) -> NodeInfo:
        """Raises ``ValueError`` when ``raw`` is not what :meth:`to_json` makes (a broken or
        hostile index writer)."""
        if not isinstance(raw, dict) or not isinstance(raw.get("node_id"), str):
            raise ValueError("node info: not a map with a node_id")
        tiers, meta = raw.get("tiers", {}), raw.get("meta", {})
        if not isinstance(tiers, dict) or not isinstance(meta, dict):
            raise ValueError("node info: tiers and meta must be maps")
        usage = {}
        for m, numbers in tiers.items():
            if (not isinstance(numbers, list) or len(numbers) != 3
                    or not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers[:2])):
                raise ValueError(f"node info: tier {m!r}: expected [capacity, free, domain]")
            usage[m] = TierUsage(numbers[0], numbers[1], str(numbers[2]))
        return cls(raw["node_id"], usage, {str(k): str(v) for k, v in meta.items()})


LOOKUP_ROUNDS = 4
"""Index queries per lookup at most (:meth:`LocalityIndex.longest_prefix` counts runs from the first
key asked for, so a chain whose pages are held by several nodes in a row is asked for again from
where the runs so far stop): a chain is found across up to this many holders in a row."""


class Matches(dict[str, "PrefixMatch"]):
    """A lookup's answer, node -> its run, and what the index saw beyond the runs: ``held``, the
    leading query pages that some holder (live or not, a run's head or not) has, so page ``held``
    is held by none: a lookup starting there finds nothing. ``None``: the index did not say."""

    __slots__ = ("held",)

    def __init__(self, runs: dict[str, PrefixMatch] | None = None, held: int | None = None) -> None:
        super().__init__(runs or {})
        self.held = held


Resolver = Callable[[int, np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]
"""Reads a holder's slot records: given how many leading pages, their media codes, and the slots and
generations known so far (generation -1: not known), returns all their slots and generations (a
generation still -1: no record, so a miss from that page on)."""


class MatchSource(Protocol):
    """Where a lookup's matches get their media and slots when first asked for (``key``: which match)."""

    def media_of(self, key: int) -> np.ndarray: ...

    def resolve(self, key: int, pages: int, media: np.ndarray, slots: np.ndarray,
                gens: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


class PrefixMatch:
    """One node's leading run of pages: page ``i`` of the query lives at ``media[i]``,
    ``slots[i]``, ``generations[i]`` (media are codes into :data:`MEDIA`).

    An index may answer with the run and its media only (a lookup's reply then does not grow with
    a record per holder and page) and a ``resolve`` that reads the slots when they are first asked
    for: :meth:`resolve` reads only the leading pages a loader takes. A record the read does not
    find (withdrawn since the lookup) cuts the run there."""

    __slots__ = ("_gens", "_key", "_known", "_media", "_pages", "_resolve", "_slots", "_source", "node")

    def __init__(self, node: str, media: np.ndarray | None, slots: np.ndarray | None = None,
                 generations: np.ndarray | None = None, resolve: Resolver | None = None,
                 source: MatchSource | None = None, key: int = 0, pages: int = 0) -> None:
        """``source`` and ``key``: instead of ``media`` and ``resolve``, where both come from when first
        asked for (``pages`` long): a lookup makes one match per holder, and most are never read."""
        self.node = node
        self._media = media
        self._source = source
        self._key = key
        self._pages = len(media) if media is not None else pages
        self._slots = slots
        self._gens = generations
        self._resolve = resolve
        self._known = self._pages if resolve is None and source is None else 0
        """Leading pages whose slots were read (or needed no read)."""

    @property
    def media(self) -> np.ndarray:
        if self._media is None:
            self._media = self._source.media_of(self._key) if self._source is not None else np.zeros(0, np.uint8)
        return self._media

    @property
    def pages(self) -> int:
        return self._pages

    @property
    def slots(self) -> np.ndarray:
        self.resolve(self.pages)
        return self.known()[0]

    @property
    def generations(self) -> np.ndarray:
        self.resolve(self.pages)
        return self.known()[1]

    def resolve(self, pages: int) -> int:
        """Read the slots of the first ``pages`` pages (once); returns how many leading pages have
        them now (fewer when a record was gone: the run is cut there)."""
        pages = min(pages, self.pages)
        if self._slots is None or self._gens is None:
            self._slots = np.full(self.pages, -1, dtype=np.int64)
            self._gens = np.full(self.pages, -1, dtype=np.int64)
        if self._known < pages and (self._resolve is not None or self._source is not None):
            media = self.media
            args = (pages, media[:pages], self._slots[:pages], self._gens[:pages])
            slots, gens = (self._resolve(*args) if self._resolve is not None
                           else self._source.resolve(self._key, *args))   # type: ignore[union-attr]
            self._slots = np.concatenate([slots, self._slots[pages:]])
            self._gens = np.concatenate([gens, self._gens[pages:]])
            good = int(np.argmax(self._gens[:pages] < 0)) if (self._gens[:pages] < 0).any() else pages
            if good < pages:
                self._media, self._slots, self._gens = media[:good], self._slots[:good], self._gens[:good]
                self._pages = good
            self._known = good
        return min(pages, self._known)

    def known(self) -> tuple[np.ndarray, np.ndarray]:
        """The slots and generations read so far (-1 where not yet), without reading more."""
        self.resolve(0)
        assert self._slots is not None and self._gens is not None
        return self._slots, self._gens

    def location(self, i: int) -> Location:
        return Location(self.node, MEDIA[int(self.media[i])], int(self.slots[i]), int(self.generations[i]))

    def per_tier(self) -> dict[str, int]:
        media = self.media
        if len(media) and media[0] == media[-1] and not (media != media[0]).any():
            return {MEDIA[int(media[0])]: len(media)}     # one tier (most runs): np.unique's sort is 5x this
        codes, counts = np.unique(media, return_counts=True)
        return {MEDIA[int(c)]: int(n) for c, n in zip(codes, counts, strict=True)}

    def __repr__(self) -> str:
        return f"PrefixMatch({self.node!r}, pages={self.pages}, resolved={self._known})"

    @classmethod
    def from_source(cls, nodes: Sequence[str | None], pages: Sequence[int], source: MatchSource,
                    held: int | None = None) -> Matches:
        """One match per named node, each as ``cls(node, None, source=source, key=i, pages=pages[i])``
        (``i``: the node's position; a ``None`` node is left out), as :class:`Matches` with ``held``.
        Made without the constructor's argument handling (natively where built: ``slot_objects``): a
        lookup makes one per holder, and at 64 holders the constructor's calls were a tenth of it."""
        nat = record_runs._native          # read at each call: tests switch it off
        if len(nodes) >= _NATIVE_FROM and nat is not None and hasattr(nat, "slot_objects"):
            made = nat.slot_objects(cls, _SOURCED, (list(nodes), None, source, list(range(len(nodes))),
                                                    pages if isinstance(pages, list) else list(pages),
                                                    None, None, None, 0))
            found = Matches(held=held)
            if None in nodes:
                found.update({node: m for node, m in zip(nodes, made, strict=True) if node is not None})
            else:
                found.update(zip(cast("Sequence[str]", nodes), made, strict=True))
            return found
        new = object.__new__
        out: dict[str, PrefixMatch] = {}
        for key, (node, n) in enumerate(zip(nodes, pages, strict=True)):
            if node is None:
                continue
            m = new(cls)
            m.node, m._media, m._source, m._key, m._pages = node, None, source, key, n
            m._slots = m._gens = m._resolve = None
            m._known = 0
            out[node] = m
        return Matches(out, held)


_SOURCED = ("node", "_media", "_source", "_key", "_pages", "_slots", "_gens", "_resolve", "_known")
"""The slots :meth:`PrefixMatch.from_source` sets natively, in the order it gives their values."""
_NATIVE_FROM = 8
"""Matches from which :meth:`PrefixMatch.from_source` makes them natively: the native call has a fixed
part (~0.6 µs: its checks of the slots) that a Python loop over fewer matches does not pay (measured
even at 8, 1.8x faster at 64)."""


class LocalityIndex(ABC):
    """Where pages live, cluster-wide."""

    def __init__(self, node_id: str | None) -> None:
        self.node_id = node_id
        self.on_refused: Callable[[int, str], None] | None = None
        """Called with (how many, why) for records a lookup refused (cut short, an unknown medium):
        what a corrupt or hostile index writer left; their pages are misses. ``None``: not counted."""

    @abstractmethod
    def heartbeat(self, info: NodeInfo, ttl_s: float) -> bool:
        """Keep ``info.node_id`` alive for ``ttl_s`` and store its info.

        Returns ``True`` when this is a new incarnation (first heartbeat, after expiry, or after
        the index lost its data): everything the node holds must be published again.

        A client's first registration ends a live registration of the same node id (the node
        restarted: its former incarnation's entries are never returned again). So a client whose
        node id another live client registered since raises :class:`NodeIdTaken` instead of
        taking it back, until that registration ends.
        """

    @abstractmethod
    def publish(self, entries: Sequence[tuple[PageKey, Location]]) -> None:
        """Record that this client's node holds each key at its location (replacing an older
        location of the same key in the same medium). A location on another node is a page this
        node spilled into a slot that node granted: it is recorded as that node's (it vanishes
        with that node's heartbeat), and dropped when the index does not know that node."""

    @abstractmethod
    def withdraw(self, entries: Sequence[tuple[PageKey, Location]]) -> None:
        """Forget those exact locations (a later location of the same key stays)."""

    @abstractmethod
    def longest_prefix(self, keys: Sequence[PageKey]) -> dict[str, PrefixMatch]:
        """For each live node holding ``keys[0]``, the run of leading keys it holds.

        Keys share one namespace. Nodes with no leading page are absent. An index that knows
        where nothing is held any more may answer :class:`Matches` (saving :func:`~.reach.gather_runs`
        a round that could find nothing).
        """

    @abstractmethod
    def nodes(self) -> list[NodeInfo]:
        """Live nodes and what they last reported."""

    @abstractmethod
    def leave(self) -> None:
        """Deregister this client's node now (its entries stop being returned)."""

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Counts for ``pof index stats``: at least ``locations`` and ``memory_bytes`` (0 when unknown)."""

    # ---- prefix pins (records: :mod:`pof_connector.pins.pin`) --------------------------------

    def put_pin(self, pin_id: str, record: str) -> None:
        """Record (or replace) a prefix pin."""
        raise NotImplementedError(f"{type(self).__name__} keeps no pins")

    def pins(self) -> dict[str, str]:
        """Every pin record, by id (expired ones too: readers check)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no pins")

    def remove_pin(self, pin_id: str) -> bool:
        """Forget a pin; ``False`` when there was none of that id."""
        raise NotImplementedError(f"{type(self).__name__} keeps no pins")

    def close(self) -> None:
        """Release connections."""

    def _require_node(self) -> str:
        if self.node_id is None:
            raise ValueError("this index client is not bound to a node; pass node_id to publish")
        return self.node_id


def node_id_taken(node_id: str) -> NodeIdTaken:
    return NodeIdTaken(f"node id {node_id!r} is registered by another running process, which started after this "
                       f"one (two processes with one node_id: their pages' locations would be confused); give "
                       f"each process its own node_id")


def check_one_namespace(keys: Sequence[PageKey]) -> bytes:
    """The query's namespace. Only the ends are compared: a key from another namespace in the
    middle could only miss (its digest is looked up under the first key's namespace), never
    match wrongly, and scanning 2,000 keys costs a tenth of a lookup."""
    ns = keys[0].namespace
    if keys[-1].namespace != ns:
        raise ValueError("longest_prefix: keys of one query must share a namespace")
    return ns
