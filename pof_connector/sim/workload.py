"""The simulator's requests, and the one place a trace file is read.

A :class:`SimRequest` has the fields of a ``pof bench capacity --trace`` line (``at``, ``session``,
``tenant``, ``system_tokens``, ``turn_tokens``, ``max_tokens``) with the same meaning: a
session's k-th request is its tenant's system prompt + every earlier turn of the session (user
tokens and the model's answers, at their ``max_tokens``) + this turn's new tokens.
"""

from __future__ import annotations

from pathlib import Path

from pof_connector.bench.capacity_trace import TraceRequest, check_sessions, read_trace

SimRequest = TraceRequest
"""One request, exactly a ``pof bench capacity --trace`` line (the bench's own type, so a trace
means the same to the bench and to the simulator)."""


def load_trace(path: Path) -> list[SimRequest]:
    """A JSONL trace in ``pof bench capacity``'s format, read by that bench's own parser (which
    refuses a malformed line naming its number and field)."""
    trace = read_trace(path)
    check_sessions(trace)
    return trace


def multi_turn_sessions(requests: list[SimRequest]) -> set[str]:
    turns: dict[str, int] = {}
    for r in requests:
        turns[r.session] = turns.get(r.session, 0) + 1
    return {s for s, n in turns.items() if n > 1}
