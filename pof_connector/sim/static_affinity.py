"""Policy ``static``: a conversation stays on the node its session id hashes to, a one-off request
goes to its tenant's node; no pool (the problem statement's static allocation, as ``pof bench
capacity`` places it)."""

from __future__ import annotations

import hashlib

from pof_connector.sim.base import NodeView, Policy
from pof_connector.sim.job import Job


def stable_hash(key: str) -> int:
    """The bench's hash (first 4 bytes of SHA-256, little-endian), so both place a trace alike."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little")


class StaticAffinity(Policy):
    name = "static"

    def __init__(self, multi_turn: set[str]) -> None:
        self.multi_turn = multi_turn
        """Sessions with more than one turn (the others are placed by tenant)."""

    def choose(self, job: Job, nodes: list[NodeView], now: float) -> int:
        r = job.request
        return stable_hash(r.session if r.session in self.multi_turn else r.tenant) % len(nodes)
