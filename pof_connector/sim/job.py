"""One request in flight in the simulator: its prompt, where it is, and what happened to it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pof_connector.sim.workload import SimRequest


@dataclass(eq=False, slots=True)
class Job:
    id: int
    request: SimRequest
    arrival: float
    """Simulated arrival time (the trace's ``at`` scaled by the rate factor)."""
    history_tokens: int
    """Leading prompt tokens earlier turns of its session built (system prompt + earlier turns and
    answers); the system prompt alone for a first turn."""
    prompt_tokens: int
    known_tokens: int = 0
    """Leading tokens some node computed before this request arrived (first touch is not a recompute)."""
    computed: int = 0
    """Leading tokens of its context computed (or loaded) so far: recomputing them after a
    preemption is a recompute."""
    cached_tokens: int = 0
    """Prompt tokens its first prefill did not compute (engine cache and pool): what the engine
    reports as ``cached_tokens``."""
    node: int = -1
    generated: int = 0
    """Output tokens so far (kept across a preemption)."""
    offset: int = 0
    """While decoding: its context length minus its node's decode step counter."""
    blocks: int = 0
    """KV blocks it holds now."""
    first_token_at: float | None = None
    """``None``: no first token yet."""
    index_s: float = 0.0
    """What the locality index added to its TTFT (:mod:`~pof_connector.sim.index_cost`)."""
    done_at: float | None = None
    failed: bool = False
    preemptions: int = 0
    ticket: Any = None
    """The policy's own handle (the real router's ticket, for policy pof)."""
    decision: Any = None

    session_key: str = ""
    """The key of its session's context in prefix caches and pools (set on creation)."""
    system_key: str = ""
    """The key of its tenant's system prompt (set on creation)."""

    def __post_init__(self) -> None:
        self.session_key = "s:" + self.request.session
        self.system_key = "t:" + self.request.tenant

    @property
    def context(self) -> int:
        """Tokens it holds KV for once prefilled: prompt and output so far."""
        return self.prompt_tokens + self.generated

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival
