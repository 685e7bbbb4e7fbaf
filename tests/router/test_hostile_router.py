"""Router findings of the fuzz tests (test_fuzz.py) and of probing by hand, each a 5xx or a lost
backend before; the engines are the stand-ins of test_proxy.py (they stand in for vLLM servers)."""

from __future__ import annotations

import json
import socketserver
import threading
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pof_connector.router.proxy import make_app
from pof_connector.router.router_config import RouterConfig
from pof_connector.router.serve import build
from tests.router.test_proxy import StandInEngine, engines, router_config  # noqa: F401  (fixture)

JSON = {"content-type": "application/json"}


@pytest.mark.parametrize("path,raw,status", [
    ("/v1/completions", b'{"prompt": [1, 2], "cache_salt": "a\\ud800"}', 400),
    ("/v1/completions", b'{"prompt": "ab\\ud800"}', 200),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 200),
])
def test_lone_surrogates_are_not_a_500(engines: dict[str, StandInEngine], path: str, raw: bytes,  # noqa: F811
                                       status: int) -> None:
    """JSON may escape a lone UTF-16 surrogate ("\\ud800"): Python reads it into a str that cannot
    be encoded, and the router answered 500 when it hashed such a salt or sent such a prompt to a
    backend's /tokenize. A salt must be valid Unicode (400, as vLLM answers); a prompt is the
    backend's to judge (it gets it escaped)."""
    router, _ = build(router_config(engines, policy="least_loaded"))
    with TestClient(make_app(router), raise_server_exceptions=False) as client:
        r = client.post(path, content=raw, headers=JSON)
        assert r.status_code == status, r.text
        if status == 400:
            assert "cache_salt" in r.json()["error"]["message"]


ANY_TEXT = st.text(st.characters(codec=None), max_size=40)           # lone surrogates included
VALUES = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | ANY_TEXT,
                      lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ANY_TEXT, inner, max_size=4),
                      max_leaves=12)
BODIES = st.fixed_dictionaries({}, optional={
    "model": VALUES, "prompt": VALUES | st.lists(st.integers(-(1 << 40), 1 << 40), max_size=40),
    "messages": VALUES | st.lists(st.fixed_dictionaries({"role": ANY_TEXT, "content": VALUES | ANY_TEXT}), max_size=3),
    "cache_salt": VALUES | ANY_TEXT, "stream": VALUES})


def test_hostile_bodies_from_openai_shapes(engines: dict[str, StandInEngine]) -> None:  # noqa: F811
    """The router's fields (prompt, messages, cache_salt, model, stream) with any JSON value in
    them, strings with any code point: a 2xx or a 4xx with an OpenAI-style message, never a 5xx."""
    router, _ = build(router_config(engines, policy="least_loaded"))
    with TestClient(make_app(router), raise_server_exceptions=False) as client:
        @given(body=BODIES, chat=st.booleans())
        @settings(max_examples=100, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def one(body: dict[str, Any], chat: bool) -> None:
            raw = json.dumps(body, allow_nan=True).encode()           # NaN / Infinity: Python's JSON reads them
            r = client.post("/v1/chat/completions" if chat else "/v1/completions", content=raw, headers=JSON)
            assert r.status_code < 500, (body, r.status_code, r.text[:300])
            if r.status_code >= 400 and "x-pof-backend" not in r.headers:     # the router's own answer
                assert r.json()["error"]["message"], r.text
        one()
        assert client.post("/v1/completions", json={"prompt": [1, 2, 3]}).status_code == 200


class OneAnswerPerConnection(socketserver.StreamRequestHandler):
    """Stands in for an engine's HTTP server closing a kept-alive connection just as the next request
    comes (its keep-alive timeout, or uvicorn after an internal error): it answers the first request
    of each connection (keep-alive) and closes the connection on the second, unanswered."""

    def handle(self) -> None:
        for answered in (False, True):
            length = 0
            while (line := self.rfile.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            if line == b"" or answered:
                return
            self.rfile.read(length)
            body = b'{"choices": [{"text": "ok"}]}'
            self.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
            self.wfile.flush()


def test_a_backend_closing_a_kept_alive_connection_stays_in_service() -> None:
    """Found by test_hostile_bodies_from_openai_shapes: a backend that closed the router's pooled
    connection was taken out of service at the next request on it (ReadError), so one closing all
    of them left no backend (503). Such a request is now sent once more on a new connection."""
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), OneAnswerPerConnection)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        router, _ = build(RouterConfig.from_mapping({"backends": [{"name": "a", "url": url}], "policy": "least_loaded",
                                                     "health": {"interval_s": 30, "failures_to_remove": 1}}))
        with TestClient(make_app(router)) as client:
            for _ in range(4):
                r = client.post("/v1/completions", json={"prompt": [1, 2, 3]})
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok", r.text
            assert client.get("/pof/backends").json()["backends"][0]["healthy"]
    finally:
        server.shutdown()
        server.server_close()
