"""``pof bench router``: a multi-tenant workload through four routers, same run, same model, on two
workloads: ``cheap`` (the tiny model: a prefill costs tens of milliseconds, hits save little) and
``dear`` (the bench model: a system prompt takes seconds to compute). A router that wins only one
of them is not one a user can put in front of any fleet.

Tenants share long system prompts; one hot tenant takes ``hot_share`` of the requests, more than
one server can serve alone; requests arrive open-loop (Poisson, ``rate`` per second, as from many
users) or from ``clients`` closed-loop clients; each server's KV cache is limited with
``--num-gpu-blocks-override`` so it cannot keep every tenant, and each server computes on its own
half of the CPU cores (``VLLM_CPU_OMP_THREADS_BIND``), as two hosts would; every router runs at
niceness :data:`ROUTER_NICE`, as on a host of its own, and where the user may, the routers, the
index server and the relays run in ``SCHED_RR`` (:mod:`.front_door`: niceness alone left the pof
router's index lookups waiting for a core; the JSON's ``front_door_sched`` says which ran). The
set-ups, one after another:

- ``round_robin``, ``power_of_two`` and ``cache_aware``: the stock ``vllm-router`` in front of two
  vLLM servers whose connector only stores (``kv_role: kv_producer``, private pools): they run the
  same engine code as the pooled servers (on this CPU a server with any KV connector configured
  prefills ~1.4x faster than one without, so servers without one would not be a fair baseline),
  but no request is ever served from a pool;
- ``pof``: `pof router` in front of two vLLM servers whose pools share one CXL region and one
  Redis-protocol index, so either server can load a prefix the other computed; a `pof relay`
  per server reports its engine's prefix cache (from vLLM's KV events) to the index.

Each request streams a short greedy completion; TTFT is the client-side time to the first chunk.
The prefix hit rate is (engine prefix-cache hits + connector hits) / prompt tokens, from the
servers' own metrics, compared with the first-touch bound: every tenant's system prompt is
computed once in the cluster and hit by every later request (whole blocks, never a prompt's last
token). ``ratio_vs_best`` = pof mean TTFT / the best stock policy's mean TTFT; `pof router`'s own
time per request (p50/p99, per stage) is read from its answers' headers. Needs vLLM and vllm-router
(:data:`NEEDS`, checked before anything starts).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pof_connector.bench import BenchError, nearest_rank
from pof_connector.bench.front_door import can_use_rr, make_realtime
from pof_connector.bench.make_model import PRESETS
from pof_connector.bench.needs import VLLM, VLLM_ROUTER, Need, check
from pof_connector.bench.router_process import RouterProcess
from pof_connector.bench.router_stats import goal_verdict, ratio_interval
from pof_connector.bench.service_process import ServiceProcess
from pof_connector.bench.vllm_server import (
    VllmServer,
    build_model,
    connector_config,
    free_port,
    stream_chat,
    stream_completion,
)
from pof_connector.index.server import RedisServer
from pof_connector.router.stage_clock import parse_header

Progress = Callable[[str], None]
BLOCK = 128
NEEDS: list[Need] = [VLLM, Need("the stock routers", VLLM_ROUTER.package, binary="vllm-router")]
METRICS = ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total", "vllm:prompt_tokens_total")
ENGINE_TIMES = {"ttft": "vllm:time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
                "prefill": "vllm:request_prefill_time_seconds"}
"""The engines' own histograms of a request's time (from its arrival at the API server): what they
say of a pass against the client's TTFT tells the routers' time apart from the engines'."""
COUNTED = (*METRICS, *(f"{h}_{part}" for h in ENGINE_TIMES.values() for part in ("sum", "count")))


Messages = list[dict[str, str]]
ChatTokens = Callable[[Messages], list[int]]
"""A chat request's prompt token ids, as the engine renders and tokenizes its messages."""


@dataclass(frozen=True)
class Workload:
    prompts: list[str]
    tokens: list[list[int]]
    """Each request's prompt token ids (a chat request's: its messages rendered)."""
    tenants: list[int]
    chats: list[Messages] | None = None
    """The requests as chat messages (``--api chat``): the tenant's system prompt as a system
    message, the request's own words as the user's; ``None``: completions of :attr:`prompts`."""

    def first_touch_bound(self) -> int:
        """Prompt tokens a perfect cluster cache serves: each tenant's first request computes its
        system prompt, every later one hits the whole blocks it shares with an earlier prompt."""
        seen: dict[int, list[int]] = {}
        total = 0
        for t, toks in zip(self.tenants, self.tokens, strict=True):
            prev = seen.get(t)
            if prev is not None:
                common = 0
                for x, y in zip(prev, toks, strict=False):
                    if x != y:
                        break
                    common += 1
                total += min(common, len(toks) - 1) // BLOCK * BLOCK
            seen[t] = toks
        return total


