"""`pof bench router`'s reading of `pof router`'s answer headers (its own time, per stage, and
its choices); a stock router's answers carry none, and get no routing summary. Its ranking over
rounds (`rank`), from passes whose TTFTs are given here as numbers: the servers that would measure
them need vLLM, which runs in the vllm-marked tests."""

from __future__ import annotations

import dataclasses

import pytest

from pof_connector.bench import BenchError
from pof_connector.bench.router import (
    BLOCK,
    STOCK,
    WARM_UP_REQUESTS,
    PhaseRun,
    Workload,
    engine_means,
    make_workload,
    rank,
    request_routing,
    round_order,
    routing_summary,
    run,
    steal_seconds,
    summarize,
    warm_up_workload,
)


def test_summary_of_pof_router_headers() -> None:
    headers = [{"x-pof-router-overhead": f"{0.001 * (i + 1):.6f}", "x-pof-backend": "n0" if i % 4 else "n1",
                "x-pof-route-reason": "load-balanced" if i % 2 else "prefix-holder",
                "x-pof-router-stages": f"parse=0.0001,lookup={0.0002 * (i + 1):.4f}",
                "x-pof-estimated-ttft": "0.0500"} for i in range(100)]
    ttfts = [0.04] * 100
    s = routing_summary(headers, ttfts)
    assert s["overhead_p50_ms"] == 50.0 and s["overhead_p99_ms"] == 99.0
    assert s["stages_p50_ms"] == {"parse": 0.1, "lookup": 10.0} and s["stages_p99_ms"]["lookup"] == 19.8
    assert s["backends"] == {"n1": 25, "n0": 75}
    assert s["route_reasons"] == {"prefix-holder": 50, "load-balanced": 50}
    assert s["estimate_minus_ttft_mean_s"] == 0.01 and s["estimate_abs_error_mean_s"] == 0.01


def test_a_stock_router_has_no_summary() -> None:
    assert routing_summary([{"content-type": "text/event-stream"}] * 3, [0.1] * 3) == {}
    assert "routing_by_round" not in summarize([_pass([0.1, 0.2])], _work())


def test_each_request_keeps_where_pof_sent_it_and_what_it_expected() -> None:
    """A slow request is read against its own routing, round by round (ttft_s_by_round's order)."""
    sent = {"x-pof-router-overhead": "0.003100", "x-pof-backend": "n1", "x-pof-reason": "pof",
            "x-pof-route-reason": "prefix-holder", "x-pof-estimated-ttft": "0.07123"}
    fallback = {"x-pof-router-overhead": "0.000400", "x-pof-backend": "n0", "x-pof-reason": "fallback:IndexUnavailable"}
    assert request_routing(sent) == ["n1", "prefix-holder", 0.0712, 3.1]
    assert request_routing(fallback) == ["n0", "fallback:IndexUnavailable", None, 0.4]
    runs = [dataclasses.replace(_pass([0.1, 0.2]), headers=[sent, fallback]),
            dataclasses.replace(_pass([0.3, 0.4]), headers=[fallback, sent])]
    row = summarize(runs, _work())
    assert row["routing_by_round"] == [[request_routing(sent), request_routing(fallback)],
                                       [request_routing(fallback), request_routing(sent)]]


def test_an_unknown_workload_stops_before_anything_starts() -> None:
    with pytest.raises(BenchError, match="allowed: cheap, dear"):
        run(workloads=["cheap", "huge"], overrides={}, seed=1, progress=print)


def test_rounds_are_rejected_below_one_before_anything_starts() -> None:
    with pytest.raises(BenchError, match="--rounds: 0; allowed: 1 or more"):
        run(workloads=["cheap"], overrides={}, seed=1, progress=print, rounds=0)


def _work() -> Workload:
    system = list(range(3, 3 + 256))
    return Workload(prompts=["a", "b"], tokens=[[*system, 900], [*system, 901]], tenants=[0, 0])


def _pass(ttfts: list[float], pool: int = 0) -> PhaseRun:
    return PhaseRun(ttfts, ["x"] * len(ttfts), [{}] * len(ttfts), pool_hit_tokens=pool, engine_hit_tokens=128,
                    wall_s=1.0)


