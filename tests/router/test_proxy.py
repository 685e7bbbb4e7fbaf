"""`pof router` end to end on CPU: real pool nodes and a real Redis-protocol index; the engines
are stand-ins (small HTTP servers speaking the part of vLLM's OpenAI API the router uses:
/health, /tokenize, /v1/completions, /v1/chat/completions). The same router in front of real
vLLM servers is tested in tests/adapters/test_vllm_router.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from fastapi.testclient import TestClient

from pof_connector.bench.vllm_server import free_port
from pof_connector.config import ConfigError
from pof_connector.index.server import RedisServer
from pof_connector.router.proxy import make_app
from pof_connector.router.router_config import RouterConfig
from pof_connector.router.serve import build
from tests.locality.test_api import node

SEG = [np.zeros(512, np.uint8)] * 2
SLOW = 9999
"""``max_tokens`` that makes a stand-in engine take 10 s over a non-streamed answer."""


class StandInEngine:
    """Stands in for a vLLM OpenAI server: answers with its name and the prompt length, tokenizes
    text as one token per character (code point). ``api_key``: like vLLM's ``--api-key``, every
    path but /health answers 401 without ``Authorization: Bearer <api_key>``."""

    def __init__(self, name: str, api_key: str | None = None) -> None:
        self.name = name
        self.authorizations: list[str | None] = []
        """The Authorization header of every request but /health's."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.prompts: list[Any] = []
        self.tokenized = 0
        self.tokenize_bodies: list[dict[str, Any]] = []
        self.aborted = 0          # slow requests whose client went away (vLLM aborts those)
        self.metrics_text: str | None = None
        """What ``/metrics`` answers (vLLM's Prometheus text); ``None``: 404."""
        self.model_root: str | None = None
        """The model path ``/v1/models`` names as ``root``, as vLLM does; ``None``: 404."""
        self.cached_tokens: int | None = None
        """Reported in a streamed answer's usage when the request asks for it (stream_options)."""
        app = FastAPI()

        async def check_key(request: Request, call_next: Any) -> Any:
            if request.url.path == "/health":
                return await call_next(request)
            given = request.headers.get("authorization")
            self.authorizations.append(given)
            if given != f"Bearer {api_key}":
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
            return await call_next(request)

        if api_key is not None:        # (a middleware of this kind hides client disconnects: only when asked)
            app.middleware("http")(check_key)

        @app.get("/version")
        def version() -> dict[str, str]:
            return {"version": self.name}

        @app.post("/detokenize")
        async def detokenize(request: Request) -> dict[str, str]:
            return {"prompt": "".join(chr(t) for t in (await request.json())["tokens"])}

        @app.get("/health")
        def health() -> dict[str, bool]:
            return {"ok": True}

        @app.get("/metrics")
        def metrics() -> Any:
            if self.metrics_text is None:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            return PlainTextResponse(self.metrics_text)

        @app.get("/v1/models")
        def models() -> Any:
            if self.model_root is None:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            return {"object": "list", "data": [{"id": "m", "object": "model", "root": self.model_root}]}

        @app.post("/tokenize")
        async def tokenize(request: Request) -> dict[str, Any]:
            body = await request.json()
            self.tokenized += 1
            self.tokenize_bodies.append(body)
            text = body.get("prompt") or "".join(m["content"] for m in body["messages"])
            return {"tokens": [ord(c) for c in text], "count": len(text)}

        @app.post("/v1/completions")
        @app.post("/v1/chat/completions")
        async def complete(request: Request) -> Any:
            body = await request.json()
            if body.get("max_tokens") == SLOW:      # a long non-streamed answer: 10 s unless the client leaves
                for _ in range(200):
                    if await request.is_disconnected():
                        self.aborted += 1
                        return None
                    await asyncio.sleep(0.05)
            self.prompts.append(body.get("prompt", body.get("messages")))
            text = f"{self.name}:{len(json.dumps(self.prompts[-1]))}"
            if not body.get("stream"):
                return {"choices": [{"text": text}]}

            usage = (body.get("stream_options") or {}).get("include_usage") and self.cached_tokens is not None

            async def chunks() -> Any:
                for part in (text[:2], text[2:]):
                    yield f"data: {json.dumps({'choices': [{'text': part}]})}\n\n"
                if usage:
                    details = {"cached_tokens": self.cached_tokens}
                    yield f"data: {json.dumps({'choices': [], 'usage': {'prompt_tokens_details': details}})}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(chunks(), media_type="text/event-stream")

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> StandInEngine:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "stand-in engine did not start"
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def engines() -> Iterator[dict[str, StandInEngine]]:
    es = {n: StandInEngine(n).start() for n in ("a", "b")}
    yield es
    for e in es.values():
        e.stop()


