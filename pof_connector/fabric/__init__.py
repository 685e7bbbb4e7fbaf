"""The fabric: other nodes' tiers read over NIXL (UCX), for nodes that share no memory region.

* :mod:`.meta` — what a node publishes in the locality index so peers can connect lazily;
* :mod:`.agent` — the NIXL agent wrapper (UCX configured from ``fabric`` in the config);
* :mod:`.remote_reader` — batched, deadline-bound, validated remote page reads;
* :mod:`.node` — this node's agent, registered tiers and reader, built by the pool.

NIXL is optional: nothing here imports it until a :class:`FabricNode` is created.
"""

from __future__ import annotations

from pof_connector.fabric.agent import FabricError
from pof_connector.fabric.meta import PeerMeta, Region
from pof_connector.fabric.nixl_api import nixl_installed, require_nixl

__all__ = ["FabricError", "PeerMeta", "Region", "nixl_installed", "require_nixl"]