def make_workload(tokenize: Callable[[str], list[int]], *, tenants: int, system_tokens: int, requests: int,
                  hot_share: float, seed: int, chat: ChatTokens | None = None) -> Workload:
    """``chat``: send the requests as chat messages, tokenized by it (``None``: completions)."""
    rnd = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"

    def words(n_tokens: int) -> str:
        out: list[str] = []
        text = ""
        while len(tokenize(text)) < n_tokens:
            out.extend("".join(rnd.choice(letters) for _ in range(rnd.randrange(2, 9))) for _ in range(32))
            text = " ".join(out)
        return text

    systems = [f"System prompt of tenant {t}. " + words(system_tokens) for t in range(tenants)]
    weights = [hot_share] + [(1 - hot_share) / (tenants - 1)] * (tenants - 1)
    chosen = rnd.choices(range(tenants), weights=weights, k=requests)
    asks = [f"User {i}: {words(rnd.randrange(40, 120))}" for i in range(requests)]
    prompts = [f"{systems[t]}\n{ask}\nAnswer:" for t, ask in zip(chosen, asks, strict=True)]
    if chat is None:
        return Workload(prompts, [tokenize(p) for p in prompts], chosen)
    chats = [[{"role": "system", "content": systems[t]}, {"role": "user", "content": ask}]
             for t, ask in zip(chosen, asks, strict=True)]
    return Workload(prompts, [chat(m) for m in chats], chosen, chats)


def _drive(url: str, work: Workload, clients: int, rate: float,
           seed: int) -> tuple[list[float], list[str], list[dict[str, str]], float]:
    """Send every prompt in order; (TTFTs, answers, answer headers, wall seconds). ``rate`` > 0:
    open loop, Poisson arrivals at ``rate`` per second (a request never waits for another's
    answer, as with many users); otherwise ``clients`` closed-loop clients."""
    ttfts = [0.0] * len(work.prompts)
    answers = [""] * len(work.prompts)
    headers: list[dict[str, str]] = [{} for _ in work.prompts]
    t0 = time.perf_counter()
    if rate > 0:
        rnd = random.Random(seed)
        arrivals: list[float] = []
        at = 0.0
        for _ in work.prompts:
            at += rnd.expovariate(rate)
            arrivals.append(at)

        def one(i: int) -> None:
            time.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
            ttfts[i], answers[i] = _send(url, work, i, headers[i])

        with ThreadPoolExecutor(len(work.prompts)) as ex:
            for f in [ex.submit(one, i) for i in range(len(work.prompts))]:
                f.result()
        return ttfts, answers, headers, time.perf_counter() - t0
    nxt = iter(range(len(work.prompts)))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            ttfts[i], answers[i] = _send(url, work, i, headers[i])

    with ThreadPoolExecutor(clients) as ex:
        for f in [ex.submit(client) for _ in range(clients)]:
            f.result()
    return ttfts, answers, headers, time.perf_counter() - t0


def _send(url: str, work: Workload, i: int, headers: dict[str, str]) -> tuple[float, str]:
    """Request ``i`` of ``work``, streamed: (TTFT, the answer's text)."""
    if work.chats is not None:
        return stream_chat(url, work.chats[i], max_tokens=8, headers=headers)
    return stream_completion(url, work.prompts[i], max_tokens=8, headers=headers)


def _counters(servers: list[VllmServer]) -> dict[str, float]:
    out = dict.fromkeys(COUNTED, 0.0)
    for s in servers:
        m = s.metrics()
        for k in COUNTED:
            out[k] += m.get(k, 0.0)
    return out


@dataclass(frozen=True)
class PhaseRun:
    """One router's pass over the workload: what the client saw, and what the servers counted."""

    ttfts: list[float]
    answers: list[str]
    headers: list[dict[str, str]]
    """Each answer's HTTP headers (`pof router`'s ``x-pof-*`` among them)."""
    pool_hit_tokens: int
    engine_hit_tokens: int
    wall_s: float
    engine_s: dict[str, tuple[float, int]] = dataclasses.field(default_factory=dict)
    """Per :data:`ENGINE_TIMES` key, (seconds summed, requests) over both servers in this pass."""
    steal_s: float | None = None
    """CPU time the hypervisor gave other guests while this VM's vCPUs wanted it, over the pass
    (all vCPUs; ``None``: not on Linux): a pass that ran slow for the host's sake shows it here."""


