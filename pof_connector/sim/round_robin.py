"""Policy ``round_robin``: each request to the next node; no pool."""

from __future__ import annotations

from pof_connector.sim.base import NodeView, Policy
from pof_connector.sim.job import Job


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, job: Job, nodes: list[NodeView], now: float) -> int:
        self._next += 1
        return (self._next - 1) % len(nodes)
