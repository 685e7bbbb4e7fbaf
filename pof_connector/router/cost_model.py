"""Estimated time to first token of a request on one node: what `pof router` minimises.

    ttft = overhead + queue + recompute_tokens * s_per_token + fetch_s

- ``queue``: prefill tokens of requests already sent to the node that have not produced a first
  token yet, times ``s_per_token``, plus a small delay per running (decoding) request;
- ``recompute_tokens``: prompt tokens neither in the engine's prefix cache nor loadable from the
  pool (the last prompt token is always computed, as engines do);
- ``fetch_s``: tokens loaded from the pool beyond the engine's own hit, times the KV bytes per
  token, over each tier's bandwidth.

``s_per_token`` starts from the configuration and is learnt from observed TTFTs (an exponential
average, clamped so one odd sample cannot swing it by more than 2x).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from pof_connector.router.router_config import CostConfig

LEARN_RATE = 0.2
MIN_LEARN_TOKENS = 32
"""A sample with fewer tokens to compute says more about overheads than about prefill speed."""


@dataclass(frozen=True)
class Candidate:
    """One node as seen for one request."""

    name: str
    prompt_tokens: int
    engine_tokens: int = 0
    """Leading tokens in the engine's own prefix cache."""
    usable: dict[str, int] = field(default_factory=dict)
    """Leading tokens the node's pool can load, per tier."""
    bytes_per_token: float = 0.0
    running: int = 0
    queued_tokens: int = 0
    """Prefill tokens of this node's requests that have no first token yet."""


@dataclass(frozen=True)
class Estimate:
    name: str
    ttft_s: float
    recompute_tokens: int
    fetch_tokens: int
    fetch_s: float
    queue_s: float
    queued_tokens: int


class CostModel:
    def __init__(self, config: CostConfig) -> None:
        self.config = config
        self._s_per_token = config.prefill_s_per_token
        self._lock = threading.Lock()

    @property
    def s_per_token(self) -> float:
        return self._s_per_token

    def estimate(self, c: Candidate) -> Estimate:
        cap = max(c.prompt_tokens - 1, 0)
        engine = min(c.engine_tokens, cap)
        pool_total = sum(c.usable.values())
        pool = min(pool_total, cap)
        cached = max(engine, pool)
        fetch_tokens = max(pool - engine, 0)
        fetch_s = 0.0
        if fetch_tokens and pool_total:
            for tier, n in c.usable.items():
                gbps = self.config.tier_gbps.get(tier, self.config.tier_gbps.get("remote", 1.0))
                fetch_s += fetch_tokens * n / pool_total * c.bytes_per_token / (gbps * 1e9)
        recompute = c.prompt_tokens - cached
        queue_s = c.queued_tokens * self._s_per_token + c.running * self.config.decode_s_per_running
        ttft = self.config.request_overhead_s + queue_s + recompute * self._s_per_token + fetch_s
        return Estimate(c.name, ttft, recompute, fetch_tokens, fetch_s, queue_s, c.queued_tokens)

    def observe(self, est: Estimate, ttft_s: float, running: int) -> None:
        """Learn ``s_per_token`` from a request that took ``ttft_s`` to its first token
        (``running``: requests the node was serving when it was sent)."""
        if not self.config.learn:
            return
        tokens = est.recompute_tokens + est.queued_tokens
        if tokens < MIN_LEARN_TOKENS:
            return
        spent = ttft_s - self.config.request_overhead_s - est.fetch_s - running * self.config.decode_s_per_running
        sample = max(spent, 0.0) / tokens
        with self._lock:
            sample = min(max(sample, self._s_per_token / 2), self._s_per_token * 2)
            self._s_per_token += LEARN_RATE * (sample - self._s_per_token)