WARM_UP_REQUESTS = 24
"""Requests each router serves before its measured pass, from tenants of their own: a fresh pair of
servers, its router and (for pof) the relays and the pool pay for their first requests what later
ones do not (a 2026-12-06 pass of pof that ran first on new servers had five requests of 0.9-1.3 s
among its first ten, and a mean TTFT 2.6x its round's best)."""


def warm_up_workload(tokenize: Callable[[str], list[int]], work_seed: int, *, system_tokens: int,
                     hot_share: float, chat: ChatTokens | None = None) -> Workload:
    """:data:`WARM_UP_REQUESTS` requests of four tenants whose system prompts share no block with
    the measured workload's (another seed draws their words), so the warm-up fills no cache that
    the measured pass could hit; repeats of those prompts warm the hit path (and pof's pool loads)."""
    return make_workload(tokenize, tenants=4, system_tokens=system_tokens, requests=WARM_UP_REQUESTS,
                         hot_share=hot_share, seed=work_seed + 1_000_003, chat=chat)


def _phase(name: str, url: str, servers: list[VllmServer], work: Workload, clients: int, rate: float,
           seed: int, progress: Progress, warm: Workload | None = None) -> PhaseRun:
    if warm is not None:
        _drive(url, warm, clients, rate, seed + 1)
        progress(f"  {name}: warmed up ({len(warm.prompts)} requests of other tenants)")
    for s in servers:
        s.reset_prefix_cache()
    before, stolen = _counters(servers), steal_seconds()
    how = f"{rate:g} requests/s" if rate > 0 else f"{clients} clients"
    progress(f"  {name}: {len(work.prompts)} requests, {how} ...")
    ttfts, answers, headers, wall = _drive(url, work, clients, rate, seed)
    after, stolen_after = _counters(servers), steal_seconds()
    delta = {k: after[k] - before[k] for k in COUNTED}
    engine_s = {key: (delta[f"{h}_sum"], int(delta[f"{h}_count"])) for key, h in ENGINE_TIMES.items()}
    run = PhaseRun(ttfts, answers, headers, pool_hit_tokens=int(delta["vllm:external_prefix_cache_hits_total"]),
                   engine_hit_tokens=int(delta["vllm:prefix_cache_hits_total"]), wall_s=wall, engine_s=engine_s,
                   steal_s=None if stolen is None or stolen_after is None else round(stolen_after - stolen, 2))
    row = summarize([run], work)
    routing = row.get("routing")
    progress(f"  {name}: mean TTFT {row['mean_ttft_s']:.3f} s, p90 {row['p90_ttft_s']:.3f} s, hit rate "
             f"{row['hit_rate']:.3f} ({row['hit_vs_first_touch_bound']} of the bound)"
             + (f"; engines' TTFT {row['engine']['ttft_mean_s']:.3f} s (queue {row['engine']['queue_mean_s']:.3f}, "
                f"prefill {row['engine']['prefill_mean_s']:.3f}), outside them {row['outside_engine_mean_s']:.3f} s"
                if "engine" in row else "")
             + (f"; router's own time p50 {routing['overhead_p50_ms']} ms, p99 {routing['overhead_p99_ms']} ms"
                if routing else "")
             + (f"; CPU stolen by the hypervisor {run.steal_s:.2f} s" if run.steal_s else ""))
    return run


