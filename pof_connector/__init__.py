"""pof-connector: PagedAttention over Fabrics — a cluster-wide KV-cache pool for stock vLLM and SGLang.

The core imports no engine. Its packages, from the bottom up (each ``__init__`` says what it
holds and what it may import; docs/layout.md has the whole tree, tests/test_import_rules.py
checks the rules):

* ``config`` — one validated config, credentials, the ``pd``, ``tenants`` and ``audit`` keys;
* ``pages`` — page keys, the page layout, its checksums (numpy, the native kernel, torch, Triton);
* ``tiers`` — the media a node stores pages in (CPU DRAM, CXL, peer HBM);
* ``index`` — where pages live, cluster-wide (the locality index);
* ``fabric`` — other nodes' tiers read over NIXL;
* ``pool`` — :class:`~pof_connector.pool.Pool`, what adapters call, and its parts; ``pof memd``;
* ``adapters`` — vLLM, SGLang and LMCache; they import only the core's public face;
* ``audit``, ``pins``, ``locality`` (where a prompt's prefix lives, for routers), ``relay``,
  ``router``, ``bench``, ``sim``.

Loose modules: :mod:`.metrics` (the pool's counters and their Prometheus export),
:mod:`.runtime_dir` (the owner-only runtime directory), :mod:`.body_limits` (bounded HTTP request
bodies), and the ``pof`` command: :mod:`.cli`, assembled from each group's registration, with
:mod:`.cli_support` and :mod:`.console`.
"""

__version__ = "0.1.0"
