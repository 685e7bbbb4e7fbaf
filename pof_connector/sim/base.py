"""The small interfaces of the simulator: a placement policy, and what a policy may read of a node."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pof_connector.locality.engine_load import EngineLoad
    from pof_connector.sim.job import Job
    from pof_connector.sim.kv_pool import KvPool


class NodeView(ABC):
    """What a placement policy may read of one simulated engine node."""

    @property
    @abstractmethod
    def name(self) -> str: ...

    @abstractmethod
    def outstanding(self) -> int:
        """Requests on the node: running and queued."""

    @abstractmethod
    def cached_prefix(self, job: Job) -> int:
        """Leading prompt tokens of ``job`` in the node's engine prefix cache."""

    @abstractmethod
    def reading(self) -> EngineLoad:
        """What the engine's ``/metrics`` would say now."""


class Policy(ABC):
    """Places each arriving request on a node; told when its requests start and end."""

    name: str
    uses_pool: bool = False
    """The nodes have the pool (store computed pages, load them instead of recomputing)."""

    def bind(self, nodes: list[NodeView], pool: KvPool | None, cached: dict[str, set[int]] | None = None) -> None:
        """The nodes (and pool) of the run about to start; ``cached``: prefix key -> indices of
        the nodes whose engine cache has an entry for it, kept current by the nodes (``None``:
        ask every node)."""

    def tick(self, now: float) -> None:
        """A metrics interval passed (the real router reads its backends' ``/metrics`` then)."""

    @abstractmethod
    def choose(self, job: Job, nodes: list[NodeView], now: float) -> int:
        """Index in ``nodes`` of the node ``job`` goes to."""

    def first_token(self, job: Job, now: float) -> None:
        """``job`` produced its first token."""

    def finished(self, job: Job, now: float) -> None:
        """``job`` ended (finished or failed)."""


class NodeEvents(ABC):
    """What an engine node tells the simulator."""

    def busy_others(self, node: int) -> int:
        """Nodes other than ``node`` running an iteration now (what slows a node whose host they
        share, :attr:`Profile.host_slowdown`)."""
        return 0

    @abstractmethod
    def wake(self, node: int, at: float, version: int) -> None:
        """Call the node's ``wake(at, version)`` at simulated time ``at``."""

    @abstractmethod
    def first_token(self, job: Job, at: float) -> None: ...

    @abstractmethod
    def finished(self, job: Job, at: float) -> None:
        """``job`` ended: finished, or failed (``job.failed``)."""
