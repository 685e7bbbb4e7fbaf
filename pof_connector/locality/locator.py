"""Where a prompt's prefix lives, per node: what the locality API answers and `pof router` routes on.

For every live pool node the :class:`Locator` tells

- ``held``: the leading pages the node itself stores, per tier (what ``POST /v1/locality`` shows);
- ``engine_tokens``: the leading tokens sitting in the node's engine prefix cache, known from the
  engine's own KV events (a relay publishes them under the index node ``<node>:engine``, whose
  meta ``engine_of`` names the pool node);
- ``usable``: the leading pages the node's pool can *load*, per tier: its own pages, and pages of
  other nodes in a tier it shares with them (equal ``domain``, e.g. one CXL region) and, when
  both nodes publish fabric metadata, pages in other nodes' tiers it reads over NIXL (tier
  ``"remote"``), taken page by page from the first readable holder, nearest first: the rule
  :meth:`Pool.lookup <pof_connector.pool.Pool.lookup>` loads by (:mod:`pof_connector.index.reach`).

Keys are computed per namespace: every node publishes the namespace digest and page size of
what it stores, and a node is answered with keys of its own namespace.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pof_connector.index import IndexUnavailable, LocalityIndex, NodeInfo
from pof_connector.index.base import MEDIA
from pof_connector.index.reach import ENGINE, Run, gather_runs, reach_media
from pof_connector.locality.engine_load import EngineLoad
from pof_connector.locality.node_view import ModelNodes, NodeView, Space
from pof_connector.locality.page_key_cache import PageKeyCache
from pof_connector.pages.keys import PageKey, page_keys

Tokenizer = Callable[[str], list[int]]
ENGINE_MEDIUM = ENGINE
"""The medium of an engine's own prefix cache in the index (published by `pof relay`)."""
MAX_STALE_TTLS = 10
"""How many ``nodes_ttl_s`` a node list may be old and still answered while the next is read."""
REMOTE = "remote"
"""The ``usable`` tier of pages a node reads from other nodes' tiers over the fabric."""


def load_tokenizer(path: str, *, special_tokens: bool) -> Tokenizer:
    """A ``tokenizers`` tokenizer from a model directory (its tokenizer.json) or a file.
    ``special_tokens``: add them as the engine does for a completions prompt (routing must see the
    engine's exact tokens); the locality API's text queries leave them out."""
    tok = hf_tokenizer(path)
    return lambda text: list(tok.encode(text, add_special_tokens=special_tokens).ids)


def hf_tokenizer(path: str) -> Any:
    """The ``tokenizers.Tokenizer`` of a model directory (its tokenizer.json) or a file."""
    from pathlib import Path

    from tokenizers import Tokenizer as HFTokenizer

    p = Path(path)
    return HFTokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))


class UnknownModel(LookupError):
    """No live node stores the asked model (the message lists the known ones)."""


class ModelRequired(ValueError):
    """The query names no model and the index holds several (or none)."""


@dataclass
class NodeLocality:
    node_id: str
    page_tokens: int
    held: dict[str, int] = field(default_factory=dict)
    """Leading tokens this node stores, per tier."""
    engine_tokens: int = 0
    """Leading tokens in this node's engine prefix cache (0 when no relay reports it)."""
    usable: dict[str, int] = field(default_factory=dict)
    """Leading tokens this node's pool can load, per tier they come from (:data:`REMOTE`: other
    nodes' tiers over the fabric)."""
    near_tokens: int = 0
    """Leading tokens it loads without the fabric (its own tiers and tiers it shares)."""
    load: EngineLoad | None = None
    """The engine's running / waiting requests as its relay last read them; ``None`` when no
    relay reads them (``pof relay --engine-url``)."""
    info: NodeInfo | None = None

    @property
    def held_tokens(self) -> int:
        return sum(self.held.values())

    @property
    def usable_tokens(self) -> int:
        return sum(self.usable.values())


@dataclass(frozen=True)
class Locality:
    model: str
    prompt_tokens: int
    page_tokens: int
    nodes: dict[str, NodeLocality]
    """Every live pool node of the model, also those holding nothing of this prompt."""
    chain: tuple[bytes, ...] = ()
    """The digests of the prompt's full pages of ``page_tokens``, in order, in one namespace (the
    last pool's, as ``page_tokens``): chained, so two prompts with the same digest at place k are
    the same up to the end of page k. The router matches them against the prompts it has in flight
    (:meth:`~pof_connector.router.backend.Backend.in_flight_tokens`); empty: not computed (the
    simulator's locator)."""


