"""What a node publishes so that peers can read its tiers: encoded as strings for
:attr:`pof_connector.index.NodeInfo.meta`.

Keys (all strings, under the ``fabric.`` prefix)::

    fabric.agent    the NIXL agent name: "pof/<node_id>/<incarnation>" (a restart changes it)
    fabric.md       base64 of nixl_agent.get_agent_metadata() (a few hundred bytes)
    fabric.regions  JSON {medium: [base address, size, slot_bytes, num_slots]}

No pickle (NIXL's own descriptor serialization is pickle): whoever can write the index must not
be able to run code in readers. Readers build descriptors from the region numbers themselves.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import dataclass

from pof_connector.index.base import MEDIA

MAX_REGION_SLOTS = 1 << 22
"""Most slots a published region may have (a reader prepares descriptors for each: ~100 bytes a
slot). 4M slots of a 2 MiB page are 8 TiB."""
MAX_METADATA_BYTES = 1 << 20
"""Largest agent metadata taken from the index (NIXL's is a few KiB)."""
MAX_AGENT_CHARS = 256
ADDRESS_LIMIT = 1 << 64

AGENT_KEY = "fabric.agent"
MD_KEY = "fabric.md"
REGIONS_KEY = "fabric.regions"


@dataclass(frozen=True)
class Region:
    """One tier's registered memory on its node: ``num_slots`` slots of ``slot_bytes`` from ``base``."""

    medium: str
    base: int
    size: int
    slot_bytes: int
    num_slots: int

    def slot_address(self, slot: int) -> int:
        return self.base + slot * self.slot_bytes


@dataclass(frozen=True)
class PeerMeta:
    """A node's fabric identity: its agent, the agent's metadata, and its readable regions."""

    agent: str
    metadata: bytes
    regions: Mapping[str, Region]

    def to_meta(self) -> dict[str, str]:
        regions = {m: [r.base, r.size, r.slot_bytes, r.num_slots] for m, r in self.regions.items()}
        return {AGENT_KEY: self.agent, MD_KEY: base64.b64encode(self.metadata).decode("ascii"),
                REGIONS_KEY: json.dumps(regions, separators=(",", ":"), sort_keys=True)}

    @classmethod
    def from_meta(cls, meta: Mapping[str, str]) -> PeerMeta | None:
        """Decode a node's meta; ``None`` when the node publishes no fabric metadata or it is
        malformed or out of bounds (such a node's pages are simply not remotely readable): every
        number a non-negative int, a region inside the 64-bit address space with its slots inside
        it and at most :data:`MAX_REGION_SLOTS` of them, media pools read, bounded sizes. Use
        :func:`has_fabric_meta` to tell "publishes none" from "refused"."""
        agent, md, raw = meta.get(AGENT_KEY), meta.get(MD_KEY), meta.get(REGIONS_KEY)
        if not agent or not md or not raw:
            return None
        if len(agent) > MAX_AGENT_CHARS or len(md) > MAX_METADATA_BYTES * 4 // 3 + 4:
            return None
        try:
            metadata = base64.b64decode(md, validate=True)
            decoded = json.loads(raw)
        except (binascii.Error, ValueError, RecursionError):
            return None
        if not isinstance(decoded, dict):
            return None
        regions: dict[str, Region] = {}
        for medium, numbers in decoded.items():
            if (medium not in MEDIA or medium == "engine" or not isinstance(numbers, list) or len(numbers) != 4
                    or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers)):
                return None
            base, size, slot_bytes, num_slots = numbers
            if (slot_bytes < 1 or num_slots > MAX_REGION_SLOTS or slot_bytes * num_slots > size
                    or base + size > ADDRESS_LIMIT):
                return None
            regions[medium] = Region(medium, base, size, slot_bytes, num_slots)
        return cls(agent, metadata, regions)


def has_fabric_meta(meta: Mapping[str, str]) -> bool:
    """Whether a node publishes fabric metadata at all (valid or not)."""
    return AGENT_KEY in meta or REGIONS_KEY in meta
