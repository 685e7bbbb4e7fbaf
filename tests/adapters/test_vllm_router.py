"""`pof router` in front of two real vLLM CPU servers whose pools publish to a real Redis-protocol
index: a seeded multi-tenant workload lands where each tenant's prefix lives, and the greedy
outputs through the router equal the engines' own outputs."""

from __future__ import annotations

import json
import random
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from pof_connector.bench.router_process import RouterProcess
from pof_connector.bench.vllm_server import VllmServer, build_model, connector_config
from pof_connector.index.server import RedisServer
from pof_connector.locality.engine_load import MetricsPage, read_engine_load
from pof_connector.locality.locator import hf_tokenizer, load_tokenizer
from pof_connector.router.chat_prompt import ChatPrompt
from pof_connector.router.prefix_tokenizer import PrefixTokenizer
from tests.adapters.server_workdir import server_workdir
from tests.adapters.test_vllm import DTYPE

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def workdir(request: pytest.FixtureRequest) -> Iterator[Path]:
    yield from server_workdir(request, "pof-route-")


def workload(seed: int, tenants: int, turns: int, system_tokens: int) -> list[tuple[int, list[int]]]:
    """(tenant, prompt) pairs: each tenant's system prompt plus a fresh user turn; tenants take
    turns so that a tenant's pages are published before its next request arrives."""
    rnd = random.Random(seed)
    systems = [[rnd.randrange(3, 1900) for _ in range(system_tokens)] for _ in range(tenants)]
    out: list[tuple[int, list[int]]] = []
    for _ in range(turns):
        order = list(range(tenants))
        rnd.shuffle(order)
        if out and order[0] == out[-1][0]:
            order.reverse()
        for t in order:
            out.append((t, systems[t] + [rnd.randrange(3, 1900) for _ in range(rnd.randrange(20, 90))]))
    return out


def chat_bodies(system: str) -> list[dict[str, Any]]:
    """Chat requests of the shapes `pof router` renders itself (tests/router/test_chat_prompt.py)."""
    turns = [{"role": "system", "content": system}, {"role": "user", "content": "héllo — what is 日本?"}]
    longer = [*turns, {"role": "assistant", "content": "a country"},
              {"role": "user", "content": "and x * 2?", "name": "ann"}]
    return [{"messages": turns}, {"messages": longer}, {"messages": longer, "add_generation_prompt": False},
            {"messages": longer[:3], "add_generation_prompt": False, "continue_final_message": True},
            {"messages": turns, "add_special_tokens": True}]


def complete(url: str, prompt: list[int]) -> tuple[str, list[int]]:
    body = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True,
            "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        served = r.headers.get("x-pof-backend", "")
        return served, list(json.loads(r.read())["choices"][0]["token_ids"])


