"""Routing on the locality index: the HTTP query API (more to come: KV-event relay, pof router)."""
