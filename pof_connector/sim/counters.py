"""What one simulated run counts, over all its nodes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Counters:
    computed_tokens: int = 0
    """Prompt tokens the engines computed (prefill, re-prefill after a preemption)."""
    recomputed_tokens: int = 0
    """Of those, tokens some node had computed before (another turn's context, a shared system
    prompt computed elsewhere, a preempted request's own context): what the pool could have loaded."""
    loaded_tokens: int = 0
    """Prompt tokens loaded from the pool instead of computed."""
    cache_hit_tokens: int = 0
    """Prompt tokens found in the engine's own prefix cache."""
    preemptions: int = 0
    failed: int = 0
