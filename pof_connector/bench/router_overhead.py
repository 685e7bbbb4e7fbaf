"""``pof bench router-overhead``: the router's own time per request, by stage, on one host.

Everything runs on loopback: a real Redis-protocol index, ``backends`` pool nodes publishing the
pages of a few long system prompts in it (so the router's lookup finds holders), ``backends``
stand-ins for vLLM servers (:mod:`pof_connector.bench.stand_in_engine`: they answer at once), and
`pof router` itself as a subprocess, with the local tokenizer of the ``tiny`` model. A client
sends text prompts of about ``prompt_tokens`` tokens (a tenant's system prompt and a short
question), then the same prompts as token ids, as chat requests (the system prompt and the
question as two messages, which the router renders with the model's chat template), one at a
time, and the text prompts from ``concurrency`` clients. The pool nodes hold each tenant's system
prompt both as a completions prompt and as the chat rendering's leading tokens. A last run sends
``paced_requests`` text prompts one at a time at ``paced_rate`` per second, as the router bench's
workloads arrive: between requests the host idles, and each request then pays for waking the
index server and for cold caches, which requests sent back to back do not.

The router says what it spent per request (headers ``x-pof-router-overhead`` and
``x-pof-router-stages``: parse, tokenize, lookup, choose, proxy); the client's time to the first
byte through the router against straight to a stand-in gives the whole proxy hop. One index round
trip (PING) is timed for reference.
"""

from __future__ import annotations

import http.client
import random
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

import pof_connector
from pof_connector.bench.router_process import RouterProcess
from pof_connector.bench.stand_in_engine import StandInEngines
from pof_connector.bench.vllm_server import build_model
from pof_connector.config import PofConfig
from pof_connector.index import redis_index
from pof_connector.index.server import RedisServer
from pof_connector.locality.locator import Tokenizer, hf_tokenizer, load_tokenizer
from pof_connector.pages.keys import Namespace
from pof_connector.pages.layout import PageSpec
from pof_connector.pool import Pool
from pof_connector.router.chat_prompt import ChatPrompt
from pof_connector.router.prefix_tokenizer import PrefixTokenizer
from pof_connector.router.stage_clock import parse_header

Progress = Callable[[str], None]
MODEL = "bench/tiny"
SPEC = PageSpec(num_layers=2, segment_bytes=256, page_tokens=16)
STAGES = ("parse", "tokenize", "lookup", "choose", "proxy")
TENANTS = 4
QUESTION_WORDS = 60
"""Words of a request's own question after its tenant's system prompt (about 100 tokens)."""
LETTERS = "abcdefghijklmnopqrstuvwxyz"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PACED_WARMUP = 5


class Sample:
    """What one request showed: the router's figures (from its headers) and the client's TTFB."""

    __slots__ = ("overhead", "route", "stages", "ttfb")

    def __init__(self, ttfb: float, headers: http.client.HTTPMessage) -> None:
        self.ttfb = ttfb
        raw = headers.get("x-pof-router-overhead")
        self.overhead = float(raw) if raw is not None else None
        self.route = headers.get("x-pof-route-reason", "")
        self.stages = parse_header(headers.get("x-pof-router-stages"))


def quantiles(values: list[float]) -> dict[str, float]:
    """p50 and p99 (nearest rank), in seconds."""
    if not values:
        return {}
    arr = np.asarray(values)
    return {"p50": float(np.percentile(arr, 50)), "p99": float(np.percentile(arr, 99)), "mean": float(arr.mean())}


def _prompts(tokenize: Tokenizer, count: int, prompt_tokens: int, seed: int) -> tuple[list[str], list[str]]:
    """(system prompts, ``count`` request prompts of about ``prompt_tokens`` tokens)."""
    rnd = random.Random(seed)

    def words(n: int) -> str:
        return " ".join("".join(rnd.choice(LETTERS) for _ in range(rnd.randrange(2, 9))) for _ in range(n))

    questions = [f"\nUser {i}: {words(QUESTION_WORDS)}\nAnswer:" for i in range(count)]
    target = prompt_tokens - len(tokenize(questions[0]))
    systems = []
    for t in range(TENANTS):
        parts = [f"System prompt of tenant {t}."]
        while len(tokenize(" ".join(parts))) < target:
            parts.append(words(8))
        systems.append(" ".join(parts))
    return systems, [systems[i % TENANTS] + q for i, q in enumerate(questions)]


