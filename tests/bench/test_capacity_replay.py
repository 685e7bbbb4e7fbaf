"""The capacity bench's replay on real HTTP connections: a session's turn carries the earlier turns
and answers, first-touch tokens count only what no earlier request computed, and an overloaded
trial gives up early. The server is a stand-in for vLLM's streaming ``/v1/completions`` (the
real engine is exercised by ``test_capacity_quick``, in the vLLM venv)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from pof_connector.bench.capacity_replay import Replay, _stages, answer_tokens
from pof_connector.bench.capacity_trace import TraceRequest, tokens_for
from tests.http_server import serve

BLOCK = 16


def fake_vllm(seen: list[list[int]], delay_s: float, headers: dict[str, str] | None = None) -> FastAPI:
    """Streams ``max_tokens`` chunks of text, the last with ``finish_reason: length``, as vLLM does,
    after ``delay_s``, with ``headers`` (as a router adds them); records every prompt (and fails a
    request that asks for token ids: vllm-router's kv_aware gives those no credit)."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def complete(request: Request) -> StreamingResponse:
        body = await request.json()
        assert "return_token_ids" not in body, body
        seen.append(body["prompt"])

        async def chunks() -> AsyncIterator[str]:
            await asyncio.sleep(delay_s)
            n = body["max_tokens"]
            for i in range(n):
                choice = {"text": "x", "finish_reason": "length" if i == n - 1 else None}
                yield "data: " + json.dumps({"choices": [choice]}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream", headers=headers)

    return app


def trace() -> list[TraceRequest]:
    """Half a second apart: each request's answer is back before the next is sent, on a busy machine too
    (what the first-touch figures below count on)."""
    return [TraceRequest(0.0, "s", "t", 40, 10, 5), TraceRequest(0.5, "other", "t", 40, 7, 3),
            TraceRequest(1.0, "s", "t", 40, 20, 5)]


def test_a_session_turn_carries_the_earlier_turn_and_answer() -> None:
    seen: list[list[int]] = []
    with serve(fake_vllm(seen, 0.0)) as url:
        replay = Replay(trace(), lambda r, k: (url, {}), vocab=500, variant=1, block=BLOCK, slo_s=5.0, timeout_s=10)
        trial = replay.run(factor=1.0)
    assert trial.passed(5.0) and trial.failed == 0 and len(trial.ttfts()) == 3
    system = tokens_for("system", "t", 40, 500, 1)
    first = system + tokens_for("turn", "s/0", 10, 500, 1)
    answer = answer_tokens("s", 0, 5, 500, 1)                  # a stand-in: the answer's ids were not asked for
    assert first in seen
    assert first + answer + tokens_for("turn", "s/1", 20, 500, 1) in seen
    by = {(o.session, o.turn): o for o in trial.outcomes}
    assert by[("s", 0)].first_touch_tokens == 50
    # turn 1: the first turn's prompt (50 tokens: 3 whole blocks) is known, the stand-in answer is not
    assert by[("s", 1)].first_touch_tokens == 75 - 3 * BLOCK
    # the other session shares the tenant's system prompt: its 2 whole blocks are known
    assert by[("other", 0)].first_touch_tokens == 47 - 2 * BLOCK
    kinds = trial.figures(5.0)
    assert kinds["sessions"]["requests"] == 2 and kinds["one_off"]["requests"] == 1
    assert kinds["one_off"]["p90_ttft_s"] == round(by[("other", 0)].ttft_s or 0.0, 4)
    assert kinds["router_decision_mean_s"] is None          # no pof router on the way


def test_the_routers_own_time_is_averaged_from_its_header() -> None:
    seen: list[list[int]] = []
    with serve(fake_vllm(seen, 0.0, {"x-pof-router-overhead": "0.004000", "x-pof-backend": "n1"})) as url:
        replay = Replay(trace(), lambda r, k: (url, {}), vocab=500, variant=1, block=BLOCK, slo_s=5.0, timeout_s=10)
        trial = replay.run(factor=1.0)
    assert [o.router_s for o in trial.outcomes] == [0.004] * 3 and {o.backend for o in trial.outcomes} == {"n1"}
    assert trial.figures(5.0)["router_decision_mean_s"] == 0.004


def test_a_turn_sent_to_another_backend_than_its_previous_turn_counts_as_moved() -> None:
    seen: list[list[int]] = []
    with serve(fake_vllm(seen, 0.0, {"x-pof-route-reason": "lower-cost"})) as a, serve(fake_vllm(seen, 0.0)) as b:
        # session s: turn 0 on a, turn 1 on b (moved); the one-off request has no later turn
        replay = Replay(trace(), lambda r, k: (a if (r.session, k) != ("s", 1) else b, {}), vocab=500, variant=1,
                        block=BLOCK, slo_s=5.0, timeout_s=10)
        trial = replay.run(factor=1.0)
    figures = trial.figures(5.0)
    assert (figures["later_turns"], figures["moved_turns"]) == (1, 1)
    assert figures["routes"] == {"lower-cost": 2}           # the two requests a answered
    with serve(fake_vllm(seen, 0.0)) as one:
        stayed = Replay(trace(), lambda r, k: (one, {}), vocab=500, variant=2, block=BLOCK, slo_s=5.0,
                        timeout_s=10).run(factor=1.0).figures(5.0)
    assert (stayed["later_turns"], stayed["moved_turns"], stayed["routes"]) == (1, 0, {})


def test_the_routers_stages_are_averaged_from_their_header_and_a_bad_one_is_dropped() -> None:
    seen: list[list[int]] = []
    stages = "parse=0.000100,tokenize=0.000020,lookup=0.002000,choose=0.001000,proxy=0.000300"
    with serve(fake_vllm(seen, 0.0, {"x-pof-router-overhead": "0.003420", "x-pof-router-stages": stages})) as url:
        replay = Replay(trace(), lambda r, k: (url, {}), vocab=500, variant=1, block=BLOCK, slo_s=5.0, timeout_s=10)
        trial = replay.run(factor=1.0)
    assert trial.figures(5.0)["router_stage_mean_s"] == {"parse": 0.0001, "tokenize": 2e-05, "lookup": 0.002,
                                                         "choose": 0.001, "proxy": 0.0003}
    trial.outcomes[0].router_stages = {"parse": 0.0004, "tokenize": 0.0, "lookup": 0.002, "choose": 0.001,
                                       "proxy": 0.0003}
    assert trial.router_stage_means()["parse"] == 0.0002          # (0.0004 + 0.0001 + 0.0001) / 3
    assert _stages("parse=0.1,lookup=x") == {} and _stages(None) == {}


def test_an_overloaded_trial_gives_up_and_fails() -> None:
    seen: list[list[int]] = []
    many = [TraceRequest(i * 0.2, f"s{i}", "t", 40, 10, 2) for i in range(30)]
    with serve(fake_vllm(seen, 0.5)) as url:
        replay = Replay(many, lambda r, k: (url, {}), vocab=500, variant=0, block=BLOCK, slo_s=0.1, timeout_s=10)
        trial = replay.run(factor=1.0)
    figures: dict[str, Any] = trial.figures(0.1)
    assert trial.gave_up and not figures["passed"]
    # it ends when it gives up (about 1 s in), not at the last arrival (5.8 s): no idle tail
    assert trial.wall_s < 4.0, trial.wall_s
    assert figures["requests"] == 30 and figures["failed"] > 10        # not sent once it gave up
    assert figures["errors"].get("not sent: the trial gave up", 0) > 10
    assert figures["one_off"]["requests"] == 30 and figures["one_off"]["p90_ttft_s"] is None   # unsent: late
    # a stream closed after its first token counts as an error, not as a request without a first token
    assert sum(n for why, n in figures["errors"].items() if not why.startswith("closed")) == figures["failed"]
    assert len(seen) < 20


class FakeFleet:
    """Stands in for :class:`~pof_connector.bench.capacity_fleet.Fleet` (real vLLM servers): one
    fake server, counters that grow with the prompts it saw, a usage spread of 0.5 that a placement
    of its requests could take to 0 (two on the fuller server)."""

    def __init__(self, url: str, seen: list[list[int]]) -> None:
        self.setup, self.url, self.seen = "static", url, seen
        self.router = None

    def route(self, trace: list[TraceRequest]) -> Any:
        return lambda r, k: (self.url, {})

    def counters(self) -> dict[str, float]:
        tokens = float(sum(len(p) for p in self.seen))
        return {"vllm:num_preemptions_total": 0.0, "vllm:iteration_tokens_total_sum": tokens,
                "vllm:prefix_cache_hits_total": 0.0, "vllm:external_prefix_cache_hits_total": 0.0,
                "vllm:prompt_tokens_total": tokens, "vllm:pof_loaded_pages_total": 0.0,
                "n0:first_tokens": float(len(self.seen))}

    def occupancy(self) -> list[tuple[float, int]]:
        return [(0.7, 2), (0.2, 1)]

    def idle(self) -> bool:
        return True

    def reset_caches(self) -> None:
        pass


def test_the_goodput_search_is_bounded_and_reports_every_trial() -> None:
    from pof_connector.bench.capacity import _report
    from pof_connector.bench.capacity_fleet import FleetSpec
    from pof_connector.bench.capacity_search import GoodputSearch
    from pof_connector.bench.capacity_setup_run import SetupRun

    seen: list[list[int]] = []
    lines: list[str] = []
    many = [TraceRequest(i * 0.05, f"s{i}", "t", 40, 10, 2) for i in range(20)]
    with serve(fake_vllm(seen, 0.0)) as url:
        run = SetupRun(FakeFleet(url, seen), many, 500, 1.0, lines.append)  # type: ignore[arg-type]
        best = run.search(GoodputSearch(max_trials=3), None).passed
    assert best == 4.0 and [t["factor"] for t in run.trials] == [1.0, 2.0, 4.0]      # doubling while it passes
    assert all(t["passed"] and t["tokens_computed"] > 0 for t in run.trials)
    assert run.trials[0]["spread_mean"] == 0.5 and run.trials[0]["spread_floor_mean"] == 0.0 and len(lines) == 3
    assert [t["engine_first_tokens"] for t in run.trials] == [{"n0": 20}] * 3     # per server, per trial
    rows = {"static": {"goodput_rps": 1.0, "at_reference_load": run.trials[0], "trials": run.trials},
            "pof": {"goodput_rps": 2.5, "trials": [],
                    "at_reference_load": {**run.trials[0], "spread_mean": 0.2, "spread_floor_mean": 0.1}}}
    out = _report(rows, {}, {"requests": 20}, 1.0, 0.25, FleetSpec(2, 10, 16, 256, 4), 1, None, Path("m"))
    assert out["ratio"] == 2.5 and out["ratio_vs_best"] == 2.5
    assert out["fragmentation"]["pof_vs_static"] == 0.4
    assert out["fragmentation"]["pof_floor_vs_static"] == 0.2           # pof's floor against static's spread


def test_a_setup_that_passed_nothing_gives_a_ratio_range_not_infinity() -> None:
    from pof_connector.bench.capacity import _report
    from pof_connector.bench.capacity_fleet import FleetSpec

    rows = {"static": {"goodput_rps": 0.0, "failed_at_rps": 0.5, "at_reference_load": None, "trials": []},
            "round_robin": {"goodput_rps": 0.5, "failed_at_rps": 1.0, "at_reference_load": None, "trials": []},
            "cache_aware": {"goodput_rps": 0.5, "failed_at_rps": 0.7, "at_reference_load": None, "trials": []},
            "pof": {"goodput_rps": 1.0, "failed_at_rps": 2.0, "at_reference_load": None, "trials": []}}
    out = _report(rows, {}, {"requests": 20}, 1.0, 0.25, FleetSpec(2, 10, 16, 256, 4), 1, None, Path("m"))
    assert out["ratio"] is None                                  # not Infinity, which JSON cannot carry
    assert out["ratio_range"] == [2.0, None]                     # static failed at 0.5 req/s: pof >= 2x it
    assert out["best_other"] == "round_robin"                   # ties go to the one that failed at more load
    assert out["ratio_vs_best"] == 2.0 and out["ratio_vs_best_range"] == [1.0, 4.0]
    json.dumps(out, allow_nan=False)


def test_ttft_parts_split_the_engines_histograms_and_what_lies_outside_them() -> None:
    from pof_connector.bench.capacity_setup_run import ttft_parts

    d = {"vllm:time_to_first_token_seconds_sum": 6.0, "vllm:time_to_first_token_seconds_count": 4.0,
         "vllm:request_queue_time_seconds_sum": 4.0, "vllm:request_queue_time_seconds_count": 4.0,
         "vllm:request_prefill_time_seconds_sum": 1.2, "vllm:request_prefill_time_seconds_count": 4.0}
    assert ttft_parts(d, 2.0) == {"queue": 1.0, "prefill": 0.3, "engine": 1.5, "outside": 0.5}
    none = dict.fromkeys(d, 0.0)
    assert ttft_parts(none, None) == {"queue": None, "prefill": None, "engine": None, "outside": None}
