"""The index's key names on a Redis-protocol server (the schema: :mod:`.redis`, :mod:`.summary`)."""

from __future__ import annotations

from pof_connector.index.resp import resp

PREFIX = "pof:{pof}:"
K_NODE_INC = PREFIX + "node-inc"
K_INC_NODE = PREFIX + "inc-node"
K_LIVE = PREFIX + "live"
K_INFO = PREFIX + "info"
K_SEQ = PREFIX + "seq"
K_INC_OWNER = PREFIX + "inc-owner"
K_LEASES = PREFIX + "leases"
"""The live ZSET's incarnations and expiries packed in one STRING (``lua/leases.lua``): what a lookup reads."""
K_PINS = PREFIX + "pins"
"""Prefix pins, one field per pin id (in the registry's hash slot on a cluster)."""
REGISTRY_KEYS = [K_NODE_INC, K_INC_NODE, K_LIVE, K_INFO, K_SEQ, K_INC_OWNER, K_LEASES]


def loc_key(namespace: bytes) -> str:
    return f"{PREFIX}loc:{namespace.hex()}"


def segment_key(namespace: bytes) -> str:
    """The namespace's segment summaries (:mod:`.summary`)."""
    return f"{PREFIX}seg:{namespace.hex()}"


def records_key(namespace: bytes) -> str:
    """The namespace's slot records, one field per segment and holder (:mod:`.summary`)."""
    return f"{PREFIX}rec:{namespace.hex()}"


def flat_key(loc: str) -> str:
    """The flag "placeless pages here" of the namespace whose per-page hash is ``loc``."""
    return loc.replace(":loc:", ":flat:", 1)


FLAG_MEMORY_S = 30.0
"""How long a lookup keeps reading a namespace's per-page fields in its first round after it saw
the namespace flagged (placeless pages, e.g. SGLang's without prefix keys): a mixed namespace then
costs one round trip, not two (the first lookup that finds the flag gone stops it)."""

LIVE_QUERY = resp(b"TIME") + resp(b"GET", K_LEASES.encode())
"""A lookup's read of the registry: the server's clock and the leases (:class:`~.live_set.LiveSet`
parses them). One bulk string, not ``ZRANGE live WITHSCORES``'s member and score per holder: at 64
holders that reply cost a lookup 8 us (server, parser and compare), at 128 16 us (measured)."""
