"""``pof bench router``: a multi-tenant workload through three routers, same run, same model.

Tenants share long system prompts; one hot tenant takes ``hot_share`` of the requests, more than
one server can serve alone; requests arrive open-loop (Poisson, ``rate`` per second, as from many
users) or from ``clients`` closed-loop clients; each server's KV cache is limited with
``--num-gpu-blocks-override`` so it cannot keep every tenant, and each server computes on its own
half of the CPU cores (``VLLM_CPU_OMP_THREADS_BIND``), as two hosts would. Three set-ups, one after another:

- ``round_robin`` and ``cache_aware``: the stock ``vllm-router`` in front of two vLLM servers
  whose connector only stores (``kv_role: kv_producer``, private pools): they run the same engine
  code as the pooled servers (on this CPU a server with any KV connector configured prefills
  ~1.4x faster than one without, so servers without one would not be a fair baseline), but no request
  is ever served from a pool;
- ``pof``: `pof router` in front of two vLLM servers whose pools share one CXL region and one
  Redis-protocol index, so either server can load a prefix the other computed; a `pof relay`
  per server reports its engine's prefix cache (from vLLM's KV events) to the index.

Each request streams a short greedy completion; TTFT is the client-side time to the first chunk.
The prefix hit rate is (engine prefix-cache hits + connector hits) / prompt tokens, from the
servers' own metrics, compared with the first-touch bound: every tenant's system prompt is
computed once in the cluster and hit by every later request (whole blocks, never a prompt's last
token). ``ratio`` = pof mean TTFT / cache_aware mean TTFT. Needs vLLM and vllm-router (:data:`NEEDS`,
checked before anything starts).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pof_connector.bench import BenchError
from pof_connector.bench.needs import VLLM, VLLM_ROUTER, Need, check
from pof_connector.bench.router_process import RouterProcess
from pof_connector.bench.service_process import ServiceProcess
from pof_connector.bench.vllm_server import VllmServer, build_model, connector_config, free_port, stream_completion
from pof_connector.index.server import RedisServer

Progress = Callable[[str], None]
BLOCK = 128
NEEDS: list[Need] = [VLLM, Need("the round_robin and cache_aware routers", VLLM_ROUTER.package, binary="vllm-router")]
METRICS = ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total", "vllm:prompt_tokens_total")


@dataclass(frozen=True)
class Workload:
    prompts: list[str]
    tokens: list[list[int]]
    tenants: list[int]

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
                  hot_share: float, seed: int) -> Workload:
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
    prompts = [f"{systems[t]}\nUser {i}: {words(rnd.randrange(40, 120))}\nAnswer:" for i, t in enumerate(chosen)]
    return Workload(prompts, [tokenize(p) for p in prompts], chosen)


def _drive(url: str, work: Workload, clients: int, rate: float, seed: int) -> tuple[list[float], list[str], float]:
    """Send every prompt in order; (TTFTs, answers, wall seconds). ``rate`` > 0: open loop, Poisson
    arrivals at ``rate`` per second (a request never waits for another's answer, as with many
    users); otherwise ``clients`` closed-loop clients."""
    ttfts = [0.0] * len(work.prompts)
    answers = [""] * len(work.prompts)
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
            ttfts[i], answers[i] = stream_completion(url, work.prompts[i], max_tokens=8)

        with ThreadPoolExecutor(len(work.prompts)) as ex:
            for f in [ex.submit(one, i) for i in range(len(work.prompts))]:
                f.result()
        return ttfts, answers, time.perf_counter() - t0
    nxt = iter(range(len(work.prompts)))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            ttfts[i], answers[i] = stream_completion(url, work.prompts[i], max_tokens=8)

    with ThreadPoolExecutor(clients) as ex:
        for f in [ex.submit(client) for _ in range(clients)]:
            f.result()
    return ttfts, answers, time.perf_counter() - t0


def _counters(servers: list[VllmServer]) -> dict[str, float]:
    out = dict.fromkeys(METRICS, 0.0)
    for s in servers:
        m = s.metrics()
        for k in METRICS:
            out[k] += m.get(k, 0.0)
    return out


def _phase(name: str, url: str, servers: list[VllmServer], work: Workload, clients: int, rate: float,
           seed: int, progress: Progress) -> dict[str, Any]:
    for s in servers:
        s.reset_prefix_cache()
    before = _counters(servers)
    how = f"{rate:g} requests/s" if rate > 0 else f"{clients} clients"
    progress(f"  {name}: {len(work.prompts)} requests, {how} ...")
    ttfts, answers, wall = _drive(url, work, clients, rate, seed)
    after = _counters(servers)
    delta = {k: after[k] - before[k] for k in METRICS}
    hits = delta["vllm:prefix_cache_hits_total"] + delta["vllm:external_prefix_cache_hits_total"]
    prompt_tokens = sum(len(t) for t in work.tokens)
    bound = work.first_touch_bound()
    q = statistics.quantiles(ttfts, n=10)
    row: dict[str, Any] = {
           "mean_ttft_s": round(statistics.fmean(ttfts), 4), "p50_ttft_s": round(statistics.median(ttfts), 4),
           "p90_ttft_s": round(q[-1], 4), "hit_rate": round(hits / prompt_tokens, 4),
           "hit_vs_first_touch_bound": round(hits / bound, 4) if bound else None,
           "pool_hit_tokens": int(delta["vllm:external_prefix_cache_hits_total"]),
           "engine_hit_tokens": int(delta["vllm:prefix_cache_hits_total"]), "wall_s": round(wall, 2)}
    progress(f"  {name}: mean TTFT {row['mean_ttft_s']:.3f} s, p90 {row['p90_ttft_s']:.3f} s, hit rate "
             f"{row['hit_rate']:.3f} ({row['hit_vs_first_touch_bound']} of the bound)")
    row["answers"] = answers
    return row


def run(*, model: str | None, tenants: int, system_tokens: int, requests: int, clients: int, rate: float,
        hot_share: float, kv_tokens: int, seed: int, progress: Progress) -> dict[str, Any]:
    check(NEEDS, "router")      # before a model is built or a server started
    from tokenizers import Tokenizer

    from pof_connector.locality.locator import load_tokenizer

    if not 0 < hot_share < 1 or tenants < 2:
        raise BenchError("--hot-share must be in (0, 1) and --tenants at least 2")
    model_dir = Path(model) if model else build_model("tiny")
    tokenize = load_tokenizer(str(model_dir), special_tokens=True)
    Tokenizer.from_file(str(model_dir / "tokenizer.json"))    # fail early on a model without tokenizer.json
    work = make_workload(tokenize, tenants=tenants, system_tokens=system_tokens, requests=requests,
                         hot_share=hot_share, seed=seed)
    max_len = max(4096, max(len(t) for t in work.tokens) + 64)
    blocks = kv_tokens // BLOCK
    common = ["--num-gpu-blocks-override", str(blocks), "--max-num-seqs", str(max(clients, 2))]
    tmp = Path(tempfile.mkdtemp(prefix="pof-bench-router-", dir="/tmp"))
    results: dict[str, dict[str, Any]] = {}
    redis = RedisServer(tmp / "redis").start()
    try:
        how = f"Poisson arrivals at {rate:g}/s" if rate > 0 else f"{clients} closed-loop clients"
        progress(f"workload: {requests} requests, {tenants} tenants (hot share {hot_share}), system prompts "
                 f"~{system_tokens} tokens, {how}; KV {blocks * BLOCK} tokens per server")
        store_only = {"index_url": "local", "tiers": {"cpu_dram": {"size": "1GiB"}}}
        baseline = _start_pair(model_dir, tmp, "store-only", store_only, max_len, common, progress,
                               role="kv_producer")
        try:
            _check_tokenizer(baseline[0], work)
            for policy in ("round_robin", "cache_aware"):
                router = RouterProcess.vllm_router(tmp, [s.url for s in baseline], policy, name=f"vllm-router-{policy}")
                router.start()
                try:
                    results[policy] = _phase(policy, router.url, baseline, work, clients, rate, seed, progress)
                finally:
                    router.stop()
        finally:
            for s in baseline:
                s.stop()
        region = Path(tempfile.mkdtemp(prefix="pof-bench-router-", dir="/dev/shm")) / "cxl.region"
        try:
            pool = {"index_url": redis.url, "tiers": {"cxl": {"path": str(region), "size": "1GiB", "partitions": 2}}}
            events = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
            pooled = _start_pair(model_dir, tmp, "pof", pool, max_len, common, progress, events=events)
            relays: list[ServiceProcess] = []
            try:
                # A relay per engine puts the engine's own prefix cache into the index (from its KV
                # events): with a shared pool every node can load every prefix, and the router must
                # still tell a prefix in an engine's cache from one it has to load.
                for i, endpoint in enumerate(events):
                    relays.append(start_relay(tmp, f"n{i}", {"runtime_dir": str(tmp / f"rt-pof{i}"), **pool},
                                              endpoint))
                config = {"index_url": redis.url, "tokenizer": str(model_dir),
                          "backends": [{"name": f"n{i}", "url": s.url} for i, s in enumerate(pooled)]}
                router = RouterProcess.pof(tmp, config).start()
                try:
                    results["pof"] = _phase("pof", router.url, pooled, work, clients, rate, seed, progress)
                finally:
                    router.stop()
            finally:
                for r in relays:
                    r.stop(grace_s=10)
                for s in pooled:
                    s.stop()
        finally:
            shutil.rmtree(region.parent, ignore_errors=True)
    finally:
        redis.stop()
    for name in ("round_robin", "cache_aware"):
        if results[name]["pool_hit_tokens"]:
            raise BenchError(f"{name}: the store-only (kv_producer) servers loaded from their pools")
    # Greedy answers are compared, not required equal: under concurrent load vLLM batches requests
    # differently for each router, and batch composition can flip a near-tie token (seen between
    # round_robin and cache_aware, which load nothing). Exact equality with and without the pool
    # is what the tests check, one request at a time.
    reference = results["round_robin"].pop("answers")
    for name in ("cache_aware", "pof"):
        answers = results[name].pop("answers")
        results[name]["answers_differing_from_round_robin"] = sum(a != b for a, b in zip(answers, reference,
                                                                                          strict=True))
    shutil.rmtree(tmp, ignore_errors=True)
    bound = work.first_touch_bound()
    prompt_tokens = sum(len(t) for t in work.tokens)
    return {
        "bench": "router",
        "ratio": round(results["pof"]["mean_ttft_s"] / results["cache_aware"]["mean_ttft_s"], 4),
        "pof_vs_round_robin": round(results["pof"]["mean_ttft_s"] / results["round_robin"]["mean_ttft_s"], 4),
        "policies": results,
        "first_touch_bound_hit_rate": round(bound / prompt_tokens, 4),
        "workload": {"requests": requests, "tenants": tenants, "hot_share": hot_share, "clients": clients, "rate": rate,
                     "system_tokens": system_tokens, "prompt_tokens": prompt_tokens, "kv_tokens_per_server":
                     blocks * BLOCK, "seed": seed, "model": str(model_dir)},
        "note": "ratio = pof router + pool mean TTFT / vllm-router cache_aware mean TTFT (same servers, store-only "
                "connector: no pool loads); "
                "hit rate = (engine prefix-cache + connector hits) / prompt tokens",
    }


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


def start_relay(tmp: Path, node: str, pool: dict[str, Any], endpoint: str) -> ServiceProcess:
    """A `pof relay` putting node ``node``'s engine prefix cache (its KV events on ``endpoint``)
    into the index of ``pool`` (a pof config without ``node_id``)."""
    cfg = tmp / f"relay-{node}.json"
    cfg.write_text(json.dumps({"node_id": node, **pool}))
    relay = ServiceProcess(tmp / f"relay-{node}.log")
    relay.launch([sys.executable, "-m", "pof_connector.cli", "relay", "--config", str(cfg),
                  "--engine-events", endpoint, "--bind", f"tcp://127.0.0.1:{free_port()}", "--no-pool-residency"])
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
    theirs = server.post("/tokenize", {"model": "m", "prompt": work.prompts[0]})["tokens"]
    if theirs != work.tokens[0]:
        raise BenchError("the local tokenizer disagrees with the engine's /tokenize")
