"""What :class:`~pof_connector.locality.locator.Locator` reads of a node list, worked out once per list.

The locator fetches the live nodes at most every ``nodes_ttl_s`` (0.5 s in a router) and answers
many lookups from one list: each lookup used to parse every node's namespace (hex), page size,
tier domains, fabric metadata and engine load again, and to compare every holder's tier domains
with the asking node's, about a sixth of a router's lookup (4 nodes, issue 42). A view holds those
facts for one list; the locator builds a new one when the list changes.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

from pof_connector.fabric.meta import AGENT_KEY, MD_KEY, REGIONS_KEY, PeerMeta
from pof_connector.index import NodeInfo
from pof_connector.locality.engine_load import EngineLoad

Space = tuple[bytes, int]
"""(namespace digest, page tokens): what a node's pages are keyed under."""


@dataclass(frozen=True)
class ModelNodes:
    """The nodes of one model in a node list."""

    pools: list[tuple[NodeInfo, Space]]
    """Its pool nodes (those publishing a namespace and page size), in list order."""
    engines: dict[str, tuple[NodeInfo, Space, EngineLoad | None]]
    """Per pool node id, the index node of its engine's prefix cache (a relay's ``<node>:engine``),
    its space and the engine's load as the relay published it."""
    spaces: list[Space]
    """Every space a lookup keys the prompt under: the pools', then the engines' not among them."""
    domains: dict[str, dict[str, str]]
    """Per pool node, its tiers' domains (equal domains: one shared region)."""
    fabric: dict[str, frozenset[str]]
    """Per pool node publishing fabric metadata, the media peers read of it over the fabric."""


class NodeView:
    """One node list (:meth:`LocalityIndex.nodes <pof_connector.index.base.LocalityIndex.nodes>`'s
    answer), read: models, spaces, domains, fabric media and engine loads, per model on first use.
    Not to be mutated; the list it was built from is kept to tell whether a list is the same one."""

    def __init__(self, nodes: list[NodeInfo]) -> None:
        self.nodes = nodes
        self.models = sorted({n.meta["model"] for n in nodes if n.meta.get("model") and "engine_of" not in n.meta})
        """The models of the live pool nodes (engine nodes name none)."""
        self._of: dict[str, ModelNodes] = {}
        self._near: dict[tuple[str, str], list[str]] = {}

    def of(self, model: str) -> ModelNodes:
        """The nodes of ``model`` (worked out on first use; a dict write, so safe across threads)."""
        got = self._of.get(model)
        if got is None:
            got = self._of[model] = self._model_nodes(model)
        return got

    def _model_nodes(self, model: str) -> ModelNodes:
        pools = [(n, s) for n in self.nodes if n.meta.get("model") == model and "engine_of" not in n.meta
                 and (s := space_of(n)) is not None]
        engines = {n.meta["engine_of"]: (n, s, EngineLoad.from_meta(n.meta)) for n in self.nodes
                   if "engine_of" in n.meta and (s := space_of(n)) is not None}
        spaces = list(dict.fromkeys([s for _, s in pools] + [s for _, s, _ in engines.values()]))
        domains = {n.node_id: {m: t.domain for m, t in n.tiers.items()} for n, _ in pools}
        fabric = {n.node_id: media for n, _ in pools if (media := fabric_media(n.meta)) is not None}
        return ModelNodes(pools, engines, spaces, domains, fabric)

    def near(self, nodes: ModelNodes, me: str, holder: str) -> list[str]:
        """The tiers of ``holder`` that ``me`` reads with plain loads: those with equal domains."""
        key = (me, holder)
        got = self._near.get(key)
        if got is None:
            mine, theirs = nodes.domains.get(me, {}), nodes.domains.get(holder, {})
            got = self._near[key] = [m for m, d in mine.items() if theirs.get(m) == d]
        return got


def space_of(n: NodeInfo) -> Space | None:
    """The (namespace, page tokens) ``n`` publishes; ``None`` when it publishes no pages."""
    ns, page = n.meta.get("namespace"), n.meta.get("page_tokens")
    if not (ns and page):
        return None
    return bytes.fromhex(ns), int(page)


def fabric_media(meta: Mapping[str, str]) -> frozenset[str] | None:
    """The media a node lets peers read over the fabric; ``None`` when it publishes none."""
    return _decoded_media(meta.get(AGENT_KEY), meta.get(MD_KEY), meta.get(REGIONS_KEY))


@functools.lru_cache(maxsize=1024)
def _decoded_media(agent: str | None, md: str | None, regions: str | None) -> frozenset[str] | None:
    # A view is built per node list, and a locator whose lists live no time (``nodes_ttl_s=0``)
    # builds one per lookup: the metadata only changes when a node restarts, so it is decoded once
    # per published value.
    published = {k: v for k, v in ((AGENT_KEY, agent), (MD_KEY, md), (REGIONS_KEY, regions)) if v is not None}
    pm = PeerMeta.from_meta(published)
    return None if pm is None else frozenset(pm.regions)
