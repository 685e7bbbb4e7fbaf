"""Policy ``cache_aware`` (no pool), after vllm-router's / SGLang router's ``cache_aware``.

The router keeps, per node, a tree of the prompts it sent there (not what the engine still
caches: it never hears of an eviction, and a prompt's answer is not in it). When the load is
balanced, a request goes to the node whose tree matches the most of its prompt if that is more
than ``cache_threshold`` of it, else to the least loaded node; when the load is imbalanced (the
busiest node has more than ``balance_abs`` more requests than the idlest and more than
``balance_rel`` times as many), to the least loaded. The routers' defaults: threshold 0.5, abs 32,
rel 1.0001. The tree's periodic trim (every 60 s, to a size per node) is not modelled.

A prompt's leading tokens are its tenant's system prompt, then its session's earlier turns, so a
tree match is the longer of what was sent to the node under the session and under the tenant.
"""

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
        self._sent: dict[str, dict[int, int]] = {}
        """Prefix key -> node -> the most leading tokens under that key sent to the node."""

    def matched(self, job: Job, node: int) -> int:
        """Leading tokens of ``job``'s prompt in ``node``'s tree."""
        session = min(self._sent.get(job.session_key, {}).get(node, 0), job.history_tokens)
        system = min(self._sent.get(job.system_key, {}).get(node, 0), job.request.system_tokens)
        return max(session, system)

    def choose(self, job: Job, nodes: list[NodeView], now: float) -> int:
        node = self._pick(job, nodes)
        for key, tokens in ((job.session_key, job.prompt_tokens), (job.system_key, job.request.system_tokens)):
            sent = self._sent.setdefault(key, {})
            sent[node] = max(sent.get(node, 0), tokens)
        return node

    def _pick(self, job: Job, nodes: list[NodeView]) -> int:
        loads = [n.outstanding() for n in nodes]
        hi, lo = max(loads), min(loads)
        self._next += 1
        start = self._next % len(nodes)       # ties go round the nodes, not always to the first
        order = [(start + i) % len(nodes) for i in range(len(nodes))]
        least = min(order, key=lambda i: loads[i])
        if hi - lo > self.balance_abs and hi > lo * self.balance_rel:
            return least
        matched = [self.matched(job, i) for i in range(len(nodes))]
        best = max(order, key=lambda i: matched[i])
        if matched[best] > self.cache_threshold * job.prompt_tokens:
            return best
        return least
