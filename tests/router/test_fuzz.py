"""Property-based fuzzing of `pof router` and the locality API from their OpenAPI schemas
(schemathesis), each served by a real uvicorn: the router in front of stand-in engines (they
stand in for vLLM servers, see test_proxy.py) with a real index and pool node, the locality API
over a real index. Inputs that fit the schema and inputs that do not: never a 5xx, every 4xx the
server answers itself is JSON with a message and bounded in size, and the server keeps serving."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings

from pof_connector.index.redis import RedisIndex
from pof_connector.index.server import RedisServer
from pof_connector.locality.api import make_app as locality_app
from pof_connector.router.proxy import make_app as router_app
from pof_connector.router.serve import build
from tests.http_server import serve
from tests.locality.test_api import node
from tests.router.test_proxy import SEG, StandInEngine, engines, router_config  # noqa: F401  (fixture)

GenerationMode = schemathesis.GenerationMode

EXAMPLES = 40
"""Examples per operation with a body, per generation mode: the whole file stays well under a minute
on 2 cores. Operations without input get :data:`FEW`."""
FEW = 5
MAX_ERROR_BYTES = 16 << 10
PREFIX = list(range(100, 100 + 16 * 4))


def message_of(body: Any) -> str:
    """The message of an error body: the router's OpenAI-style ``error.message``, or the locality
    API's ``detail`` (a string, or a list of validation errors with ``msg``); ``''`` when none."""
    if not isinstance(body, dict):
        return ""
    if isinstance(body.get("error"), dict):
        return str(body["error"].get("message") or "")
    detail = body.get("detail")
    if isinstance(detail, list):
        return "; ".join(str(d.get("msg", "")) for d in detail if isinstance(d, dict))
    return str(detail or "")


def check(response: Any, case: Any) -> None:
    where = f"{case.method} {case.formatted_path} {case.body!r:.300}"
    assert response.status_code < 500, f"{where}: {response.status_code} {response.text[:500]}"
    if 400 <= response.status_code < 500:
        assert len(response.content) <= MAX_ERROR_BYTES, f"{where}: a {len(response.content)}-byte error"
        ctype = response.headers.get("content-type") or [""]     # schemathesis: header -> list of values
        assert ctype[0].startswith("application/json"), f"{where}: {ctype}"
        assert message_of(response.json()), f"{where}: {response.status_code} without a message: {response.text}"


def fuzz(url: str, paths: set[str], skip: Callable[[Any], bool] = lambda case: False) -> int:
    """Fuzz every operation of ``url``'s schema on ``paths``; returns the number of calls."""
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    session = requests.Session()
    calls = 0
    for result in schema.get_all_operations():
        op = result.ok()
        if op.path not in paths:
            continue
        # (an operation without parameters or body has no input that breaks its schema)
        has_body = op.method.lower() == "post"
        for mode in [GenerationMode.POSITIVE, GenerationMode.NEGATIVE] if has_body else [GenerationMode.POSITIVE]:
            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES if has_body else FEW, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            def one(case: Any) -> None:
                nonlocal calls
                if skip(case):
                    return
                calls += 1
                check(case.call(base_url=url, session=session, timeout=10), case)
            one()
    return calls


@pytest.fixture
def index(redis_server: RedisServer) -> Iterator[RedisIndex]:
    reader = RedisIndex(redis_server.url, None)
    yield reader
    reader.close()


def test_fuzz_the_locality_api(redis_server: RedisServer, runtime_dir: str, index: RedisIndex) -> None:
    pool = node("a", redis_server.url, runtime_dir)
    try:
        pool.store([(k, SEG) for k in pool.keys_for(PREFIX)]).result()
        with serve(locality_app(index)) as url:
            calls = fuzz(url, {"/v1/locality", "/v1/nodes", "/healthz", "/metrics"})
            assert calls > 60
            r = requests.post(url + "/v1/locality", json={"tokens": [*PREFIX, 1]}, timeout=5)
            assert r.status_code == 200 and r.json()["nodes"][0]["matched_tokens"] == len(PREFIX), r.text
    finally:
        pool.close()


def test_fuzz_the_router(engines: dict[str, StandInEngine], redis_server: RedisServer,  # noqa: F811
                         runtime_dir: str) -> None:
    pool = node("a", redis_server.url, runtime_dir)
    # Stand-in engines answer as fast whatever the prompt: the fuzzing's requests teach the cost
    # model that prefill is free, and it would then balance load rather than route to the holder
    # (tests/router/test_balance.py); the check after the fuzzing is that routing still works.
    router, index = build(router_config(engines, index_url=redis_server.url, max_body_bytes=1 << 20,
                                        max_tokenize_chars=10_000, cost={"balance_within_error": False}))
    try:
        pool.store([(k, SEG) for k in pool.keys_for(PREFIX)]).result()
        with serve(router_app(router)) as url:
            time.sleep(0.3)
            calls = fuzz(url, {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/pof/backends",
                               "/metrics"})
            assert calls > 60
            r = requests.post(url + "/v1/completions", json={"model": "m", "prompt": [*PREFIX, 1]}, timeout=5)
            assert r.status_code == 200 and r.headers["x-pof-backend"] == "a", r.text
            assert r.headers["x-pof-reason"] == "pof"
            state = requests.get(url + "/pof/backends", timeout=5).json()["backends"]
            assert all(b["healthy"] and b["running"] == 0 for b in state), state
    finally:
        pool.close()
        if index is not None:
            index.close()


