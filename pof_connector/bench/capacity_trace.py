"""The workload of ``pof bench capacity``: a trace of requests, read from JSONL or made by a seed.

One request per line::

    {"at": 0.0, "session": "s1", "tenant": "t1", "system_tokens": 1500, "turn_tokens": 300, "max_tokens": 64}

A session's k-th request is its tenant's system prompt + every earlier turn of the session (its
user tokens and the model's answers) + this turn's ``turn_tokens`` new tokens. Token content is
derived from the ids alone (:func:`tokens_for`), so a trace means the same prompts on any host;
``variant`` changes every token, so repeated runs over one trace share no cached prefix.

The default trace (:func:`fragmenting_trace`) is the capacity problem in miniature: long
multi-turn sessions whose context grows to several times what one request uses, mixed with
short requests of tenants that share system prompts, arriving open-loop, the sessions starting
in uneven bursts so that a placement fixed at the start fills one server while another idles.
Imports no engine.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pof_connector.bench import BenchError

FIELDS: dict[str, type] = {"at": float, "session": str, "tenant": str, "system_tokens": int, "turn_tokens": int,
                           "max_tokens": int}
FIRST_TOKEN = 3
"""Ids 0-2 are BOS, EOS and PAD in the local models: prompts never contain them."""


class TraceError(BenchError):
    """A trace line that is not a request: the message names the line number and the field."""


@dataclass(frozen=True)
class TraceRequest:
    at: float
    """Seconds after the start at which the request arrives (at rate factor 1)."""
    session: str
    tenant: str
    system_tokens: int
    turn_tokens: int
    max_tokens: int


def parse_trace(lines: Iterable[str], source: str = "trace") -> list[TraceRequest]:
    """Every request of a JSONL trace, in order of arrival; blank lines are skipped. Raises
    :class:`TraceError` naming the line and field of the first malformed line."""
    out: list[TraceRequest] = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{source}:{n}: not JSON ({e.msg})") from None
        if not isinstance(raw, dict):
            raise TraceError(f"{source}:{n}: a request is a JSON object, got {type(raw).__name__}")
        unknown = sorted(set(raw) - set(FIELDS))
        if unknown:
            raise TraceError(f"{source}:{n}: field {unknown[0]!r} is unknown; fields: {', '.join(FIELDS)}")
        values: dict[str, Any] = {}
        for name, kind in FIELDS.items():
            if name not in raw:
                raise TraceError(f"{source}:{n}: field {name!r} is missing")
            values[name] = _field(raw[name], name, kind, f"{source}:{n}")
        out.append(TraceRequest(**values))
    if not out:
        raise TraceError(f"{source}: no requests")
    out.sort(key=lambda r: r.at)       # stable: a session's turns keep their order at equal times
    return out


def _field(value: Any, name: str, kind: type, where: str) -> Any:
    if kind is str:
        if not isinstance(value, str) or not value:
            raise TraceError(f"{where}: field {name!r} must be a non-empty string, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TraceError(f"{where}: field {name!r} must be a number, got {value!r}")
    if kind is int:
        if value != int(value):
            raise TraceError(f"{where}: field {name!r} must be a whole number, got {value!r}")
        value = int(value)
        low = 0 if name in ("system_tokens", "turn_tokens") else 1
        if value < low:
            raise TraceError(f"{where}: field {name!r} must be >= {low}, got {value}")
        return value
    if not math.isfinite(value) or value < 0:
        raise TraceError(f"{where}: field {name!r} must be a finite number >= 0, got {value!r}")
    return float(value)


def read_trace(path: Path) -> list[TraceRequest]:
    try:
        text = path.read_text()
    except OSError as e:
        raise TraceError(f"{path}: cannot read the trace: {e.strerror}") from None
    return parse_trace(text.splitlines(), str(path))


def check_sessions(trace: list[TraceRequest]) -> None:
    """A session belongs to one tenant with one system prompt (its later turns extend its context)."""
    first: dict[str, TraceRequest] = {}
    for r in trace:
        f = first.setdefault(r.session, r)
        if (f.tenant, f.system_tokens) != (r.tenant, r.system_tokens):
            raise TraceError(f"session {r.session!r} changes tenant or system_tokens between its turns")


def tokens_for(kind: str, ident: str, n: int, vocab: int, variant: int = 0) -> list[int]:
    """``n`` token ids determined by (``kind``, ``ident``, ``variant``) alone."""
    seed = int.from_bytes(hashlib.sha256(f"{variant}\0{kind}\0{ident}".encode()).digest()[:8], "little")
    rnd = random.Random(seed)
    return [rnd.randrange(FIRST_TOKEN, vocab) for _ in range(n)]


def summary(trace: list[TraceRequest]) -> dict[str, Any]:
    """What the JSON reports about the trace: counts, span, and the longest session context."""
    context: dict[str, int] = {}
    longest = 0
    for r in trace:
        ctx = context.get(r.session, r.system_tokens) + r.turn_tokens
        longest = max(longest, ctx + r.max_tokens)
        context[r.session] = ctx + r.max_tokens
    turns: dict[str, int] = {}
    for r in trace:
        turns[r.session] = turns.get(r.session, 0) + 1
    return {"requests": len(trace), "sessions": len(turns), "tenants": len({r.tenant for r in trace}),
            "multi_turn_sessions": sum(1 for n in turns.values() if n > 1), "span_s": round(trace[-1].at, 3),
            "max_context_tokens": longest, "output_tokens": sum(r.max_tokens for r in trace)}


def write_trace(trace: list[TraceRequest], path: Path) -> None:
    path.write_text("".join(json.dumps(r.__dict__) + "\n" for r in trace))


@dataclass(frozen=True)
class Mix:
    """Shape of the seeded default trace (token counts are in model tokens)."""

    span_s: float = 120.0
    long_sessions: int = 6
    long_turns: int = 6
    long_system_tokens: int = 1024
    long_turn_tokens: int = 384
    long_max_tokens: int = 64
    long_think_s: float = 2.0
    tenants: int = 4
    short_rate: float = 1.0
    short_system_tokens: int = 512
    short_turn_tokens: int = 96
    short_max_tokens: int = 16
    long_tenants: int = 2
    """Tenants the long sessions take turns in (their system prompt is their tenant's)."""
    long_bursts: bool = True
    """The long sessions start in two uneven bursts; False: one after another, evenly over the span
    (jittered), so that a higher arrival factor makes more of them overlap. A conversation's turns
    wait for each other's answers, so with bursts the load a trace can offer stops growing once
    its think times are gone; spread out, it grows with the factor until the conversations overlap."""

    def scaled(self, factor: float) -> Mix:
        """A shorter mix (``--quick``): fewer, shorter sessions over a shorter span."""
        return replace(self, span_s=self.span_s * factor, long_sessions=max(2, round(self.long_sessions * factor)),
                       long_turns=max(3, round(self.long_turns * factor)))


LONG_CONTEXT = Mix(span_s=120.0, long_sessions=6, long_turns=5, long_system_tokens=2048, long_turn_tokens=3584,
                   long_max_tokens=128, long_think_s=8.0, tenants=4, short_rate=0.5, short_system_tokens=1024,
                   short_turn_tokens=192, short_max_tokens=16)
"""``docs/traces/long-context.jsonl`` (:func:`fragmenting_trace` of seed 1): six sessions of five
turns growing to 17K tokens (a 2K system prompt, 1.8K-3.6K new tokens a turn, 128-token answers,
8 s to think), beside short requests of four tenants sharing 1K-token system prompts. Run it with
a model of 32K positions (``--model tiny-long``)."""


LONG_CONTEXT_12 = replace(LONG_CONTEXT, long_sessions=12)
"""``docs/traces/long-context-12.jsonl`` (seed 1): :data:`LONG_CONTEXT` with twelve conversations
(contexts up to 18K tokens): more than two servers run at once, so a conversation waits behind
others on its server unless it moves."""


NEIGHBOUR = replace(LONG_CONTEXT, long_sessions=2, long_tenants=1, long_turns=10, long_turn_tokens=1792,
                    long_think_s=4.0, short_rate=0.1)
"""``docs/traces/neighbour.jsonl`` (seed 1): the idle neighbour. Two conversations of one tenant
(one 2K system prompt) start together and grow over ten turns to about 17K tokens each: together
they outgrow one server's KV (``--kv-tokens 20480``) and fit in two. A router that follows the
shared prefix puts both on the server that holds it, which then evicts and recomputes (or reloads)
while the other serves only a few short requests; a pool lets the second conversation's context
live, and be loaded, anywhere. The conversations' turns are most of the requests (20 of 32), so
the p90 that decides goodput is theirs. Run it with ``--model tiny-long --kv-tokens 20480``."""


NEIGHBOURS = replace(LONG_CONTEXT, long_sessions=24, long_tenants=1, long_turns=4, long_turn_tokens=3072,
                     long_think_s=4.0, short_rate=0.1, long_bursts=False)
"""``docs/traces/neighbours.jsonl`` (seed 1): the idle neighbour, with its load from the number of
conversations. Twenty-four conversations of one tenant (one 2K system prompt) start one after
another over the span and grow over four turns to 10-13K tokens: one fits a server's KV
(``--kv-tokens 20480``), two of the longest do not, and at x1 about three run at once. Raising the
arrival factor shortens the gaps between them and their think times, so more of them overlap: a
router that follows the shared prefix puts them on the server that holds it, which evicts and
recomputes while its neighbour idles; spread over both, each server's contexts still outgrow it
at some factor, and then a context that moved (or was evicted) is loaded from the pool or computed
again. The conversations' turns are 96 of the 117 requests, so the p90 that decides goodput is
theirs. Run it with ``--model tiny-long --kv-tokens 20480``."""
SPREAD_SHARE = 0.85
"""With ``long_bursts`` False, the conversations start within this share of the span (the last
ones still end inside it at x1)."""


def fragmenting_trace(seed: int, mix: Mix = Mix()) -> list[TraceRequest]:
    """The seeded default: long sessions starting in two uneven bursts (most of them early, so a
    placement fixed by the first turn piles them up), short tenant requests arriving Poisson."""
    rnd = random.Random(seed)
    out: list[TraceRequest] = []
    early = math.ceil(mix.long_sessions * 2 / 3)
    for s in range(mix.long_sessions):
        if mix.long_bursts:
            burst = 0.0 if s < early else mix.span_s / 2
            at = burst + rnd.uniform(0, mix.span_s / 10)
        else:
            at = (s + rnd.random()) * SPREAD_SHARE * mix.span_s / mix.long_sessions
        tenant = f"L{s % mix.long_tenants}"
        for _ in range(mix.long_turns):
            out.append(TraceRequest(round(at, 3), f"long{s}", tenant, mix.long_system_tokens,
                                    rnd.randint(mix.long_turn_tokens // 2, mix.long_turn_tokens),
                                    mix.long_max_tokens))
            at += rnd.expovariate(1 / mix.long_think_s)
    at = rnd.expovariate(mix.short_rate)
    k = 0
    while at < mix.span_s:
        t = rnd.randrange(mix.tenants)
        out.append(TraceRequest(round(at, 3), f"short{k}", f"T{t}", mix.short_system_tokens,
                                rnd.randint(mix.short_turn_tokens // 2, mix.short_turn_tokens), mix.short_max_tokens))
        k += 1
        at += rnd.expovariate(mix.short_rate)
    out.sort(key=lambda r: r.at)
    return out