def steal_seconds() -> float | None:
    """CPU seconds stolen from this VM so far, all vCPUs (``/proc/stat``'s ``steal``); ``None``
    off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    return int(fields[8]) / os.sysconf("SC_CLK_TCK") if fields[0] == "cpu" and len(fields) > 8 else None


def summarize(runs: list[PhaseRun], work: Workload) -> dict[str, Any]:
    """One router's row over its rounds: TTFT statistics of every request of every round pooled
    (each round sends the same requests, so each weighs the same), hits summed, and each round's
    mean TTFT (``mean_ttft_s_by_round``) so that the spread between rounds is visible."""
    ttfts = [t for r in runs for t in r.ttfts]
    prompt_tokens = sum(len(t) for t in work.tokens) * len(runs)
    bound = work.first_touch_bound() * len(runs)
    hits = sum(r.pool_hit_tokens + r.engine_hit_tokens for r in runs)
    q = statistics.quantiles(ttfts, n=10)
    row: dict[str, Any] = {
           "mean_ttft_s": round(statistics.fmean(ttfts), 4), "p50_ttft_s": round(statistics.median(ttfts), 4),
           "p90_ttft_s": round(q[-1], 4), "hit_rate": round(hits / prompt_tokens, 4),
           "hit_vs_first_touch_bound": round(hits / bound, 4) if bound else None,
           "pool_hit_tokens": sum(r.pool_hit_tokens for r in runs),
           "engine_hit_tokens": sum(r.engine_hit_tokens for r in runs),
           "wall_s": round(sum(r.wall_s for r in runs), 2)}
    engine = engine_means(runs)
    if engine is not None:
        row["engine"] = engine
        row["outside_engine_mean_s"] = round(statistics.fmean(ttfts) - engine["ttft_mean_s"], 4)
    if len(runs) > 1:
        row["mean_ttft_s_by_round"] = [round(statistics.fmean(r.ttfts), 4) for r in runs]
    if all(r.steal_s is not None for r in runs):
        row["steal_s_by_round"] = [r.steal_s for r in runs]
    # kept so that a later reading can pair requests across routers (request i of every router
    # had the same prompt): the bootstrap of router_stats, or another test
    row["ttft_s_by_round"] = [[round(t, 4) for t in r.ttfts] for r in runs]
    routing = routing_summary([h for r in runs for h in r.headers], ttfts)
    if routing:
        row["routing"] = routing
        # request by request, beside ttft_s_by_round: a request that ran slow is read against
        # where it went, why, what the router expected and how long the router itself took
        row["routing_by_round"] = [[request_routing(h) for h in r.headers] for r in runs]
    return row


def request_routing(headers: dict[str, str]) -> list[Any]:
    """One answer's ``x-pof-*`` headers as [backend, route reason, estimated TTFT s, router's own
    time ms]; ``None`` for what the answer did not carry."""
    est, own = headers.get("x-pof-estimated-ttft"), headers.get("x-pof-router-overhead")
    return [headers.get("x-pof-backend"), headers.get("x-pof-route-reason", headers.get("x-pof-reason")),
            None if est is None else round(float(est), 4), None if own is None else round(1e3 * float(own), 3)]


def engine_means(runs: list[PhaseRun]) -> dict[str, float] | None:
    """The engines' mean time per request over ``runs``, per :data:`ENGINE_TIMES` key
    (``<key>_mean_s``); ``None`` when a pass has no reading or the engines counted another number
    of first tokens than it sent requests (a mean over other requests than the client's)."""
    if not runs or any(not r.engine_s or r.engine_s["ttft"][1] != len(r.ttfts) for r in runs):
        return None
    out = {}
    for key in ENGINE_TIMES:
        total = sum(r.engine_s[key][0] for r in runs)
        count = sum(r.engine_s[key][1] for r in runs)
        out[f"{key}_mean_s"] = round(total / count, 4) if count else 0.0
    return out


def rank(rounds: list[dict[str, PhaseRun]], work: Workload) -> dict[str, Any]:
    """pof against the best stock policy over ``rounds`` (each: a router's name → its pass):
    ``ratio_vs_best`` from the TTFTs of all rounds pooled, and, with more than one round, the same
    ratio within each round (``ratio_vs_best_by_round``; its best stock policy may differ), whose
    spread says how far one round's ratio can be trusted."""
    results = {name: summarize([r[name] for r in rounds], work) for name in (*STOCK, "pof")}
    for name in STOCK:
        if results[name]["pool_hit_tokens"]:
            raise BenchError(f"{name}: the store-only (kv_producer) servers loaded from their pools")
    # Greedy answers are compared, not required equal: under concurrent load vLLM batches requests
    # differently for each router, and batch composition can flip a near-tie token (seen between
    # round_robin and cache_aware, which load nothing). Exact equality with and without the pool
    # is what the tests check, one request at a time.
    for name in (*STOCK[1:], "pof"):
        results[name]["answers_differing_from_round_robin"] = sum(
            a != b for r in rounds for a, b in zip(r[name].answers, r["round_robin"].answers, strict=True))
    best = min(STOCK, key=lambda n: results[n]["mean_ttft_s"])
    pof_mean = results["pof"]["mean_ttft_s"]
    out: dict[str, Any] = {"ratio_vs_best": round(pof_mean / results[best]["mean_ttft_s"], 4), "best_stock": best,
                           "ratio_vs_best_ci95": list(ratio_interval(
                               [{n: r[n].ttfts for n in r} for r in rounds], STOCK)),
                           **{f"pof_vs_{n}": round(pof_mean / results[n]["mean_ttft_s"], 4) for n in STOCK}}
    if len(rounds) > 1:
        by_round = [statistics.fmean(r["pof"].ttfts) / min(statistics.fmean(r[n].ttfts) for n in STOCK)
                    for r in rounds]
        out["ratio_vs_best_by_round"] = [round(x, 4) for x in by_round]
        out["ratio_vs_best_range"] = [round(min(by_round), 4), round(max(by_round), 4)]
    out["policies"] = results
    return out


ROUTER_NICE = -10
"""Every router's niceness (stock and pof alike): a router that a deployment runs on a host of its
own is not made to wait behind the engines that share this host's two cores."""
STOCK = ("round_robin", "power_of_two", "cache_aware")
"""The stock vllm-router policies pof is ranked against (its best one is the bar)."""


@dataclass(frozen=True)
class WorkloadSpec:
    """One workload of ``pof bench router``: a model and a multi-tenant request stream."""

    model: str
    """A local preset (:data:`~pof_connector.bench.make_model.PRESETS`) or a model directory."""
    tenants: int
    system_tokens: int
    requests: int
    rate: float
    kv_tokens: int
    goal: float
    """Issue 42's bound on pof's mean TTFT / the best stock policy's on this workload."""
    clients: int = 4
    hot_share: float = 0.7
    api: str = "completions"
    """'completions' (text prompts) or 'chat' (:attr:`Workload.chats`)."""


WORKLOADS = {
    # A 2,900-token prefill of the tiny model takes tens of milliseconds: hits save little, so a
    # router must not spend more than they save (its own time, a detour to a busy holder).
    "cheap": WorkloadSpec("tiny", tenants=12, system_tokens=2900, requests=160, rate=3.0, kv_tokens=12288,
                          goal=1.05),
    # The bench model computes a 1,024-token system prompt in seconds on one core: every hit
    # counts, and each server's KV holds about five tenants' prompts of eight.
    "dear": WorkloadSpec("bench", tenants=8, system_tokens=1024, requests=60, rate=0.8, kv_tokens=6144, goal=0.8),
}


def run(*, workloads: list[str], overrides: dict[str, Any], seed: int, progress: Progress,
        rounds: int = 1) -> dict[str, Any]:
    """Every workload named in ``workloads`` (keys of :data:`WORKLOADS`), with ``overrides`` (fields
    of :class:`WorkloadSpec`, e.g. from the command line) applied to each, ``rounds`` times."""
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown or not workloads:
        raise BenchError(f"--workload: {', '.join(unknown) or 'none'}; allowed: {', '.join(WORKLOADS)}")
    if rounds < 1:
        raise BenchError(f"--rounds: {rounds}; allowed: 1 or more")
    check(NEEDS, "router")      # before a model is built or a server started
    rr = can_use_rr()           # a probe in a child process: asked once per run
    out: dict[str, Any] = {"bench": "router", "workloads": {}, "front_door_sched": "rr" if rr else "nice"}
    for name in workloads:
        spec = dataclasses.replace(WORKLOADS[name], **overrides)
        progress(f"workload {name}: model {spec.model}")
        result = run_workload(spec, seed=seed, progress=progress, rr=rr, rounds=rounds)
        out["workloads"][name] = result
        out[f"ratio_vs_best_{name}"] = result["ratio_vs_best"]
        out[f"ratio_vs_best_{name}_ci95"] = result["ratio_vs_best_ci95"]
        out[f"goal_{name}"] = f"<= {result['goal']:g}: {result['goal_verdict']}"
        if "ratio_vs_best_range" in result:
            out[f"ratio_vs_best_{name}_range"] = result["ratio_vs_best_range"]
    out["note"] = ("ratio_vs_best_W = pof router + pool mean TTFT / the best stock vllm-router policy's (" +
                   ", ".join(STOCK) + ") on workload W, same servers with a store-only connector (no pool loads); "
                   "hit rate = (engine prefix-cache + connector hits) / prompt tokens; ratio_vs_best_ci95: paired "
                   "bootstrap over the requests (same indices for every router within a round), not over "
                   "rounds; goal_verdict: met when the whole interval is <= goal, not met when it is above, "
                   "else undecided; engine: the servers' own mean time per request from its arrival at their API "
                   "server (vllm:time_to_first_token_seconds, request_queue_time, request_prefill_time), "
                   "outside_engine_mean_s: the client's mean TTFT minus the engines' (router, proxy, HTTP); "
                   "steal_s_by_round: CPU seconds the hypervisor gave other guests during each pass (/proc/stat)")
    return out


def run_workload(spec: WorkloadSpec, *, seed: int, progress: Progress, rr: bool = False,
                 rounds: int = 1) -> dict[str, Any]:
    """``rr``: put the routers, the index server and the relays in ``SCHED_RR`` (:mod:`.front_door`).
    ``rounds``: passes of every router over the same requests, each on freshly started servers,
    the stock routers first in even rounds and pof first in odd ones (so a host that slows down
    during the run does not favour one side)."""
    from tokenizers import Tokenizer

    from pof_connector.locality.locator import load_tokenizer

    tenants, requests, rate, clients = spec.tenants, spec.requests, spec.rate, spec.clients
    if not 0 < spec.hot_share < 1 or tenants < 2:
        raise BenchError("--hot-share must be in (0, 1) and --tenants at least 2")
    model_dir = model_path(spec.model)
    tokenize = load_tokenizer(str(model_dir), special_tokens=True)
    Tokenizer.from_file(str(model_dir / "tokenizer.json"))    # fail early on a model without tokenizer.json
    chat = _chat_tokens(model_dir) if spec.api == "chat" else None
    work = make_workload(tokenize, tenants=tenants, system_tokens=spec.system_tokens, requests=requests,
                         hot_share=spec.hot_share, seed=seed, chat=chat)
    warm = warm_up_workload(tokenize, seed, system_tokens=spec.system_tokens, hot_share=spec.hot_share, chat=chat)
    max_len = max(4096, max(len(t) for t in (*work.tokens, *warm.tokens)) + 64)
    blocks = spec.kv_tokens // BLOCK
    tmp = Path(tempfile.mkdtemp(prefix="pof-bench-router-", dir="/tmp"))
    bed = _Bed(model_dir=model_dir, tmp=tmp, max_len=max_len, work=work, clients=clients, rate=rate, seed=seed,
               common=["--num-gpu-blocks-override", str(blocks), "--max-num-seqs", str(max(clients, 2))],
               rr=rr, progress=progress, warm=warm)
    how = f"Poisson arrivals at {rate:g}/s" if rate > 0 else f"{clients} closed-loop clients"
    progress(f"workload: {requests} requests, {tenants} tenants (hot share {spec.hot_share}), system prompts "
             f"~{spec.system_tokens} tokens, {how}; KV {blocks * BLOCK} tokens per server")
    per_round: list[dict[str, PhaseRun]] = []
    orders = [round_order(r) for r in range(rounds)]
    for r, order in enumerate(orders):
        if rounds > 1:
            progress(f"round {r + 1} of {rounds}: {', '.join(order)}")
        runs: dict[str, PhaseRun] = {}
        if order[0] == "pof":
            runs.update(_pof_phase(bed, f"r{r}"))
        runs.update(_stock_phases(bed, f"r{r}", [n for n in order if n != "pof"]))
        if order[0] != "pof":
            runs.update(_pof_phase(bed, f"r{r}"))
        per_round.append(runs)
    shutil.rmtree(tmp, ignore_errors=True)
    prompt_tokens = sum(len(t) for t in work.tokens)
    ranked = rank(per_round, work)
    return {
        **ranked, "rounds": rounds, "order_by_round": orders, "goal": spec.goal,
        "goal_verdict": goal_verdict(ranked["ratio_vs_best_ci95"], spec.goal),
        "first_touch_bound_hit_rate": round(work.first_touch_bound() / prompt_tokens, 4),
        "workload": {**dataclasses.asdict(spec), "prompt_tokens": prompt_tokens,
                     "kv_tokens_per_server": blocks * BLOCK, "seed": seed, "model": str(model_dir),
                     "warm_up_requests": len(warm.prompts)},
    }


@dataclass(frozen=True)
class _Bed:
    """What every phase of one workload runs with."""

    model_dir: Path
    tmp: Path
    max_len: int
    work: Workload
    clients: int
    rate: float
    seed: int
    common: list[str]
    """vLLM flags of every server (KV size, batch)."""
    rr: bool
    progress: Progress
    warm: Workload | None = None
    """Served through each router before its measured pass (:func:`warm_up_workload`)."""

    def front_door(self, pid: int | None) -> None:
        if self.rr and pid is not None:
            make_realtime(pid)

    def phase(self, name: str, url: str, servers: list[VllmServer]) -> PhaseRun:
        return _phase(name, url, servers, self.work, self.clients, self.rate, self.seed, self.progress, self.warm)


def round_order(r: int) -> list[str]:
    """The routers of round ``r`` (from 0) in the order they run. pof runs last in even rounds and
    first in odd ones; the stock policies, which share one pair of servers and so run one after
    another, start one place later each round. Place matters on a shared host: in the three
    multi-round runs of 2026-12-06 pof's mean TTFT was 8-35 % higher when it ran last than when it
    ran first, and six of nine stock means were higher when they ran after pof; with the stock
    order fixed, round_robin always had the earliest places of all. Over six rounds every router
    averages the middle place, 2.5 of 4."""
    k = r % len(STOCK)
    stock = [*STOCK[k:], *STOCK[:k]]
    return ["pof", *stock] if r % 2 else [*stock, "pof"]


def _stock_phases(bed: _Bed, tag: str, policies: list[str]) -> dict[str, PhaseRun]:
    """Every stock policy in ``policies``, in that order, in front of two servers whose connector
    only stores."""
    store_only = {"index_url": "local", "tiers": {"cpu_dram": {"size": "1GiB"}}}
    baseline = _start_pair(bed.model_dir, bed.tmp, f"store-only-{tag}", store_only, bed.max_len, bed.common,
                           bed.progress, role="kv_producer")
    runs: dict[str, PhaseRun] = {}
    try:
        _check_tokenizer(baseline[0], bed.work)
        for policy in policies:
            router = RouterProcess.vllm_router(bed.tmp, [s.url for s in baseline], policy,
                                               name=f"vllm-router-{policy}-{tag}")
            router.start(nice=ROUTER_NICE)
            bed.front_door(router.pid)
            try:
                runs[policy] = bed.phase(policy, router.url, baseline)
            finally:
                router.stop()
    finally:
        for s in baseline:
            s.stop()
    return runs


def _pof_phase(bed: _Bed, tag: str) -> dict[str, PhaseRun]:
    """`pof router` in front of two servers sharing one pool (a new region and a new index each
    round: nothing an earlier round stored is found), a relay per server."""
    region = Path(tempfile.mkdtemp(prefix="pof-bench-router-", dir="/dev/shm")) / "cxl.region"
    name = f"pof-{tag}"
    redis = RedisServer(bed.tmp / f"redis-{tag}").start()
    bed.front_door(redis.pid)
    try:
        pool = {"index_url": redis.url,
                "tiers": {"cxl": {"path": str(region), "size": "1GiB", "partitions": 2}}}
        events = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
        pooled = _start_pair(bed.model_dir, bed.tmp, name, pool, bed.max_len, bed.common, bed.progress,
                             events=events)
        relays: list[ServiceProcess] = []
        try:
            # A relay per engine puts the engine's own prefix cache into the index (from its KV
            # events): with a shared pool every node can load every prefix, and the router must
            # still tell a prefix in an engine's cache from one it has to load.
            for i, endpoint in enumerate(events):
                relays.append(start_relay(bed.tmp, f"n{i}", {"runtime_dir": str(bed.tmp / f"rt-{name}{i}"), **pool},
                                          endpoint))
                bed.front_door(relays[-1].pid)
            config = {"index_url": redis.url, "tokenizer": str(bed.model_dir),
                      "backends": [{"name": f"n{i}", "url": s.url} for i, s in enumerate(pooled)]}
            router = RouterProcess.pof(bed.tmp, config).start(nice=ROUTER_NICE)
            bed.front_door(router.pid)
            try:
                return {"pof": bed.phase("pof", router.url, pooled)}
            finally:
                router.stop()
        finally:
            for r in relays:
                r.stop(grace_s=10)
            for s in pooled:
                s.stop()
    finally:
        redis.stop()
        shutil.rmtree(region.parent, ignore_errors=True)


def model_path(spec: str) -> Path:
    """A local preset's directory (built when missing), or ``spec`` as a model directory."""
    if spec in PRESETS and not Path(spec).is_dir():
        return build_model(spec)
    path = Path(spec)
    if not (path / "tokenizer.json").is_file():
        raise BenchError(f"--model: {spec!r} is neither a model directory (with a tokenizer.json) nor a local "
                         f"preset ({', '.join(sorted(PRESETS))})")
    return path


def routing_summary(headers: list[dict[str, str]], ttfts: list[float]) -> dict[str, Any]:
    """What `pof router`'s answer headers say of a phase: its own time per request (p50/p99, total
    and per stage), the backends and route reasons it chose, and its TTFT estimates against the
    TTFTs measured; empty for a router that sends no ``x-pof-*`` headers."""
    own = sorted(float(h["x-pof-router-overhead"]) for h in headers if "x-pof-router-overhead" in h)
    if not own:
        return {}
    out: dict[str, Any] = {"overhead_p50_ms": round(1e3 * nearest_rank(own, 0.5), 3),
                           "overhead_p99_ms": round(1e3 * nearest_rank(own, 0.99), 3)}
    stages: dict[str, list[float]] = {}
    for h in headers:
        for name, seconds in parse_header(h.get("x-pof-router-stages")).items():
            stages.setdefault(name, []).append(seconds)
    for v in stages.values():
        v.sort()
    if stages:
        out["stages_p50_ms"] = {k: round(1e3 * nearest_rank(v, 0.5), 3) for k, v in stages.items()}
        out["stages_p99_ms"] = {k: round(1e3 * nearest_rank(v, 0.99), 3) for k, v in stages.items()}
    out["backends"] = dict(Counter(h.get("x-pof-backend", "?") for h in headers))
    out["route_reasons"] = dict(Counter(h.get("x-pof-route-reason", h.get("x-pof-reason", "?")) for h in headers))
    errors = [float(h["x-pof-estimated-ttft"]) - t for h, t in zip(headers, ttfts, strict=True)
              if "x-pof-estimated-ttft" in h]
    if errors:
        out["estimate_minus_ttft_mean_s"] = round(statistics.fmean(errors), 4)
        out["estimate_abs_error_mean_s"] = round(statistics.fmean(abs(e) for e in errors), 4)
    return out


def _start_pair(model_dir: Path, tmp: Path, name: str, pool: dict[str, Any], max_len: int, common: list[str],
                progress: Progress, role: str = "kv_both", events: list[str] | None = None) -> list[VllmServer]:
    """Two servers; ``events``: the KV-event endpoint each publishes to (None: no KV events)."""
    progress(f"starting 2 vLLM servers ({name}, kv_role {role}) ...")
    servers = []
    for i in range(2):
        kv = connector_config({"node_id": f"n{i}", "runtime_dir": str(tmp / f"rt-{name}{i}"), **pool}, role=role)
        extra = list(common)
        if events is not None:
            extra += kv_events_args(events[i])
        servers.append(VllmServer(model_dir, tmp / f"{name}{i}", kv_transfer=kv, max_model_len=max_len,
                                  extra_args=extra, env=_own_cores(i)))
    try:
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda s: s.start(), servers))
    except Exception:
        for s in servers:
            s.stop()
        raise
    return servers