class Locator:
    """Answers :meth:`locate` from an index client that is bound to no node."""

    def __init__(self, index: LocalityIndex, *, tokenizers: dict[str, Tokenizer] | None = None,
                 nodes_ttl_s: float = 0.5) -> None:
        self.index = index
        self.tokenizers = dict(tokenizers or {})
        self._nodes_ttl_s = nodes_ttl_s
        self._nodes: tuple[float, list[NodeInfo]] = (-1e9, [])
        self._refreshing = False
        """A thread is reading the node list (:meth:`nodes`)."""
        self._lock = threading.Lock()
        self._page_keys = PageKeyCache()
        """Page keys per shared prefix: most prompts begin with a system prompt seen before."""
        self._view = NodeView([])
        """The last node list read (:meth:`nodes` keeps one list for ``nodes_ttl_s``)."""

    def nodes(self, *, fresh: bool = False) -> list[NodeInfo]:
        """Live nodes, read at most every ``nodes_ttl_s``. Raises ``IndexUnavailable``.

        A list older than that is still answered while a thread reads the next one: reading it
        takes three round trips, which a router paid on every other request at 3 requests/s,
        and a lookup reads the nodes' leases itself, so a list read late only misses a node
        that joined since. A list older than :data:`MAX_STALE_TTLS` ``nodes_ttl_s`` (the index
        was unreachable, or no one asked), and every list when ``fresh``, is read before
        answering."""
        with self._lock:
            stamp, cached = self._nodes
            age = time.monotonic() - stamp
            if not fresh and age <= self._nodes_ttl_s:
                return cached
            if not fresh and age <= self._nodes_ttl_s * MAX_STALE_TTLS:
                if not self._refreshing:
                    self._refreshing = True
                    threading.Thread(target=self._refresh, name="pof-locator-nodes", daemon=True).start()
                return cached
            cached = self.index.nodes()
            self._nodes = (time.monotonic(), cached)
            return cached

    def _refresh(self) -> None:
        """Read the node list for :meth:`nodes` (on its own thread)."""
        got: list[NodeInfo] | None = None
        try:
            got = self.index.nodes()
        except IndexUnavailable:
            pass                # the next lookup meets the same error, and its caller falls back
        finally:
            # one critical section: no caller sees the thread done and the old list still there
            with self._lock:
                self._refreshing = False
                if got is not None:
                    self._nodes = (time.monotonic(), got)

    def view(self, nodes: list[NodeInfo]) -> NodeView:
        """``nodes`` read (the same view while the same list comes back)."""
        view = self._view
        if view.nodes is not nodes:
            view = self._view = NodeView(nodes)
        return view

    def tokenize(self, model: str, text: str) -> list[int] | None:
        """Token ids of ``text``, or ``None`` when no tokenizer for ``model`` was given."""
        tok = self.tokenizers.get(model)
        return tok(text) if tok is not None else None

    def locate(self, tokens: list[int], model: str | None = None, cache_salt: str | None = None, *,
               nodes: list[NodeInfo] | None = None, shared_salt: str | None = None,
               shared_tokens: int = 0) -> Locality:
        """Per node of ``model``, what it holds, has in its engine and can load of ``tokens``;
        ``nodes``: a node list already fetched (``None``: :meth:`nodes`); ``shared_salt``: the
        first ``shared_tokens`` are keyed under it, the rest under ``cache_salt`` (two salts: an
        organisation's prompt, a user's turns; see :class:`~pof_connector.pages.keys.ChainSeeds`).

        Raises :class:`ModelRequired`, :class:`UnknownModel` or ``IndexUnavailable``."""
        view = self.view(self.nodes() if nodes is None else nodes)
        model = _pick_model(view.models, model)
        of = view.of(model)
        keys: dict[Space, list[PageKey]] = {}
        for space in of.spaces:
            if shared_salt is not None and shared_tokens > 0:
                keys[space] = page_keys(space[0], tokens, space[1], cache_salt=cache_salt, shared_salt=shared_salt,
                                        shared_tokens=shared_tokens)
            else:
                keys[space] = self._page_keys(space[0], tokens, space[1], cache_salt=cache_salt)
        # Asked once per namespace for every node: later rounds start where the longest run stops.
        runs = {space: gather_runs(ks, self.index.longest_prefix, _covered) for space, ks in keys.items()}
        last = of.pools[-1][1] if of.pools else None
        chain = tuple(k.digest for k in keys[last]) if last is not None else ()
        return Locality(model, len(tokens), last[1] if last is not None else 0, _per_node(view, of, runs), chain)

    def spaces(self, model: str | None) -> tuple[str, list[tuple[bytes, int]]]:
        """The model (see :meth:`pick_model`) and every (namespace, page tokens) its pool nodes
        store under (one per TP rank and page geometry)."""
        view = self.view(self.nodes(fresh=True))
        model = _pick_model(view.models, model)
        return model, sorted({s for _, s in view.of(model).pools})

    def pick_model(self, model: str | None, *, nodes: list[NodeInfo] | None = None) -> str:
        """``model`` when a live node stores it; the only model when ``None``. Raises
        :class:`ModelRequired` or :class:`UnknownModel`."""
        return _pick_model(self.view(self.nodes() if nodes is None else nodes).models, model)


