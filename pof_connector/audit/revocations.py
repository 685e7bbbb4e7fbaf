"""Pages an audit found wrong, told to their writers through the index's node records.

Withdrawing a page's index record stops every other node from loading it; its writer, though,
finds its own pages in its own books before it asks the index. So the auditing node also lists
the page in its node record (``audit.revoked``), and every node, at its heartbeat, drops the pages
of its own that another node revoked. A node that lies there can only make pages misses."""

from __future__ import annotations

import json
from collections.abc import Iterable

from pof_connector.index.base import Location, NodeInfo
from pof_connector.pages.keys import PageKey

REVOKED_META = "audit.revoked"
KEEP = 256
"""Revocations a node lists at most (the newest): its writers drop them within a heartbeat."""


def encode(entries: Iterable[tuple[PageKey, Location]]) -> str:
    return json.dumps([[k.namespace.hex(), k.digest.hex(), loc.node, loc.medium, loc.slot, loc.generation]
                       for k, loc in list(entries)[-KEEP:]])


def revoked_for(node_id: str, infos: Iterable[NodeInfo]) -> list[tuple[PageKey, Location]]:
    """The pages of ``node_id`` that the nodes of ``infos`` revoked (malformed entries are ignored)."""
    out: list[tuple[PageKey, Location]] = []
    for info in infos:
        raw = info.meta.get(REVOKED_META)
        if info.node_id == node_id or not raw:
            continue
        try:
            for ns, digest, node, medium, slot, generation in json.loads(raw)[:KEEP]:
                if node == node_id:
                    out.append((PageKey(bytes.fromhex(ns), bytes.fromhex(digest)),
                                Location(str(node), str(medium), int(slot), int(generation))))
        except (ValueError, TypeError):
            continue
    return out
