"""The measurements ``pof bench capacity`` takes besides its trials: the unloaded TTFT the SLO comes
from, decode step times and the host's sharing slowdown (what ``pof sim calibrate`` reads), the
latency a router adds, and the warm-up each fleet gets before its first trial."""

from __future__ import annotations

import statistics
from concurrent.futures import ThreadPoolExecutor

from pof_connector.bench.capacity_fleet import Fleet
from pof_connector.bench.capacity_replay import Replay, Route
from pof_connector.bench.capacity_trace import TraceRequest, tokens_for
from pof_connector.bench.vllm_server import stream_completion

DECODE_STEPS = 16
"""Tokens each unloaded sample decodes after its first: their pace is the engine's step time at that context."""
BATCH_STEPS = 32
"""Tokens each request of a decode-batch sample decodes."""
BATCH_PROMPT = 32
"""Prompt tokens of each request of a decode-batch sample (short: its prefill barely delays the others)."""
WARM_UP_REQUESTS = 24
"""Requests of the trace's start each fleet serves, through its front door, before its first trial."""
WARM_UP_S = 30.0
"""The warm-up's arrivals are sped up to span at most this long."""


def prompt_sizes(trace: list[TraceRequest]) -> list[int]:
    """Each request's prompt length, answers counted at their ``max_tokens``."""
    context: dict[str, int] = {}
    out = []
    for r in trace:
        n = context.get(r.session, r.system_tokens) + r.turn_tokens
        out.append(n)
        context[r.session] = n + r.max_tokens
    return out


def unloaded_ttft(url: str, trace: list[TraceRequest], vocab: int,
                  samples: int) -> tuple[list[tuple[int, float]], list[tuple[int, int, float]]]:
    """(prompt tokens, TTFT) of cold prompts of the trace's sizes (evenly spread quantiles), one at a
    time; and for each, (1, prompt tokens, seconds per decode step) from the pace of the
    :data:`DECODE_STEPS` tokens it decodes after its first."""
    sizes = sorted(prompt_sizes(trace))
    picks = [sizes[min(len(sizes) - 1, round(q * (len(sizes) - 1) / max(samples - 1, 1)))] for q in range(samples)]
    out, steps = [], []
    for i, n in enumerate(picks):
        times: list[float] = []
        ttft, _ = stream_completion(url, tokens_for("unloaded", str(i), n, vocab, variant=-1),
                                    max_tokens=DECODE_STEPS + 1, chunk_times=times)
        out.append((n, ttft))
        if len(times) > 1:
            steps.append((1, n, (times[-1] - times[0]) / (len(times) - 1)))
    return out, steps


def host_sharing(urls: list[str], vocab: int, prompt_tokens: int, pairs: int = 2) -> list[tuple[int, float, float]]:
    """(prompt tokens, mean TTFT of a cold prompt on the first server alone, mean TTFT of one on
    every server at once), ``pairs`` times each: how much the servers, sharing this host's cores,
    slow each other (``pof sim calibrate``'s ``host_slowdown``)."""
    def cold(tag: str, url: str) -> float:
        return stream_completion(url, tokens_for("host", tag, prompt_tokens, vocab, variant=-1), max_tokens=1)[0]
    alone = [cold(f"alone/{k}", urls[0]) for k in range(pairs)]
    together: list[float] = []
    with ThreadPoolExecutor(len(urls)) as ex:
        for k in range(pairs):
            together += ex.map(lambda i, k=k: cold(f"both/{k}/{i}", urls[i]), range(len(urls)))
    return [(prompt_tokens, statistics.fmean(alone), statistics.fmean(together))]


def batch_decode_steps(url: str, vocab: int, batches: list[int]) -> list[tuple[int, int, float]]:
    """(batch, prompt tokens, seconds per decode step) of ``batch`` short requests decoding
    together: each decodes :data:`BATCH_STEPS` tokens; the step time is the mean pace of their
    middle halves, when all of them are decoding (the first and last quarters overlap the others'
    prefills and ends)."""
    out = []
    for b in batches:
        paces: list[float] = []

        def one(i: int, b: int = b, paces: list[float] = paces) -> None:
            times: list[float] = []
            stream_completion(url, tokens_for("batch", f"{b}/{i}", BATCH_PROMPT, vocab, variant=-1),
                              max_tokens=BATCH_STEPS + 1, chunk_times=times)
            q = len(times) // 4
            if len(times) - 2 * q > 1:
                paces.append((times[-q - 1] - times[q]) / (len(times) - 2 * q - 1))
        with ThreadPoolExecutor(b) as ex:
            list(ex.map(one, range(b)))
        if paces:
            out.append((b, BATCH_PROMPT, statistics.fmean(paces)))
    return out


def router_latency(fleet: Fleet, vocab: int, n: int = 5) -> float | None:
    """Mean TTFT through the set-up's router minus direct, on cold 512-token prompts (None: no router)."""
    if fleet.router is None:
        return None
    direct, routed = [], []
    for i in range(n):
        direct.append(stream_completion(fleet.servers[i % len(fleet.servers)].url,
                                        tokens_for("latency-direct", str(i), 512, vocab, variant=-2), 2)[0])
        routed.append(stream_completion(fleet.router.url, tokens_for("latency-routed", str(i), 512, vocab,
                                                                     variant=-2), 2)[0])
    return round(statistics.fmean(routed) - statistics.fmean(direct), 4)


def warm_up(trace: list[TraceRequest], route: Route, vocab: int, block: int, slo_s: float, variant: int) -> int:
    """Serve the trace's first :data:`WARM_UP_REQUESTS` requests through ``route`` (the set-up's own
    front door: its router, or the client's choice) with token content no trial uses (``variant``
    < 0), and forget them: a fresh fleet's first requests pay for what later ones do not (the
    engines' first steps, a router learning its cost model and its backends' load), and those
    belong to no load factor. Returns how many got a first token."""
    head = trace[:WARM_UP_REQUESTS]
    factor = max(1.0, head[-1].at / WARM_UP_S) if head else 1.0
    trial = Replay(head, route, vocab=vocab, variant=variant, block=block, slo_s=slo_s,
                   timeout_s=max(60.0, 20 * slo_s)).run(factor)
    return len(trial.ttfts())


__all__ = ["BATCH_PROMPT", "BATCH_STEPS", "DECODE_STEPS", "batch_decode_steps", "host_sharing", "prompt_sizes",
           "router_latency", "unloaded_ttft", "warm_up"]