def kv_events_args(endpoint: str) -> list[str]:
    """vLLM flags that publish its KV events on ``endpoint``'s port (tcp://127.0.0.1:PORT)."""
    port = endpoint.rsplit(":", 1)[1]
    return ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                              "endpoint": f"tcp://*:{port}", "topic": ""})]


def start_relay(tmp: Path, node: str, pool: dict[str, Any], endpoint: str, *, bind: str | None = None,
                pool_residency: bool = False) -> ServiceProcess:
    """A `pof relay` putting node ``node``'s engine prefix cache (its KV events on ``endpoint``)
    into the index of ``pool`` (a pof config without ``node_id``). ``bind``: where routers connect
    (default: a free port nobody is told of); ``pool_residency``: also announce the pages the node's
    pool can load (what vllm-router's ``kv_aware`` credits as host memory)."""
    cfg = tmp / f"relay-{node}.json"
    cfg.write_text(json.dumps({"node_id": node, **pool}))
    relay = ServiceProcess(tmp / f"relay-{node}.log")
    relay.launch([sys.executable, "-m", "pof_connector.cli", "relay", "--config", str(cfg),
                  "--engine-events", endpoint, "--bind", bind or f"tcp://127.0.0.1:{free_port()}",
                  *([] if pool_residency else ["--no-pool-residency"])])
    return relay


