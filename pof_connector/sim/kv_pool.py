"""The cluster's KV pool as the simulator sees it: what each node's pool stores (by prefix key,
least-recently-used eviction within its room), where a node loads a prefix from, and the bytes
each tier moved.

A node's pool stores the pages its engine computes (prompt, and output at the end or at a
preemption) in its local tier; it loads its own pages back from that tier and other nodes'
over the remote tier (the fabric, or a shared CXL region). A private pool (``shared=False``, the
per-server CPU tier every baseline of ``pof bench capacity`` has since issue 47) keeps the same
room per node and loads only its own pages.
"""

from __future__ import annotations

from collections import OrderedDict

from pof_connector.sim.profile import Profile, TierProfile


class KvPool:
    def __init__(self, profile: Profile, nodes: int, *, shared: bool = True) -> None:
        self.profile = profile
        self.shared = shared
        self._stores: list[OrderedDict[str, int]] = [OrderedDict() for _ in range(nodes)]
        self._used = [0] * nodes
        self._where: dict[str, dict[int, int]] = {}
        """key -> {node: tokens stored}"""
        self.loaded_bytes: dict[str, int] = {profile.local_tier.name: 0, profile.remote_tier.name: 0}
        self.stored_bytes = 0

    def store(self, node: int, key: str, tokens: int) -> None:
        """``node``'s pool keeps ``key``'s first ``tokens`` (block-aligned; only what it lacks moves)."""
        tokens -= tokens % self.profile.block_tokens
        store = self._stores[node]
        have = store.get(key, 0)
        if tokens <= have:
            if have:
                store.move_to_end(key)
            return
        room = self.profile.pool_tokens
        if tokens > room:
            return
        self.stored_bytes += (tokens - have) * self.profile.kv_bytes_per_token
        store[key] = tokens
        store.move_to_end(key)
        self._used[node] += tokens - have
        self._where.setdefault(key, {})[node] = tokens
        while self._used[node] > room:
            old, n = store.popitem(last=False)
            self._used[node] -= n
            holders = self._where[old]
            del holders[node]
            if not holders:
                del self._where[old]

    def drop(self, key: str) -> None:
        """``key`` will never be asked for again (a finished request's preemption copy)."""
        for node in self._where.pop(key, {}):
            self._used[node] -= self._stores[node].pop(key)

    def holders(self, key: str) -> dict[int, int]:
        """Nodes whose pool stores ``key`` -> the tokens they store (do not modify)."""
        return self._where.get(key, {})

    def own(self, node: int, key: str) -> int:
        return self._stores[node].get(key, 0)

    def best(self, node: int, key: str) -> tuple[int, TierProfile | None]:
        """The most leading tokens of ``key`` that ``node`` can load, and the tier they come over
        (``None``: none stored)."""
        holders = self._where.get(key)
        if not holders:
            return 0, None
        own = holders.get(node, 0)
        if not self.shared:
            return (own, self.profile.local_tier) if own else (0, None)
        other = max(holders.values())
        if own >= other:
            return own, self.profile.local_tier
        return other, self.profile.remote_tier

    def load(self, node: int, key: str, tokens: int, tier: TierProfile) -> float:
        """Seconds ``node`` spends loading ``tokens`` of ``key`` over ``tier`` (counts the bytes)."""
        nbytes = tokens * self.profile.kv_bytes_per_token
        self.loaded_bytes[tier.name] += nbytes
        if tier is self.profile.local_tier:
            self._stores[node].move_to_end(key)
        return tier.load_s(nbytes)
