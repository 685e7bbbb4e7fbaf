"""The pool: what an engine adapter calls, and the parts it is built from.

* :mod:`.pool` — :class:`~.pool.Pool`, the one object adapters call (lookup, zero-copy reads,
  loads, stores); it builds :mod:`.node_parts` (what its parts share) and delegates to:
* :mod:`.own_tiers` (this node's tiers), :mod:`.lookup` (the sources a node can read),
  :mod:`.reads` (loads and zero-copy reads, with :mod:`.load_handle` and :mod:`.page_reader`),
  :mod:`.placement` (store, demote, spill), :mod:`.publisher` (publish / withdraw) and
  :mod:`.membership` (heartbeat, re-publish, lost tiers);
* :mod:`.staging` — reusable host buffers the adapters copy pages through;
* :mod:`.chunk_store` — an engine cache's whole chunks (LMCache's) kept as pof pages;
* :mod:`.pin_copies` — copies of a pinned prefix on ``replicas`` nodes, read through the pool's own
  read path and run by its membership;
* :mod:`.memd` and :mod:`.memd_cli` — a memory-only node that lends its tiers (``pof memd``).

May import: ``config``, ``pages``, ``metrics``, ``runtime_dir``, ``tiers``, ``index``, ``fabric``,
``pins`` (the pin book) and ``audit.revocations``. ``tiers``, ``index`` and ``fabric`` never
import this package; ``adapters``, ``audit``, ``bench`` and the CLI build on it.

This module is the pool's public face (what adapters may import, with the faces of ``config``,
``pages``, ``index`` and ``metrics``): :class:`Pool` and its types, :class:`PageReader`,
:class:`StagingPool` and the chunk store.
"""

from pof_connector.pool.chunk_store import ChunkGeometry, ChunkOwner, ChunkStore, chunk_digest, chunk_key
from pof_connector.pool.page_reader import PageReader
from pof_connector.pool.pool import (
    INDEX_BATCH,
    NODES_MISS_REFRESH_S,
    UNWITHDRAWN_MAX,
    LoadHandle,
    Lookup,
    Pool,
    Role,
)
from pof_connector.pool.staging import StagingPool

__all__ = ["INDEX_BATCH", "NODES_MISS_REFRESH_S", "UNWITHDRAWN_MAX", "ChunkGeometry", "ChunkOwner", "ChunkStore",
           "LoadHandle", "Lookup", "PageReader", "Pool", "Role", "StagingPool", "chunk_digest", "chunk_key"]