def test_requests_land_where_their_prefix_lives(workdir: Path, redis_server: RedisServer) -> None:
    model = build_model("tiny")
    servers: dict[str, VllmServer] = {}
    for name in ("a", "b"):
        cfg = {"node_id": name, "index_url": redis_server.url, "runtime_dir": str(workdir / "rt"),
               "tiers": {"cpu_dram": {"size": "256MiB"}}}
        servers[name] = VllmServer(model, workdir / name, kv_transfer=connector_config(cfg), dtype=DTYPE)
    router: RouterProcess | None = None
    try:
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda s: s.start(), servers.values()))
        config: dict[str, Any] = {"index_url": redis_server.url,
                                  "backends": [{"name": n, "url": s.url} for n, s in servers.items()]}
        router = RouterProcess.pof(workdir, config).start()
        jobs = workload(seed=7, tenants=4, turns=3, system_tokens=700)
        holder: dict[int, str] = {}
        routed: list[tuple[str, list[int], list[int]]] = []
        for tenant, p in jobs:
            served, out = complete(router.url, p)
            if tenant in holder:
                assert served == holder[tenant], f"tenant {tenant} went to {served}, its prefix is on " \
                                                 f"{holder[tenant]}:\n{router.tail()}"
            holder.setdefault(tenant, served)
            routed.append((served, p, out))
        assert set(holder.values()) == {"a", "b"}, holder          # new prefixes spread over the nodes
        # greedy outputs equal the engines' own, asked directly (the other engine: computed afresh)
        for served, p, out in routed:
            other = servers["b" if served == "a" else "a"]
            assert complete(other.url, p)[1] == out
        # the holders served their tenants' later turns from cache (engine or pool), not by recompute
        for name, s in servers.items():
            m = s.metrics()
            assert m["vllm:prefix_cache_hits_total"] + m.get("vllm:external_prefix_cache_hits_total", 0) >= 640, name
        log = router.tail(200)
        assert "pof router on http://" in log
        # the router read each engine's KV figures from vLLM's real /metrics, and found the model's
        # tokenizer from the engines' /v1/models root: text prompts are tokenized locally, exactly
        with urllib.request.urlopen(router.url + "/pof/backends", timeout=10) as r:
            state = json.loads(r.read())
        assert state["tokenizer"] == f"local:{model}", log
        for b in state["backends"]:
            e = b["engine"]
            assert e is not None and 0.0 <= e["kv_usage"] <= 1.0 and e["preemptions"] == 0, b
            assert e["block_tokens"] == 128 and e["kv_capacity_tokens"] > 0 and e["kv_capacity_tokens"] % 128 == 0
        # ... from the page restricted to those series, which vLLM renders alone (its whole page is
        # every histogram, rendered on the engine's host at each read)
        page = MetricsPage(servers["a"].url)
        with httpx.Client(timeout=10) as client:
            load = read_engine_load(page, client)
            restricted, whole = client.get(page.restricted_url).text, client.get(page.full_url).text
        assert load is not None and load.block_tokens == 128 and page.restricts, (load, restricted)
        assert "vllm:num_requests_running" in restricted and "_bucket" not in restricted
        assert len(restricted) * 10 < len(whole), (len(restricted), len(whole))
        text = "def f(x):\n    return x * 2\n" * 20
        local = load_tokenizer(str(model), special_tokens=True)(text)
        assert local == servers["a"].post("/tokenize", {"model": "m", "prompt": text})["tokens"]
        body = {"model": "m", "prompt": text, "max_tokens": 4, "temperature": 0}
        req = urllib.request.Request(router.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            assert r.headers["x-pof-tokens"] == "local" and r.headers["x-pof-route-reason"] == "no-prefix"
            assert int(r.headers["x-pof-kv-need-blocks"]) == -(-(len(local) + 4) // 128)
            assert int(r.headers["x-pof-kv-free-blocks"]) > 0 and float(r.headers["x-pof-router-overhead"]) < 1.0
        # chat requests: rendered with the model's template and tokenized as vLLM does (its
        # /tokenize runs the renderer of its chat endpoint), then routed on those tokens
        chat, tok = ChatPrompt.load(str(model)), PrefixTokenizer(hf_tokenizer(str(model)))
        assert chat is not None
        for body in chat_bodies(text):
            assert chat.tokens(body, tok) == servers["a"].post("/tokenize", {"model": "m", **body})["tokens"], body
        chat_body = {"model": "m", "messages": chat_bodies(text)[0]["messages"], "max_tokens": 4, "temperature": 0}
        deadline = time.monotonic() + 120        # the router imports transformers after finding the model
        while True:
            req = urllib.request.Request(router.url + "/v1/chat/completions", data=json.dumps(chat_body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as r:
                assert r.status == 200
                if r.headers["x-pof-tokens"] == "local":
                    break
            assert time.monotonic() < deadline, router.tail()
            time.sleep(0.5)
    finally:
        if router is not None:
            router.stop()
        for s in servers.values():
            s.stop()
