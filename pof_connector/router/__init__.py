"""`pof router`: an OpenAI-compatible proxy routing on the locality index (:mod:`pof_connector.locality`).

* :mod:`.serve` — the ``pof router`` command; :mod:`.router_config` — its YAML;
* :mod:`.router` — picks a backend per request (policy ``pof``: lowest estimated time to first
  token, from :mod:`.cost_model`); :mod:`.backend` — one engine server and its in-flight requests;
* :mod:`.proxy` — the HTTP proxy in front of the backends.
"""
