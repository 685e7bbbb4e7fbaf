"""`pof router` and the KV-event relay, both routing on the locality index (:mod:`pof_connector.locality`).

* :mod:`.serve` — the ``pof router`` command; :mod:`.router_config` its YAML;
* :mod:`.router` — picks a backend per request (policy ``pof``: lowest estimated time to first
  token, from :mod:`.cost_model`); :mod:`.backend` — one engine server and its in-flight requests;
* :mod:`.proxy` — the OpenAI-compatible HTTP proxy in front of the backends;
* :mod:`.relay` — ``pof relay``: an engine's KV events plus its pool's residency for a KV-event
  router; :mod:`.relay_chains` turns engine blocks into pof pages, :mod:`.kv_events` is vLLM's wire
  format, :mod:`.engine_load_poller` reads the engine's load for it.
"""
