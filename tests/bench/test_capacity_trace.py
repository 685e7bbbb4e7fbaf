"""The capacity bench's trace: the JSONL parser refuses a malformed line by number and field, the
seeded default trace is the fragmenting mix it claims, token content depends on the ids alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pof_connector.bench.capacity_trace import (
    LONG_CONTEXT,
    LONG_CONTEXT_12,
    NEIGHBOUR,
    NEIGHBOURS,
    Mix,
    TraceError,
    TraceRequest,
    check_sessions,
    fragmenting_trace,
    parse_trace,
    read_trace,
    summary,
    tokens_for,
    write_trace,
)

GOOD = {"at": 0.0, "session": "s1", "tenant": "t1", "system_tokens": 1500, "turn_tokens": 300, "max_tokens": 64}


def line(**change: object) -> str:
    raw = {**GOOD, **change}
    return json.dumps({k: v for k, v in raw.items() if v is not ...})


def test_a_good_trace_parses_in_arrival_order() -> None:
    trace = parse_trace([line(at=2.5, session="s2"), "", line(), line(at=1.0, turn_tokens=10)])
    assert [r.at for r in trace] == [0.0, 1.0, 2.5]
    assert trace[0] == TraceRequest(0.0, "s1", "t1", 1500, 300, 64)
    assert isinstance(trace[1].at, float) and trace[1].turn_tokens == 10


@pytest.mark.parametrize(("bad", "says"), [
    ("{not json", "x:2: not JSON"),
    ("[1, 2]", "x:2: a request is a JSON object"),
    (line(at=...), "x:2: field 'at' is missing"),
    (line(session=""), "x:2: field 'session' must be a non-empty string"),
    (line(tenant=3), "x:2: field 'tenant' must be a non-empty string"),
    (line(at=-1), "x:2: field 'at' must be a finite number >= 0"),
    (line(at="soon"), "x:2: field 'at' must be a number"),
    (line(max_tokens=0), "x:2: field 'max_tokens' must be >= 1"),
    (line(turn_tokens=2.5), "x:2: field 'turn_tokens' must be a whole number"),
    (line(system_tokens=True), "x:2: field 'system_tokens' must be a number"),
    (line(colour="red"), "x:2: field 'colour' is unknown"),
])
def test_a_malformed_line_is_refused_with_its_number_and_field(bad: str, says: str) -> None:
    with pytest.raises(TraceError) as e:
        parse_trace([line(), bad, line()], "x")
    assert str(e.value).startswith(says), str(e.value)


def test_an_empty_or_unreadable_trace_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no requests"):
        parse_trace(["", "  "])
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "missing.jsonl")


def test_a_session_keeps_its_tenant() -> None:
    check_sessions(parse_trace([line(), line(at=1.0)]))
    with pytest.raises(TraceError, match="session 's1'"):
        check_sessions(parse_trace([line(), line(at=1.0, tenant="t2")]))


def test_tokens_depend_on_the_ids_and_variant_only() -> None:
    a = tokens_for("turn", "s1/0", 50, vocab=2000)
    assert a == tokens_for("turn", "s1/0", 50, vocab=2000)
    assert a != tokens_for("turn", "s1/1", 50, vocab=2000)
    assert a != tokens_for("turn", "s1/0", 50, vocab=2000, variant=1)
    assert min(a) >= 3 and max(a) < 2000


def test_the_default_trace_fragments_and_round_trips(tmp_path: Path) -> None:
    mix = Mix()
    trace = fragmenting_trace(seed=3, mix=mix)
    assert trace == fragmenting_trace(seed=3, mix=mix) != fragmenting_trace(seed=4, mix=mix)
    check_sessions(trace)
    s = summary(trace)
    assert s["multi_turn_sessions"] == mix.long_sessions and s["tenants"] == 2 + mix.tenants
    # a long session's context grows to several times what one short request uses
    short = mix.short_system_tokens + mix.short_turn_tokens + mix.short_max_tokens
    assert s["max_context_tokens"] >= 4 * short
    # uneven starts: most long sessions begin in the first tenth of the span
    starts = {}
    for r in trace:
        starts.setdefault(r.session, r.at)
    long_starts = [at for name, at in starts.items() if name.startswith("long")]
    assert sum(at < mix.span_s / 10 for at in long_starts) > len(long_starts) / 2
    path = tmp_path / "t.jsonl"
    write_trace(trace, path)
    assert read_trace(path) == trace


@pytest.mark.parametrize(("name", "mix", "conversations"), [("long-context", LONG_CONTEXT, 6),
                                                             ("long-context-12", LONG_CONTEXT_12, 12),
                                                             ("neighbour", NEIGHBOUR, 2)])
def test_the_shipped_long_context_traces_are_their_mix_and_seed(name: str, mix: Mix, conversations: int) -> None:
    shipped = read_trace(Path(__file__).parents[2] / "docs" / "traces" / f"{name}.jsonl")
    assert shipped == fragmenting_trace(1, mix)
    s = summary(shipped)
    assert s["multi_turn_sessions"] == conversations and 16_000 < s["max_context_tokens"] < 32_768 - 128


def test_the_neighbour_traces_conversations_share_a_prefix_and_outgrow_one_server_not_two() -> None:
    trace = read_trace(Path(__file__).parents[2] / "docs" / "traces" / "neighbour.jsonl")
    longs = [r for r in trace if r.session.startswith("long")]
    assert {(r.tenant, r.system_tokens) for r in longs} == {("L0", 2048)}      # one system prompt
    context: dict[str, int] = {}
    for r in longs:
        context[r.session] = context.get(r.session, r.system_tokens) + r.turn_tokens + r.max_tokens
    kv_per_server = 20_480                # the --kv-tokens the docs run it with
    assert max(context.values()) < kv_per_server < sum(context.values()) < 2 * kv_per_server
    firsts = sorted(min(r.at for r in longs if r.session == s) for s in context)
    assert firsts[-1] - firsts[0] < 15.0          # they start together: the first turns meet one holder
    assert len(longs) > len(trace) / 2              # their turns decide the p90


def test_the_neighbours_trace_draws_its_load_from_how_many_conversations_overlap() -> None:
    shipped = read_trace(Path(__file__).parents[2] / "docs" / "traces" / "neighbours.jsonl")
    assert shipped == fragmenting_trace(1, NEIGHBOURS)
    longs = [r for r in shipped if r.session.startswith("long")]
    assert {(r.tenant, r.system_tokens) for r in longs} == {("L0", 2048)}      # one system prompt
    context: dict[str, int] = {}
    starts: dict[str, float] = {}
    for r in longs:
        context[r.session] = context.get(r.session, r.system_tokens) + r.turn_tokens + r.max_tokens
        starts.setdefault(r.session, r.at)
    kv_per_server = 20_480
    longest_two = sorted(context.values())[-2:]
    assert max(context.values()) < kv_per_server < sum(longest_two)     # one fits a server, two do not
    assert len(context) == 24 and len(longs) > 0.8 * len(shipped)
    # spread, not bursts: every sixth of the span sees conversations start, none sees most of them
    first = sorted(starts.values())
    sixth = NEIGHBOURS.span_s / 6
    per_sixth = [sum(k * sixth <= at < (k + 1) * sixth for at in first) for k in range(6)]
    assert min(per_sixth[:5]) >= 2 and max(per_sixth) <= len(first) / 3


def test_bursts_stay_the_default_so_the_shipped_traces_do_not_move() -> None:
    assert Mix().long_bursts and LONG_CONTEXT.long_bursts and NEIGHBOUR.long_bursts
    spread = fragmenting_trace(3, Mix(long_bursts=False, long_sessions=12))
    starts: dict[str, float] = {}
    for r in spread:
        starts.setdefault(r.session, r.at)
    longs = sorted(at for name, at in starts.items() if name.startswith("long"))
    assert longs[-1] > Mix().span_s / 2 and longs[3] > Mix().span_s / 10     # not two bursts
