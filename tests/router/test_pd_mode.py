"""`pof router`'s P/D mode on CPU with stand-in engines that speak vLLM's P/D protocol: the
prefill half goes to a prefill server with do_remote_decode and max_tokens 1, its hand-off to a
decode server with the client's request; a failed prefill means the decode server computes, a
failed decode server is replaced. The same mode in front of real vLLM servers:
tests/adapters/test_vllm_pd_servers.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from pof_connector.bench.vllm_server import free_port
from pof_connector.config import ConfigError
from pof_connector.router.pd_proxy import prefill_body
from pof_connector.router.proxy import make_app
from pof_connector.router.router_config import RouterConfig
from pof_connector.router.serve import build, build_prefill


class PdEngine:
    """A vLLM server with a P/D connector, as far as the router sees one: a prefill request
    (``do_remote_decode``) answers a hand-off naming this engine; every request is recorded."""

    def __init__(self, name: str, status: int = 200) -> None:
        self.name = name
        self.status = status
        self.bodies: list[dict[str, Any]] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = FastAPI()

        @app.get("/health")
        def health() -> dict[str, bool]:
            return {"ok": True}

        @app.post("/v1/completions")
        async def complete(request: Request) -> Any:
            body = await request.json()
            self.bodies.append(body)
            if self.status != 200:
                from fastapi.responses import JSONResponse
                return JSONResponse({"error": {"message": "down"}}, status_code=self.status)
            params = body.get("kv_transfer_params") or {}
            if params.get("do_remote_decode"):
                return {"choices": [{"text": "x"}], "kv_transfer_params": {"do_remote_prefill": True,
                                                                            "pof_node": self.name,
                                                                            "pof_tokens": 128}}
            text = f"{self.name}:{params.get('pof_node', '-')}"
            if body.get("stream"):
                async def chunks() -> Any:
                    for i in range(body.get("n", 1)):
                        yield f'data: {{"choices": [{{"index": {i}, "text": "{text}"}}]}}\n\n'.encode()
                    yield b"data: [DONE]\n\n"
                return StreamingResponse(chunks(), media_type="text/event-stream")
            return {"choices": [{"index": i, "text": text} for i in range(body.get("n", 1))]}

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> PdEngine:
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
def engines() -> Iterator[dict[str, PdEngine]]:
    es = {n: PdEngine(n).start() for n in ("p1", "d1", "d2")}
    yield es
    for e in es.values():
        if e.thread.is_alive():
            e.stop()


def client_for(engines: dict[str, PdEngine], prefill: list[str], decode: list[str], **extra: Any) -> TestClient:
    config = RouterConfig.from_mapping({
        "policy": "round_robin", **extra,
        "prefill": [{"name": n, "url": engines[n].url} for n in prefill],
        "decode": [{"name": n, "url": engines[n].url} for n in decode]})
    router, index = build(config)
    return TestClient(make_app(router, prefill=build_prefill(config, index)))


def test_prefill_then_decode_with_the_handoff(engines: dict[str, PdEngine]) -> None:
    with client_for(engines, ["p1"], ["d1"]) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 9, "n": 2,
                                                 "logprobs": 2, "stream": False})
        assert r.status_code == 200 and r.headers["x-pof-prefill"] == "p1" and r.headers["x-pof-backend"] == "d1"
        assert [c["text"] for c in r.json()["choices"]] == ["d1:p1", "d1:p1"]
        sent = engines["p1"].bodies[-1]
        assert sent["max_tokens"] == 1 and sent["kv_transfer_params"] == {"do_remote_decode": True}
        assert "n" not in sent and "logprobs" not in sent and "stream" not in sent
        got = engines["d1"].bodies[-1]
        assert got["max_tokens"] == 9 and got["n"] == 2 and got["logprobs"] == 2       # the client's request
        assert got["kv_transfer_params"]["pof_tokens"] == 128
        # streamed: the decode server's stream passes through
        with client.stream("POST", "/v1/completions", json={"model": "m", "prompt": [1, 2], "stream": True}) as s:
            body = b"".join(s.iter_bytes())
        assert b"d1:p1" in body and body.endswith(b"data: [DONE]\n\n")


def test_a_failed_prefill_means_the_decode_server_computes(engines: dict[str, PdEngine]) -> None:
    with client_for(engines, ["p1"], ["d1"]) as client:
        engines["p1"].status = 500
        r = client.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 4})
        assert r.status_code == 200 and r.headers["x-pof-prefill"] == "none:prefill-status-500"
        assert "kv_transfer_params" not in engines["d1"].bodies[-1]
        engines["p1"].stop()
        r = client.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 4})
        assert r.status_code == 200 and r.headers["x-pof-prefill"] == "none:no-prefill-server"
        assert r.json()["choices"][0]["text"] == "d1:-"


def test_prompts_below_pd_min_prefill_tokens_are_computed_on_the_decode_server(engines: dict[str, PdEngine]) -> None:
    with client_for(engines, ["p1"], ["d1"], pd_min_prefill_tokens=4) as client:
        sent = len(engines["p1"].bodies)
        r = client.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 4})
        assert r.status_code == 200 and r.headers["x-pof-prefill"] == "none:short-prompt"
        assert len(engines["p1"].bodies) == sent and "kv_transfer_params" not in engines["d1"].bodies[-1]
        r = client.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3, 4], "max_tokens": 4})
        assert r.headers["x-pof-prefill"] == "p1" and r.json()["choices"][0]["text"] == "d1:p1"


def test_a_failed_decode_server_is_replaced_and_the_handoff_still_holds(engines: dict[str, PdEngine]) -> None:
    engines["d1"].stop()
    with client_for(engines, ["p1"], ["d1", "d2"]) as client:
        for _ in range(3):
            r = client.post("/v1/completions", json={"model": "m", "prompt": [5, 6], "max_tokens": 4})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "d2:p1"


def test_prefill_body_keeps_the_prompt_and_sampling_but_one_token() -> None:
    body = {"model": "m", "prompt": [1], "max_completion_tokens": 30, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "min_tokens": 5, "cache_salt": "t"}
    assert prefill_body(body) == {"model": "m", "prompt": [1], "temperature": 0, "cache_salt": "t", "max_tokens": 1,
                                  "kv_transfer_params": {"do_remote_decode": True}}


@pytest.mark.parametrize(("raw", "words"), [
    ({"prefill": [{"name": "p", "url": "http://x"}]}, "decode: P/D mode needs"),
    ({"decode": [{"name": "d", "url": "http://x"}]}, "prefill: P/D mode needs"),
    ({"backends": [{"name": "a", "url": "http://x"}], "prefill": [{"name": "p", "url": "http://y"}],
      "decode": [{"name": "d", "url": "http://z"}]}, "backends: leave it out in P/D mode"),
    ({"prefill": [{"name": "a", "url": "http://y"}], "decode": [{"name": "a", "url": "http://z"}]}, "unique"),
    ({}, "backends: at least one backend"),
])
def test_pd_config_errors_name_the_key(raw: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        RouterConfig.from_mapping(raw)
