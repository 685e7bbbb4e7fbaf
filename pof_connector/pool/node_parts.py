"""What the pool's parts share (:class:`NodeParts`), built once by :class:`~pof_connector.pool.Pool`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pof_connector.config import PofConfig
from pof_connector.index import LocalityIndex, Location
from pof_connector.index.guarded import IndexGuard, LogOnce
from pof_connector.metrics import PoolStats
from pof_connector.pages.keys import PageKey
from pof_connector.pages.layout import PageSpec
from pof_connector.pool.own_tiers import OwnTiers
from pof_connector.pool.publisher import Publisher

if TYPE_CHECKING:
    from pof_connector.fabric.node import FabricNode


@dataclass(frozen=True)
class NodeParts:
    """One node's config, page geometry, tiers, index (and its guard and publisher), counters and
    fabric; ``fabric`` is ``None`` when the fabric is off or the pool is a client."""

    config: PofConfig
    spec: PageSpec
    own: OwnTiers
    index: LocalityIndex
    guard: IndexGuard
    publisher: Publisher
    stats: PoolStats
    log_once: LogOnce
    fabric: FabricNode | None

    def drop_own(self, key: PageKey, medium: str, slot: int) -> bool:
        """Forget this node's page ``key`` if it sits in ``slot`` of its ``medium`` tier (only that
        copy: the key may be stored anew elsewhere) and withdraw that record. False: not there."""
        tier = self.own.get(medium)
        gone = tier.remove(key, slot=slot) if tier is not None else None
        if gone is None:
            return False
        self.publisher.withdraw([(key, Location(self.own.node_id, medium, gone.slot, gone.generation))])
        return True