def _own_cores(i: int) -> dict[str, str]:
    """Server ``i`` of two computes on its own half of the cores, as two hosts would: sharing
    them, each server's OpenMP threads spin while the other computes, and TTFTs measure that."""
    n = os.cpu_count() or 1
    if n < 2:
        return {}
    half = n // 2
    first, last = i * half, (i + 1) * half - 1
    return {"VLLM_CPU_OMP_THREADS_BIND": str(first) if first == last else f"{first}-{last}"}


def _check_tokenizer(server: VllmServer, work: Workload) -> None:
    """The router tokenizes locally: it must agree with the engine, or it routes on wrong keys."""
    ask = {"prompt": work.prompts[0]} if work.chats is None else {"messages": work.chats[0]}
    theirs = server.post("/tokenize", {"model": "m", **ask})["tokens"]
    if theirs != work.tokens[0]:
        raise BenchError("the local tokenizer disagrees with the engine's /tokenize")


def _chat_tokens(model_dir: Path) -> ChatTokens:
    """A chat request's tokens as `pof router` renders and tokenizes them (checked against the
    engine's by :func:`_check_tokenizer`)."""
    from pof_connector.locality.locator import hf_tokenizer
    from pof_connector.router.chat_prompt import ChatPrompt
    from pof_connector.router.prefix_tokenizer import PrefixTokenizer

    chat = ChatPrompt.load(str(model_dir))
    if chat is None:
        raise BenchError(f"--api chat: {model_dir} has no chat template, or transformers is missing")
    tok = PrefixTokenizer(hf_tokenizer(str(model_dir)))

    def tokens(messages: Messages) -> list[int]:
        got = chat.tokens({"messages": messages}, tok)
        assert got is not None, "a system and a user message of plain text always render"
        return got
    return tokens