def _pools(index_url: str, workdir: Path, n: int, systems: list[list[int]]) -> list[Pool]:
    """``n`` pool nodes; the pages of ``systems[i]`` (tenant ``i % TENANTS``'s) are held by node
    ``(i % TENANTS) % n``."""
    ns = Namespace(MODEL, "bfloat16", "mha", SPEC).digest
    seg = [np.zeros(SPEC.segment_bytes, np.uint8)] * SPEC.num_layers
    pools = []
    for i in range(n):
        cfg = PofConfig.from_mapping({"node_id": f"node-{i}", "index_url": index_url, "runtime_dir": str(workdir),
                                      "heartbeat_s": 0.5, "node_ttl_s": 10.0,
                                      "tiers": {"cpu_dram": {"size": "32MiB"}}})
        pools.append(Pool(cfg, SPEC, ns, meta={"engine": "stand-in", "model": MODEL}))
    reader = redis_index(index_url, None)
    try:
        for i, tokens in enumerate(systems):
            pool = pools[(i % TENANTS) % n]
            keys = pool.keys_for(tokens)
            pool.store([(k, seg) for k in keys]).result()
            deadline = time.monotonic() + 10
            while len(reader.longest_prefix(keys)) < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        reader.close()
    return pools


def _ping(index_url: str, n: int) -> dict[str, float]:
    import redis

    r = redis.Redis.from_url(index_url)
    try:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            r.ping()
            times.append(time.perf_counter() - t0)
        return quantiles(times[n // 10:])
    finally:
        r.close()


def _send(conn: http.client.HTTPConnection, path: str, body: bytes) -> Sample:
    t0 = time.perf_counter()
    conn.request("POST", path, body, {"content-type": "application/json"})
    resp = conn.getresponse()
    ttfb = time.perf_counter() - t0
    sample = Sample(ttfb, resp.headers)
    resp.read()
    if resp.status != 200:
        raise RuntimeError(f"request answered {resp.status}")
    return sample


def _drive(url: str, bodies: list[bytes], concurrency: int, warmup: int, path: str = COMPLETIONS,
           rate: float = 0.0) -> list[Sample]:
    """POST ``bodies`` to ``path`` from ``concurrency`` clients, each on one kept-alive connection
    (``rate`` > 0: each client starts a request every 1 / ``rate`` seconds, else at once after the
    last); the first ``warmup`` answers of each are left out."""
    host = urlsplit(url)
    out: list[Sample] = []
    lock = threading.Lock()

    def client(mine: list[bytes]) -> None:
        conn = http.client.HTTPConnection(host.hostname or "127.0.0.1", host.port, timeout=30)
        try:
            got = []
            for b in mine:
                started = time.perf_counter()
                got.append(_send(conn, path, b))
                if rate > 0:
                    time.sleep(max(0.0, 1 / rate - (time.perf_counter() - started)))
        finally:
            conn.close()
        with lock:
            out.extend(got[warmup:])

    threads = [threading.Thread(target=client, args=(bodies[i::concurrency],)) for i in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return out


def _summary(samples: list[Sample]) -> dict[str, Any]:
    overhead = [s.overhead for s in samples if s.overhead is not None]
    return {"requests": len(samples), "overhead_s": quantiles(overhead),
            "stages_s": {st: quantiles([s.stages[st] for s in samples if st in s.stages]) for st in STAGES
                         if any(st in s.stages for s in samples)},
            "ttfb_s": quantiles([s.ttfb for s in samples]),
            "routes": dict(Counter(s.route for s in samples))}


def run(*, requests: int = 2000, backends: int = 4, concurrency: int = 8, prompt_tokens: int = 2900,
        model: str | None = None, seed: int = 7, paced_requests: int = 150, paced_rate: float = 3.0,
        progress: Progress = lambda _: None) -> dict[str, Any]:
    import json

    model_dir = Path(model) if model else build_model("tiny", tokenizer_only=True)
    tokenize = load_tokenizer(str(model_dir), special_tokens=True)
    progress(f"prompts: {requests} of ~{prompt_tokens} tokens ({model_dir})")
    systems, texts = _prompts(tokenize, requests, prompt_tokens, seed)
    ids = [tokenize(t) for t in texts]
    chat = ChatPrompt.load(str(model_dir))
    if chat is None:
        raise RuntimeError(f"{model_dir} has no chat template (or transformers is missing): the chat run needs one")
    questions = [t[len(systems[i % TENANTS]):] for i, t in enumerate(texts)]
    chat_bodies = [json.dumps({"model": MODEL, "messages": [{"role": "system", "content": systems[i % TENANTS]},
                                                           {"role": "user", "content": q}],
                               "max_tokens": 8, "stream": True}).encode() for i, q in enumerate(questions)]
    chat_ids = PrefixTokenizer(hf_tokenizer(str(model_dir)))
    chat_systems: list[list[int]] = []
    for system in systems:
        got = chat.tokens({"messages": [{"role": "system", "content": system}], "add_generation_prompt": False},
                          chat_ids)
        assert got is not None, "a plain system message always renders"
        chat_systems.append(got)
    text_bodies = [json.dumps({"model": MODEL, "prompt": t, "max_tokens": 8, "stream": True}).encode() for t in texts]
    id_bodies = [json.dumps({"model": MODEL, "prompt": i, "max_tokens": 8, "stream": True}).encode() for i in ids]
    warmup = min(50, max(requests // 10, 1))
    with tempfile.TemporaryDirectory(prefix="pof-ro-", dir="/tmp") as tmp:
        work = Path(tmp)
        redis = RedisServer(work / "redis").start()
        engines = StandInEngines(backends)
        pools: list[Pool] = []
        router: RouterProcess | None = None
        try:
            progress(f"index {redis.url}; {backends} pool nodes, {backends} stand-in engines")
            pools = _pools(redis.url, work, backends, [tokenize(s) for s in systems] + chat_systems)
            config = {"index_url": redis.url, "model": MODEL, "tokenizer": str(model_dir),
                      "health": {"interval_s": 1.0},
                      "backends": [{"name": f"e{i}", "url": u, "node_id": f"node-{i}"}
                                   for i, u in enumerate(engines.urls)]}
            router = RouterProcess.pof(work, config)
            # the router imports the pof_connector this bench runs (a worktree, not the installed one)
            router.launch(router.args, env={"PYTHONPATH": str(Path(pof_connector.__file__).parent.parent)})
            router.wait_healthy(router.url + "/health", 60, interval_s=0.2)
            time.sleep(1.0)              # its first /metrics readings of the engines
            runs: dict[str, Any] = {}
            plan = (("text", router.url, text_bodies, 1, COMPLETIONS), ("ids", router.url, id_bodies, 1, COMPLETIONS),
                    ("chat", router.url, chat_bodies, 1, CHAT),
                    (f"text_c{concurrency}", router.url, text_bodies, concurrency, COMPLETIONS),
                    ("text_direct", engines.urls[0], text_bodies, 1, COMPLETIONS))
            for name, url, bodies, clients, path in plan:
                progress(f"{name}: {len(bodies)} requests from {clients} client(s)")
                runs[name] = _summary(_drive(url, bodies, clients, warmup if clients == 1 else warmup // clients,
                                             path))
            if paced_requests > 0:
                name = f"text_paced_{paced_rate:g}_per_s"
                paced = text_bodies[:paced_requests + PACED_WARMUP]
                progress(f"{name}: {len(paced)} requests at {paced_rate:g}/s from 1 client")
                runs[name] = _summary(_drive(router.url, paced, 1, PACED_WARMUP, rate=paced_rate))
            hop = runs["text"]["ttfb_s"]["p50"] - runs["text_direct"]["ttfb_s"]["p50"]
            return {"setup": {"requests": requests, "backends": backends, "pool_nodes": backends,
                              "paced_requests": paced_requests, "paced_rate": paced_rate,
                              "concurrency": concurrency, "prompt_tokens_mean": float(np.mean([len(i) for i in ids])),
                              "tenants": TENANTS, "warmup_per_client": warmup, "model": str(model_dir)},
                    "index_ping_s": _ping(redis.url, 1000), "runs": runs, "proxy_hop_p50_s": hop}
        finally:
            if router is not None:
                router.stop()
            engines.stop()
            for p in pools:
                p.close()
            redis.stop()