def _covered(runs: list[Run]) -> int:
    """Where the next lookup round starts: the end of the longest run so far."""
    return max((at + m.pages for at, m in runs), default=0)


def _per_node(view: NodeView, of: ModelNodes, runs: dict[Space, list[Run]]) -> dict[str, NodeLocality]:
    """Every pool node's locality, from the runs found in each space."""
    heads = {space: {m.node: m for at, m in rs if at == 0} for space, rs in runs.items()}
    out: dict[str, NodeLocality] = {}
    for n, space in of.pools:
        page = space[1]
        loc = NodeLocality(n.node_id, page, info=n)
        own = heads[space].get(n.node_id)
        if own is not None:
            loc.held = {m: p * page for m, p in own.per_tier().items()}
        usable, near = _usable(n.node_id, runs[space], view, of)
        loc.usable = {m: p * page for m, p in usable.items()}
        loc.near_tokens = near * page
        eng = of.engines.get(n.node_id)
        if eng is not None:
            eng_node, eng_space, loc.load = eng
            em = heads[eng_space].get(eng_node.node_id)
            loc.engine_tokens = em.pages * page if em is not None else 0
        out[n.node_id] = loc
    return out


def _pick_model(known: list[str], model: str | None) -> str:
    """``model`` among the ``known`` ones, or the only one; raises :class:`ModelRequired` or
    :class:`UnknownModel`."""
    if model is None:
        if len(known) != 1:
            raise ModelRequired(f"'model' is required; the index holds: {known or 'no model yet'}")
        return known[0]
    if model not in known:
        raise UnknownModel(f"no live node stores model {model!r}; known: {known}")
    return model


def _usable(me: str, runs: list[Run], view: NodeView, of: ModelNodes) -> tuple[dict[str, int], int]:
    """Pages per tier that node ``me`` can load (:func:`~pof_connector.index.reach.reach`: its own
    pages, then tiers it shares, then, when both ends publish fabric metadata, other nodes' tiers
    under :data:`REMOTE`), and how many leading ones it loads without the fabric."""
    far_too = me in of.fabric
    near = {h: view.near(of, me, h) for h in {m.node for _, m in runs}}
    far = {h: of.fabric.get(h, frozenset()) for h in near} if far_too else {}
    codes, remote = reach_media(me, runs, near=near, far=far)
    if not len(codes):
        return {}, 0
    if not remote.any():
        first = int(codes[0])
        if int(codes[-1]) == first and not (codes != first).any():
            return {MEDIA[first]: len(codes)}, len(codes)      # one tier (most runs)
        per_code = np.bincount(codes, minlength=1)
        # tiers in the order their first page comes, as a page walk would meet them
        firsts = sorted((int(np.argmax(codes == c)), c) for c in np.flatnonzero(per_code).tolist())
        return {MEDIA[c]: int(per_code[c]) for _, c in firsts}, len(codes)
    per_tier: dict[str, int] = {}
    for code, far_read in zip(codes.tolist(), remote.tolist(), strict=True):
        tier = REMOTE if far_read else MEDIA[code]
        per_tier[tier] = per_tier.get(tier, 0) + 1
    return per_tier, int(np.argmax(remote))
