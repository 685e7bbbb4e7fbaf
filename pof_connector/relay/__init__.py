"""``pof relay``: one per engine; feeds a stock KV-event router the engine's cache *and* its pool.

* :mod:`.relay` — :class:`~.relay.Relay`: the loop, the engine's residency in the index, its
  index node (heartbeat) and the discovery of other engines' event streams;
* :mod:`.config` — :class:`~.config.RelayConfig`, its endpoints and periods;
* :mod:`.wire` — the ZMQ sockets: the engine's events in, one re-sequenced stream out, vLLM's
  replay protocol, followed peers;
* :mod:`.announcements` — which pages the pool can load, as KV events for routers;
* :mod:`.chains` — engine blocks to pof pages, from ``BlockStored`` events;
* :mod:`.kv_events` — vLLM's KV-event wire format, without importing vLLM;
* :mod:`.engine_load_poller` — the engine's running / waiting requests, read in the background;
* :mod:`.cli` — the ``pof relay`` command.

May import: ``config``, ``pages``, ``index``, ``locality`` and ``cli_support``. Never the pool nor an
adapter: a relay runs beside an engine, not inside it.
"""