def router_config(engines: dict[str, StandInEngine], **kw: Any) -> RouterConfig:
    raw: dict[str, Any] = {"backends": [{"name": n, "url": e.url} for n, e in engines.items()],
                           "health": {"interval_s": 0.1, "failures_to_remove": 1}, **kw}
    return RouterConfig.from_mapping(raw)


def post(client: TestClient, tokens: Any, **kw: Any) -> tuple[str, Any]:
    r = client.post("/v1/completions", json={"model": "m", "prompt": tokens, "max_tokens": 4, **kw})
    assert r.status_code == 200, r.text
    return r.headers["x-pof-backend"], r


def test_routes_each_prefix_to_its_holder(engines: dict[str, StandInEngine], redis_server: RedisServer,
                                          runtime_dir: str) -> None:
    a = node("a", redis_server.url, runtime_dir)
    b = node("b", redis_server.url, runtime_dir)
    try:
        tenants = {name: list(range(100 * i, 100 * i + 16 * 6)) for i, name in enumerate(("a", "b"), start=1)}
        for pool, name in ((a, "a"), (b, "b")):
            pool.store([(k, SEG) for k in pool.keys_for(tenants[name])]).result()
        router, index = build(router_config(engines, index_url=redis_server.url))
        with TestClient(make_app(router)) as client:
            time.sleep(0.3)
            for turn in range(3):
                for name, prefix in tenants.items():
                    served, r = post(client, [*prefix, 7, 8, turn])
                    assert served == name and r.headers["x-pof-reason"] == "pof"
                    assert r.json()["choices"][0]["text"].startswith(f"{name}:")
            # text prompts are tokenized by a backend (one token per character here)
            text = "".join(chr(t) for t in tenants["b"])
            assert post(client, text + "?")[0] == "b"
            # streaming passes through unchanged, and a new prefix still gets served
            _, r = post(client, [5] * 40, stream=True)
            assert r.text.count("data:") == 3 and r.text.endswith("data: [DONE]\n\n")
            state = client.get("/pof/backends").json()
            assert sum(x["served"] for x in state["backends"]) == 8
            assert all(x["running"] == x["waiting"] == x["waiting_tokens"] == 0 for x in state["backends"])
            assert 'pof_router_requests_total{backend="a",reason="pof"} 3.0' in client.get("/metrics").text
        assert index is not None
        index.close()
    finally:
        a.close()
        b.close()


def test_dead_backend_is_removed_and_requests_fail_over(engines: dict[str, StandInEngine]) -> None:
    router, _ = build(router_config(engines, policy="round_robin"))
    with TestClient(make_app(router)) as client:
        engines["b"].stop()
        served = {post(client, [1, 2, 3])[0] for _ in range(4)}
        assert served == {"a"}                             # refused connections go to the next backend
        assert client.get("/pof/backends").json()["backends"][1]["healthy"] is False
        assert client.get("/health").json() == {"ok": True, "healthy_backends": 1}
        engines["a"].stop()
        r = client.post("/v1/completions", json={"prompt": [1]})
        assert r.status_code == 503 and "no healthy backend" in r.json()["error"]["message"]


def test_index_down_means_least_loaded(engines: dict[str, StandInEngine], runtime_dir: str) -> None:
    router, index = build(router_config(engines, index_url=f"unix://{runtime_dir}/nothing.sock"))
    with TestClient(make_app(router)) as client:
        served = [post(client, list(range(64))) for _ in range(2)]
        assert {r.headers["x-pof-reason"] for _, r in served} == {"fallback:IndexUnavailable"}
        assert {name for name, _ in served} == {"a", "b"}  # idle backends take turns
    assert index is not None
    index.close()


def test_sticky_sessions_and_bad_requests(engines: dict[str, StandInEngine]) -> None:
    router, _ = build(router_config(engines, policy="round_robin", sticky_header="x-session"))
    with TestClient(make_app(router)) as client:
        first = client.post("/v1/chat/completions", headers={"x-session": "s1"},
                            json={"messages": [{"role": "user", "content": "hi"}]})
        again = [client.post("/v1/chat/completions", headers={"x-session": "s1"},
                             json={"messages": [{"role": "user", "content": "more"}]}) for _ in range(3)]
        assert {r.headers["x-pof-backend"] for r in again} == {first.headers["x-pof-backend"]}
        assert {r.headers["x-pof-reason"] for r in again} == {"sticky"}
        bad = client.post("/v1/completions", content=b"{nope", headers={"content-type": "application/json"})
        assert bad.status_code == 400 and "not JSON" in bad.json()["error"]["message"]