def test_rank_pools_the_rounds_and_gives_each_rounds_ratio_against_its_own_best() -> None:
    # round 1: the host is slow for everyone; round 2: fast. pof wins the first, loses the second.
    slow = {"round_robin": _pass([0.30, 0.30]), "power_of_two": _pass([0.20, 0.20]),
            "cache_aware": _pass([0.25, 0.25]), "pof": _pass([0.10, 0.10], pool=128)}
    fast = {"round_robin": _pass([0.05, 0.05]), "power_of_two": _pass([0.08, 0.08]),
            "cache_aware": _pass([0.06, 0.06]), "pof": _pass([0.075, 0.075], pool=128)}
    out = rank([slow, fast], _work())
    assert out["ratio_vs_best_by_round"] == [0.5, 1.5] and out["ratio_vs_best_range"] == [0.5, 1.5]
    # pooled: pof 0.0875 against power_of_two's 0.14 (the best of the pooled means)
    assert out["best_stock"] == "power_of_two" and out["ratio_vs_best"] == round(0.0875 / 0.14, 4)
    pof = out["policies"]["pof"]
    assert pof["mean_ttft_s_by_round"] == [0.1, 0.075] and pof["pool_hit_tokens"] == 256
    assert pof["hit_rate"] == round(2 * (128 + 128) / (2 * 514), 4)
    assert set(out["policies"]) == {*STOCK, "pof"}


def test_one_round_reads_as_before_and_a_stock_router_that_loaded_from_a_pool_is_an_error() -> None:
    one = {"round_robin": _pass([0.3, 0.1]), "power_of_two": _pass([0.2, 0.2]),
           "cache_aware": _pass([0.1, 0.1]), "pof": _pass([0.12, 0.1])}
    out = rank([one], _work())
    assert out["ratio_vs_best"] == 1.1 and "ratio_vs_best_by_round" not in out
    assert "mean_ttft_s_by_round" not in out["policies"]["pof"]
    with pytest.raises(BenchError, match="cache_aware: the store-only"):
        rank([{**one, "cache_aware": _pass([0.1, 0.1], pool=128)}], _work())


def test_rank_gives_a_paired_interval_and_keeps_each_requests_ttft() -> None:
    # pof is 0.8x power_of_two on every request, whatever the request costs: pairing makes the
    # interval tight although the TTFTs themselves spread 10x
    costs = [0.05 * (1 + i % 10) for i in range(40)]
    r = {"round_robin": _pass([c * 1.2 for c in costs]), "power_of_two": _pass(costs),
         "cache_aware": _pass([c * 1.1 for c in costs]), "pof": _pass([c * 0.8 for c in costs], pool=128)}
    out = rank([r, r], _work())
    lo, hi = out["ratio_vs_best_ci95"]
    assert lo == hi == 0.8
    assert out["policies"]["pof"]["ttft_s_by_round"] == [[round(c * 0.8, 4) for c in costs]] * 2


def test_each_router_gets_every_place_in_a_round_as_often_over_six_rounds() -> None:
    orders = [round_order(r) for r in range(6)]
    assert all(sorted(o) == sorted([*STOCK, "pof"]) for o in orders)
    assert [o.index("pof") for o in orders] == [3, 0, 3, 0, 3, 0]     # pof last, then first, by turns
    for name in (*STOCK, "pof"):
        assert sum(o.index(name) for o in orders) / 6 == 1.5         # the middle of places 0-3
    # the stock policies stay together (they share one pair of servers)
    for o in orders:
        places = sorted(o.index(n) for n in STOCK)
        assert places[-1] - places[0] == 2


