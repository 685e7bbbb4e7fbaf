"""The fabric: other nodes' tiers read over NIXL (UCX), for nodes that share no memory region.

"Peer" here means a remote node (another host's pof process), not a GPU of this host as in
:mod:`pof_connector.tiers.peer_hbm`.

* :mod:`.nixl_api` — finding NIXL's Python API without making it a hard dependency;
* :mod:`.agent` — the NIXL agent wrapper (UCX configured from ``fabric`` in the config);
* :mod:`.meta` — what a node publishes in the locality index so peers can connect lazily;
* :mod:`.spans` — how a page is read in layer parts, and the descriptor layout of both ends;
* :mod:`.registered_staging` — pof-owned, NIXL-registered memory remote pages land in (and
  spilled pages leave from); not :mod:`pof_connector.pool.staging`, the adapters' host buffers;
* :mod:`.remote_node` — one connected remote node, its descriptor lists prepared once;
* :mod:`.peers` — the reference-counted connections to remote nodes, with back-off;
* :mod:`.remote_reader` — batched, deadline-bound, validated remote page reads (``RemoteLoad``);
* :mod:`.notifier` — small control messages between nodes over NIXL notifications;
* :mod:`.slot_lender` — the owner's side of spill: free slots granted to other nodes' writers;
* :mod:`.spill_writer` — the writer's side of spill: evicted pages written into granted slots;
* :mod:`.node` — this node's agent, registered tiers, connections, reader and spill, built by the pool.

NIXL is optional: nothing here imports it until a :class:`FabricNode` is created.

May import: ``config``, ``pages``, ``tiers``, ``index`` (and ``metrics``, ``runtime_dir``). Never the
pool (:mod:`pof_connector.pool` builds a :class:`FabricNode`, not the reverse) nor an adapter.
"""

from __future__ import annotations

from pof_connector.fabric.agent import FabricError
from pof_connector.fabric.meta import PeerMeta, Region
from pof_connector.fabric.nixl_api import nixl_installed, require_nixl

__all__ = ["FabricError", "PeerMeta", "Region", "nixl_installed", "require_nixl"]
