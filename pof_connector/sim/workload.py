"""The simulator's requests, and the one place a trace file is read.

A :class:`SimRequest` has the fields of a ``pof bench capacity --trace`` line (``at``, ``session``,
``tenant``, ``system_tokens``, ``turn_tokens``, ``max_tokens``) with the same meaning: a
session's k-th request is its tenant's system prompt + every earlier turn of the session (user
tokens and the model's answers, at their ``max_tokens``) + this turn's new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pof_connector.config import ConfigError


@dataclass(frozen=True, slots=True)
class SimRequest:
    at: float
    session: str
    tenant: str
    system_tokens: int
    turn_tokens: int
    max_tokens: int


def load_trace(path: Path) -> list[SimRequest]:
    """A JSONL trace in ``pof bench capacity``'s format, read by that bench's own parser (which
    refuses a malformed line naming its number and field); the one place to switch readers."""
    try:
        # the capbench branch brings it; until it is merged --trace says so (the ignore is then unused)
        from pof_connector.bench.capacity_trace import (  # type: ignore[import-not-found,unused-ignore]
            check_sessions,
            read_trace,
        )
    except ImportError:
        raise ConfigError("--trace needs pof bench capacity's trace reader (pof_connector.bench.capacity_trace), "
                          "which this build does not have; use --mix") from None
    trace = read_trace(path)
    check_sessions(trace)
    return [SimRequest(r.at, r.session, r.tenant, r.system_tokens, r.turn_tokens, r.max_tokens) for r in trace]


def multi_turn_sessions(requests: list[SimRequest]) -> set[str]:
    turns: dict[str, int] = {}
    for r in requests:
        turns[r.session] = turns.get(r.session, 0) + 1
    return {s for s, n in turns.items() if n > 1}
