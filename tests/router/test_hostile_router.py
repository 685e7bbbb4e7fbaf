"""Router findings of the fuzz tests (test_fuzz.py) and of probing by hand, each a 5xx or a lost
backend before; the engines are the stand-ins of test_proxy.py (they stand in for vLLM servers)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from pof_connector.router.proxy import make_app
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
