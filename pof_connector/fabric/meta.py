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
        malformed (such a node's pages are simply not remotely readable)."""
        agent, md, raw = meta.get(AGENT_KEY), meta.get(MD_KEY), meta.get(REGIONS_KEY)
        if not agent or not md or not raw:
            return None
        try:
            metadata = base64.b64decode(md, validate=True)
            decoded = json.loads(raw)
        except (binascii.Error, ValueError):
            return None
        if not isinstance(decoded, dict):
            return None
        regions: dict[str, Region] = {}
        for medium, numbers in decoded.items():
            if (not isinstance(numbers, list) or len(numbers) != 4
                    or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers)):
                return None
            base, size, slot_bytes, num_slots = numbers
            if slot_bytes < 1 or slot_bytes * num_slots > size:
                return None
            regions[str(medium)] = Region(str(medium), base, size, slot_bytes, num_slots)
        return cls(agent, metadata, regions)