def test_the_engines_time_is_told_apart_from_the_time_outside_them() -> None:
    engine = {"ttft": (0.06, 2), "queue": (0.02, 2), "prefill": (0.03, 2)}
    runs = [PhaseRun([0.05, 0.07], ["x"] * 2, [{}] * 2, pool_hit_tokens=0, engine_hit_tokens=0, wall_s=1.0,
                     engine_s=engine)] * 2
    assert engine_means(runs) == {"ttft_mean_s": 0.03, "queue_mean_s": 0.01, "prefill_mean_s": 0.015}
    r = {n: runs[0] for n in (*STOCK, "pof")}
    row = rank([r, r], _work())["policies"]["pof"]
    assert row["engine"]["ttft_mean_s"] == 0.03 and row["outside_engine_mean_s"] == 0.03
    # a pass whose engines counted other requests than the client sent (one failed) has no reading
    short = dataclasses.replace(runs[0], engine_s={**engine, "ttft": (0.03, 1)})
    assert engine_means([runs[0], short]) is None and engine_means([_pass([0.1])]) is None
    assert "engine" not in rank([{n: _pass([0.1, 0.1]) for n in (*STOCK, "pof")}], _work())["policies"]["pof"]


def test_the_warm_up_shares_no_block_with_the_measured_workload() -> None:
    def tokenize(text: str) -> list[int]:                # one token a character
        return [ord(c) for c in text]

    work = make_workload(tokenize, tenants=3, system_tokens=300, requests=20, hot_share=0.5, seed=7)
    warm = warm_up_workload(tokenize, 7, system_tokens=300, hot_share=0.5)
    assert len(warm.prompts) == WARM_UP_REQUESTS and len(set(warm.tenants)) > 1

    def blocks(tokens: list[int]) -> set[tuple[int, ...]]:       # chained: a block stands for its prefix
        return {tuple(tokens[:end]) for end in range(BLOCK, len(tokens) + 1, BLOCK)}

    measured = set().union(*(blocks(t) for t in work.tokens))
    warmed = set().union(*(blocks(t) for t in warm.tokens))
    assert measured and warmed and not measured & warmed
    # its prompts repeat tenants' system prompts, so the hit path is warmed too
    assert warm.first_touch_bound() > 0


def test_a_chat_workload_sends_the_same_words_as_a_system_and_a_user_message() -> None:
    def tokenize(text: str) -> list[int]:                # one token a character
        return [ord(c) for c in text]

    def chat(messages: list[dict[str, str]]) -> list[int]:     # a template of its own: role, then content
        return tokenize("".join(f"<{m['role']}>{m['content']}" for m in messages))

    text = make_workload(tokenize, tenants=3, system_tokens=300, requests=20, hot_share=0.5, seed=7)
    work = make_workload(tokenize, tenants=3, system_tokens=300, requests=20, hot_share=0.5, seed=7, chat=chat)
    assert text.chats is None and work.chats is not None and work.tenants == text.tenants
    for prompt, messages, tokens in zip(text.prompts, work.chats, work.tokens, strict=True):
        system, user = messages
        assert (system["role"], user["role"]) == ("system", "user") and tokens == chat(messages)
        assert prompt == f"{system['content']}\n{user['content']}\nAnswer:"
    # a tenant's requests share its system message: the bound counts their hits
    assert work.first_touch_bound() > 0
    warm = warm_up_workload(tokenize, 7, system_tokens=300, hot_share=0.5, chat=chat)
    assert warm.chats is not None and len(warm.chats) == WARM_UP_REQUESTS


def test_each_pass_reports_the_cpu_the_hypervisor_took() -> None:
    # this VM's counter: it only grows
    first = steal_seconds()
    assert first is not None and first >= 0 and (steal_seconds() or 0) >= first
    stolen = {n: dataclasses.replace(_pass([0.1, 0.1]), steal_s=s) for n, s in
              (("round_robin", 0.0), ("power_of_two", 0.1), ("cache_aware", 0.0), ("pof", 3.5))}
    out = rank([stolen, stolen], _work())
    assert out["policies"]["pof"]["steal_s_by_round"] == [3.5, 3.5]
    assert out["policies"]["round_robin"]["steal_s_by_round"] == [0.0, 0.0]
    # off Linux (no reading) the row says nothing rather than zero
    assert "steal_s_by_round" not in rank([{n: _pass([0.1, 0.1]) for n in (*STOCK, "pof")}], _work())["policies"]["pof"]
