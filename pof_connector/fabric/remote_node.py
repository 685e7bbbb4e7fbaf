"""One connected remote node (another host's pof process; "peer" in the fabric's sense, not a GPU of
this host as in :mod:`pof_connector.tiers.peer_hbm`): its NIXL agent loaded into ours, with
descriptor lists prepared once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pof_connector.fabric.agent import FabricError, NixlAgent
from pof_connector.fabric.meta import PeerMeta
from pof_connector.fabric.spans import span_descs
from pof_connector.pages.layout import GENERATION_AT


class RemoteNode:
    """``dlists[medium]`` is a prepared list over that region: descriptor ``s`` reads the page in
    slot ``s`` (``page_bytes`` from the slot start), descriptor ``num_slots + s`` reads the slot's
    live generation word, then, with several ``spans`` (byte ranges of a page), descriptor
    ``span_base(c, num_slots, len(spans)) + s`` reads span ``c`` of slot ``s`` (see
    :func:`~pof_connector.fabric.spans.span_base`). Preparing once costs ~1 ms per 1,000
    descriptors; each load then only passes index arrays (0.06 ms instead of 0.2-0.3 ms per request)."""

    def __init__(self, agent: NixlAgent, node: str, meta: PeerMeta, page_bytes: int,
                 spans: Sequence[tuple[int, int]] = ()) -> None:
        self.node = node
        self.meta = meta
        self.name = agent.add_peer(meta.metadata)
        self.dlists: dict[str, tuple[Any, int]] = {}
        self.inflight = 0         # reads using this peer now; it is disconnected only at zero
        self.closing = False
        try:
            for medium, region in meta.regions.items():
                if region.slot_bytes < page_bytes:
                    continue        # slots of another geometry cannot hold our pages: not readable
                n = region.num_slots
                starts = region.base + np.arange(n, dtype=np.uint64) * np.uint64(region.slot_bytes)
                descs = np.zeros((2 * n, 3), dtype=np.uint64)
                descs[:n, 0] = starts
                descs[:n, 1] = page_bytes
                descs[n:, 0] = starts + np.uint64(GENERATION_AT)
                descs[n:, 1] = 8
                descs = np.concatenate([descs, span_descs(starts, spans)])
                self.dlists[medium] = (agent.prep(self.name, descs), n)
        except FabricError:
            self.close(agent)
            raise

    def close(self, agent: NixlAgent) -> None:
        """Release the prepared lists and disconnect (the next use connects again from fresh metadata)."""
        for handle, _ in self.dlists.values():
            agent.release_dlist(handle)
        self.dlists.clear()
        agent.remove_peer(self.name)