@pytest.mark.parametrize("raw,words", [
    ({}, "backends"),
    ({"backends": []}, "backends"),
    ({"backends": [{"name": "a", "url": "ftp://x"}]}, "backends.0.url"),
    ({"backends": [{"name": "a", "url": "http://x"}], "policy": "fastest"}, "'round_robin'"),
    ({"backends": [{"name": "a", "url": "http://x"}], "cost": {"speed": 1}},
     "allowed keys here: balance_within_error, decode_s"),
    ({"backends": [{"name": "a", "url": "http://x"}, {"name": "a", "url": "http://y"}]}, "unique"),
])
def test_bad_config_names_the_key(raw: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace(".", r"\.").replace("(", r"\(")):
        RouterConfig.from_mapping(raw)


def test_example_config_documents_the_defaults() -> None:
    from pathlib import Path

    from pof_connector.router.router_config import CapacityConfig, CostConfig, HealthConfig

    path = Path(__file__).resolve().parents[2] / "examples" / "router" / "pof-router.yaml"
    cfg = RouterConfig.from_file(path)
    assert [b.pool_node for b in cfg.backends] == ["a", "b"]
    assert cfg.cost == CostConfig() and cfg.health == HealthConfig()     # the file shows the real defaults
    assert cfg.capacity == CapacityConfig()
    assert (cfg.policy, cfg.listen, cfg.sticky_header) == ("pof", "127.0.0.1:8080", None)


def test_routing_without_the_index_is_logged_once_per_transition_and_exported(
        engines: dict[str, StandInEngine], redis_server: RedisServer, runtime_dir: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """Cache-aware routing off is never silent: the reason header on each answer, one log line
    when the index is lost and one when it is back, and /metrics saying which it is now."""
    a = node("a", redis_server.url, runtime_dir)
    try:
        prompt = list(range(100, 100 + 16 * 4))
        a.store([(k, SEG) for k in a.keys_for(prompt)]).result()
        router, index = build(router_config(engines, index_url=redis_server.url))
        with TestClient(make_app(router)) as client, caplog.at_level("WARNING", logger="pof.router"):
            time.sleep(0.3)
            assert post(client, prompt)[1].headers["x-pof-reason"] == "pof"
            redis_server.stop()
            reasons = [post(client, prompt)[1].headers["x-pof-reason"] for _ in range(3)]
            assert reasons == ["fallback:IndexUnavailable"] * 3
            metrics = client.get("/metrics").text
            assert "pof_index_available 0.0" in metrics
            assert 'pof_index_lost_total{reason="IndexUnavailable"} 1.0' in metrics
            redis_server.start()
            deadline = time.monotonic() + 10
            while post(client, prompt)[1].headers["x-pof-reason"] != "pof":   # a's heartbeat re-publishes
                assert time.monotonic() < deadline, "routing did not use the index again"
                time.sleep(0.1)
            assert "pof_index_available 1.0" in client.get("/metrics").text
        lines = [r.getMessage() for r in caplog.records if r.name == "pof.router"]
        # (a request between the restart and a's re-registration falls back with ModelRequired: a
        # change of reason, logged as such, not a second loss)
        assert sum("answering without the locality index" in m and "reason changed" not in m for m in lines) == 1, lines
        assert sum("answers again" in m for m in lines) == 1, lines
        assert index is not None
        index.close()
    finally:
        a.close()


def test_hostile_input_is_answered_with_a_clear_error_and_the_router_keeps_serving(
        engines: dict[str, StandInEngine]) -> None:
    """Issue 19: token ids out of range and deeply nested JSON were 500s (text/plain); a 50 MB
    text prompt was tokenized by every backend in turn. Each is now a 4xx with an OpenAI-style
    error, or (a text prompt too long to tokenize first) routed without its tokens."""
    router, _ = build(router_config(engines, policy="least_loaded", max_body_bytes=1 << 20,
                                    max_tokenize_chars=10_000))
    with TestClient(make_app(router)) as client:
        for prompt in ([-1, 5], [5, 1 << 32], [[1, "x"], [3]], [1.5], [True]):
            r = client.post("/v1/completions", json={"model": "m", "prompt": prompt})
            assert r.status_code == 400 and "token ids" in r.json()["error"]["message"], (prompt, r.text)
        deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        r = client.post("/v1/completions", content=deep, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
        r = client.post("/v1/completions", content=b'{"prompt": "' + b"x" * (2 << 20) + b'"}',
                        headers={"content-type": "application/json"})
        assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"]
        assert sum(e.tokenized for e in engines.values()) == 0 and not any(e.prompts for e in engines.values())

        served, _ = post(client, "y" * 20_000)                 # too long to tokenize first: sent as it is
        assert sum(e.tokenized for e in engines.values()) == 0 and engines[served].prompts == ["y" * 20_000]
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "z" * 20_000}]})
        assert r.status_code == 200 and sum(e.tokenized for e in engines.values()) == 0
        assert post(client, "short")[0] in engines and sum(e.tokenized for e in engines.values()) == 1
        assert post(client, [1, 2, 3])[0] in engines           # still serving


