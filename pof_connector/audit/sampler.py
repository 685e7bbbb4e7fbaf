"""Which pool hits the audit takes."""

from __future__ import annotations

import random

from pof_connector.config.audit_config import AuditConfig


class Sampler:
    """Which pool hits are audited: each with probability ``sample_rate`` (the scheduler asks
    once per request, so a request is audited whole or not at all)."""

    def __init__(self, config: AuditConfig) -> None:
        self.rate = config.sample_rate
        self._rng = random.Random(config.seed)

    def sampled(self) -> bool:
        return self.rate > 0 and (self.rate >= 1 or self._rng.random() < self.rate)
