"""What admitting one request would cost a node's KV memory: the capacity half of `pof router`.

A request needs ``ceil((prompt + max_tokens) / block_tokens)`` KV blocks for its life, its whole
prompt counted even where the engine caches a prefix: the engines' usage gauges count cached
blocks that no running request holds as free (they are evicted on demand), and a request reusing
them takes them out of that free pool. (Only a prefix held by another running request costs no
new blocks; counting it anyway errs towards calling a node full.) A node's free blocks are
``(1 - kv_usage) * capacity`` from its last ``/metrics`` reading, less the blocks of requests this
router sent it that the reading does not show (sent since, or still without a first token then:
queued in the engine, which allocates blocks when it schedules a request). The gauges count
the blocks requests hold now, not the ones their remaining output will take: a node full of
young requests looks emptier than it will be. A node is **saturated** for the request when

- the request does not fit in its free blocks (the engine would queue it, or preempt running
  requests to make room), or
- its usage is at or above ``high_watermark`` and it queues requests or preempted one since the
  previous reading (the engine is already trading requests for memory).

Saturated nodes carry an admission cost: the blocks that do not fit are work the engine evicts
and later recomputes (or reloads from the pool), priced at the learnt prefill time per token, and
each request the engine queues costs one request overhead. Without a reading (no metrics, a
stale one, an engine that exports no KV gauges) a node is never saturated: routing is what it
was without capacity awareness.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pof_connector.locality.engine_load import EngineLoad
from pof_connector.router.router_config import CapacityConfig


@dataclass(frozen=True, slots=True)
class Admission:
    need_blocks: int
    """KV blocks the request holds at its longest (prompt + max_tokens)."""
    free_blocks: int | None
    """Free KV blocks the router believes the node has; ``None``: unknown."""
    saturated: bool
    why: str
    """'room', 'no-metrics', 'kv-full' (the request does not fit), 'pressure' (usage over the
    watermark with queued requests or recent preemptions)."""
    cost_s: float = 0.0
    """Estimated admission delay on a saturated node (0 when it has room)."""


@dataclass(frozen=True, slots=True)
class NodePressure:
    """One node's last reading as the router keeps it."""

    load: EngineLoad | None
    """``None``: no (fresh) reading."""
    pending_blocks: int = 0
    """Blocks of this router's requests the reading does not show (sent since, or queued then)."""
    preempting: bool = False
    """Its preemption counter grew between the last two readings."""


class KvAdmission:
    def __init__(self, config: CapacityConfig) -> None:
        self.config = config
        # plain attributes: read for every backend per request (a pydantic field read costs 4x)
        self._enabled = config.enabled
        self._watermark = config.high_watermark
        self._block_tokens = config.block_tokens

    def block_tokens(self, load: EngineLoad | None) -> int:
        return load.block_tokens if load is not None and load.block_tokens else self.config.block_tokens

    def need_tokens(self, prompt_tokens: int, max_tokens: int | None) -> int:
        return prompt_tokens + (self.config.default_max_tokens if max_tokens is None else max_tokens)

    def assess(self, node: NodePressure, need_tokens: int, *, s_per_token: float, overhead_s: float) -> Admission:
        """Admission of a request holding ``need_tokens`` KV tokens (prompt + max_tokens)."""
        return Admission(*self.verdict(node.load, node.pending_blocks, node.preempting, need_tokens,
                                       s_per_token, overhead_s))

    def fit_tokens(self, load: EngineLoad | None, pending_blocks: int, preempting: bool) -> int | None:
        """The most KV tokens (prompt + max_tokens) a request may need and still find the node not
        saturated: ``verdict(...)`` calls it saturated exactly when ``max(need_tokens, 0) > fit``;
        -1: saturated for any request; ``None``: for none (no reading, no capacity known and no
        pressure). It depends on the reading and this router's pending blocks only, not on the
        request: the router keeps it per backend until those change and weighs every backend of
        a request with one comparison. (``ceil(n / bt) > free`` is ``n > free * bt`` for whole
        ``free >= 0``, and always true for ``free < 0``.)"""
        if not self._enabled or load is None or load.kv_usage is None:
            return None
        usage = load.kv_usage
        usage = 0.0 if usage < 0.0 else 1.0 if usage > 1.0 else usage
        if usage >= self._watermark and (load.waiting > 0 or preempting):
            return -1
        if not load.kv_capacity_tokens:
            return None
        bt = load.block_tokens if load.block_tokens else self._block_tokens
        free = math.floor((1.0 - usage) * load.kv_capacity_tokens / bt) - pending_blocks
        return free * bt if free >= 0 else -1

    def verdict(self, load: EngineLoad | None, pending_blocks: int, preempting: bool, need_tokens: int,
                s_per_token: float, overhead_s: float) -> tuple[int, int | None, bool, str, float]:
        """:meth:`assess`'s fields as a tuple, from a :class:`NodePressure`'s (the router weighs
        every backend per request with it, and builds the chosen one's :class:`Admission` only)."""
        bt = load.block_tokens if load is not None and load.block_tokens else self._block_tokens
        need = -(-max(need_tokens, 0) // bt)
        if not self._enabled or load is None or load.kv_usage is None:
            return need, None, False, "no-metrics", 0.0
        usage = load.kv_usage
        usage = 0.0 if usage < 0.0 else 1.0 if usage > 1.0 else usage
        free: int | None = None
        overflow = 0
        if load.kv_capacity_tokens:
            free = math.floor((1.0 - usage) * load.kv_capacity_tokens / bt) - pending_blocks
            overflow = need - free if need > free else 0
        pressed = usage >= self._watermark and (load.waiting > 0 or preempting)
        if not overflow and not pressed:
            return need, free, False, "room", 0.0
        cost = overflow * bt * s_per_token + (load.waiting + 1) * overhead_s
        return need, free, True, "kv-full" if overflow else "pressure", cost