def test_the_rest_of_the_engine_api_is_passed_through(engines: dict[str, StandInEngine]) -> None:
    """Issue 19: routes a vLLM user calls (``/tokenize``, ``/detokenize``, ``/version``, ...) were
    404 through the router."""
    router, _ = build(router_config(engines, policy="least_loaded"))
    with TestClient(make_app(router)) as client:
        r = client.post("/detokenize", json={"tokens": [104, 105]})
        assert r.status_code == 200 and r.json() == {"prompt": "hi"} and r.headers["x-pof-backend"] in engines
        r = client.get("/version")
        assert r.status_code == 200 and r.json()["version"] == r.headers["x-pof-backend"]
        r = client.post("/tokenize", json={"prompt": "abc"})
        assert r.status_code == 200 and r.json()["tokens"] == [97, 98, 99]
        assert client.get("/no/such/route").status_code == 404          # the backend's own 404


@pytest.mark.parametrize("api_key", [None, "router-key"])
def test_a_client_that_leaves_a_non_streamed_request_cancels_it(engines: dict[str, StandInEngine], api_key: str | None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 19: a non-streamed request whose client disconnected ran to its end on the engine
    (the router was waiting for the answer's headers, which come only with the whole answer).
    The router now closes the backend connection, which is how vLLM learns to abort. With an API
    key too: the router's key check must not hide the client's disconnect."""
    keyed: dict[str, Any] = {}
    headers = {}
    if api_key is not None:
        monkeypatch.setenv("POF_TEST_ROUTER_KEY", api_key)
        keyed, headers = {"api_key_env": "POF_TEST_ROUTER_KEY"}, {"Authorization": f"Bearer {api_key}"}
    router, _ = build(router_config(engines, policy="least_loaded", **keyed))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(make_app(router), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "router did not start"
            time.sleep(0.02)
        url = f"http://127.0.0.1:{port}"
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": SLOW}, timeout=0.5,
                       headers=headers)
        deadline = time.monotonic() + 3
        while sum(e.aborted for e in engines.values()) == 0:
            assert time.monotonic() < deadline, "the engine kept computing for a client that left"
            time.sleep(0.05)
        assert "pof_router_abandoned_total" in httpx.get(url + "/metrics").text
        state = httpx.get(url + "/pof/backends", headers=headers).json()
        assert all(b["running"] == 0 for b in state["backends"])      # its ticket was given back
    finally:
        server.should_exit = True
        thread.join(10)


def test_an_answer_that_arrives_as_its_client_leaves_is_closed_not_leaked() -> None:
    """The race in the router's cancel path: the backend's headers arrive while the router asks
    whether the client is still there, and it is not. The response must be closed (else its
    connection stays checked out of the pool for ever)."""
    from pof_connector.router import proxy

    closed: list[bool] = []

    class Arrived:
        def close(self) -> None:
            closed.append(True)

    async def backend() -> Any:
        await asyncio.sleep(0.02)               # not there at the router's first look
        return Arrived()

    class Leaving:
        async def is_disconnected(self) -> bool:
            await asyncio.sleep(0.05)           # the backend answers meanwhile
            return True

    async def scenario() -> None:
        original, proxy.DISCONNECT_POLL_S = proxy.DISCONNECT_POLL_S, 0.0
        try:
            with pytest.raises(proxy._ClientGone):
                await proxy._send_unless_gone(backend(), Leaving())  # type: ignore[arg-type]
        finally:
            proxy.DISCONNECT_POLL_S = original

    asyncio.run(scenario())
    assert closed == [True]
