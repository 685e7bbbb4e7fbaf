"""Where a prompt's prefix lives, cluster-wide: read from the locality index for routers and people.

* :mod:`.locator` — per live node, the leading pages it holds, its pool can load and its engine
  caches (:class:`~.locator.Locator`); `pof router` and the relay route and announce on it;
* :mod:`.api` — the HTTP locality API (``POST /v1/locality``, ``GET /v1/nodes``, ``/metrics``)
  served by ``pof index serve`` / ``pof index api``;
* :mod:`.engine_load` — an engine's running / waiting requests, read from its ``/metrics`` and
  carried in its index node's meta;
* :mod:`.index_health` — whether the router or the API answers from the index right now (log
  lines, gauge, counter).

May import: ``index``, ``pages``, ``fabric.meta`` (what a node publishes), ``pins`` (the pin routes)
and ``body_limits``. Never the pool: it reads the index, not a node's tiers.
"""
