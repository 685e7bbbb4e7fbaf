"""pof-connector: PagedAttention over Fabrics — a cluster-wide KV-cache pool for stock vLLM and SGLang.

The core (this package) imports no engine. Its modules:

* :mod:`.config` — one validated config; :mod:`.keys` — page keys; :mod:`.pages` — page layout;
* :mod:`.pool` — :class:`~.pool.Pool`, what adapters call; it builds :mod:`.node_parts` (what its parts
  share) and delegates to :mod:`.own_tiers`
  (this node's tiers), :mod:`.lookup` (the sources a node can read), :mod:`.reads` (loads and
  zero-copy reads, with :mod:`.load_handle` and :mod:`.page_reader`), :mod:`.placement` (store,
  demote, spill), :mod:`.publisher` (publish / withdraw) and :mod:`.membership` (heartbeat,
  re-publish, lost tiers);
* :mod:`.staging` — reusable host buffers the adapters copy pages through;
* :mod:`.chunk_store` — an engine cache's whole chunks (LMCache's) kept as pof pages;
* :mod:`.metrics` — the pool's counters and their Prometheus export;
* :mod:`.memd` — a memory-only node that lends its tiers (``pof memd``);
* :mod:`.cli` — the ``pof`` command, assembled from each group's registration (:mod:`.cli_support`,
  :mod:`.memd_cli`, ``index.cli``, ``bench.cli``, ``relay.cli``, ``router.serve``); :mod:`.console`;
* packages: ``index`` (where pages live), ``locality`` (where a prompt's prefix lives, for
  routers), ``router``, ``relay``, ``fabric`` (remote reads over NIXL), ``bench``, ``tiers`` (media)
  and ``adapters`` (vLLM, SGLang, LMCache).
"""

__version__ = "0.1.0"
