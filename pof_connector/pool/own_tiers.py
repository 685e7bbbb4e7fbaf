"""This node's tiers as the pool's parts see them: the live ones, and where a key is in them."""

from __future__ import annotations

from pof_connector.index import Location
from pof_connector.pages.keys import PageKey
from pof_connector.tiers import Tier


class OwnTiers:
    """The tiers of node ``node_id``, in order (first: where pages are stored). A tier lost while
    running is :meth:`mark_broken`: never read or written again."""

    def __init__(self, node_id: str, tiers: list[Tier]) -> None:
        self.node_id = node_id
        self.all = tiers
        self._by_medium = {t.medium: t for t in tiers}
        self._broken: set[str] = set()

    def live(self) -> list[Tier]:
        return [t for t in self.all if t.medium not in self._broken]

    def get(self, medium: str) -> Tier | None:
        """The tier of ``medium``, broken or not; ``None`` when this node has none."""
        return self._by_medium.get(medium)

    def is_broken(self, medium: str) -> bool:
        return medium in self._broken

    def mark_broken(self, medium: str) -> None:
        self._broken.add(medium)

    def find(self, key: PageKey) -> Location | None:
        """Where a live tier holds ``key`` (without touching its LRU); ``None``: nowhere."""
        for tier in self.live():
            ref = tier.find(key, touch=False)
            if ref is not None:
                return Location(self.node_id, tier.medium, ref.slot, ref.generation)
        return None

    def touch(self, key: PageKey) -> None:
        """Mark ``key`` most recently used in the first live tier that holds it."""
        for tier in self.live():
            if tier.find(key) is not None:
                return

    def contains(self, key: PageKey) -> bool:
        """True when a live tier stores (or is storing) ``key``."""
        return any(t.contains(key) for t in self.live())

    def entries(self, tier: Tier) -> list[tuple[PageKey, Location]]:
        """Every page ``tier`` stores, as index entries of this node."""
        return [(key, Location(self.node_id, tier.medium, ref.slot, ref.generation)) for key, ref in tier.stored()]
