"""Policy ``cache_aware`` (no pool), after vllm-router's / SGLang router's ``cache_aware``: when the
load is balanced, the node whose prefix cache matches the most of the prompt (if it matches at
least ``cache_threshold`` of it), else the least loaded; when the load is imbalanced (the busiest
node has more than ``balance_abs`` more requests and ``balance_rel`` times the idlest's), the
least loaded. The routers' defaults: threshold 0.5, abs 32, rel 1.0001 (their radix tree is
approximated by the engines' own prefix caches, which is what the tree tracks)."""

from __future__ import annotations

from pof_connector.sim.base import NodeView, Policy
from pof_connector.sim.job import Job


class CacheAware(Policy):
    name = "cache_aware"

    def __init__(self, cache_threshold: float = 0.5, balance_abs: int = 32, balance_rel: float = 1.0001) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self._next = 0

    def choose(self, job: Job, nodes: list[NodeView], now: float) -> int:
        loads = [n.outstanding() for n in nodes]
        hi, lo = max(loads), min(loads)
        self._next += 1
        start = self._next % len(nodes)       # ties go round the nodes, not always to the first
        order = [(start + i) % len(nodes) for i in range(len(nodes))]
        least = min(order, key=lambda i: loads[i])
        if hi - lo > self.balance_abs and hi > lo * self.balance_rel:
            return least
        matched = [n.cached_prefix(job) for n in nodes]
        best = max(order, key=lambda i: matched[i])
        if matched[best] >= self.cache_threshold * job.prompt_tokens:
            return best
        return least
