"""`pof router`'s API key (clients must send it, like vLLM's ``--api-key``) and the key it sends
to backends that require one, both read from an environment variable or a file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from pof_connector.config import ConfigError
from pof_connector.router.proxy import make_app
from pof_connector.router.router_config import RouterConfig
from pof_connector.router.serve import build
from tests.router.test_proxy import StandInEngine, router_config

ROUTER_KEY = "router-key-Zq81"
BACKEND_KEY = "backend-key-Vx42"


@pytest.fixture
def locked_engines() -> Iterator[dict[str, StandInEngine]]:
    """Two stand-ins for vLLM servers started with ``--api-key BACKEND_KEY``."""
    es = {n: StandInEngine(n, api_key=BACKEND_KEY).start() for n in ("a", "b")}
    yield es
    for e in es.values():
        e.stop()


def test_router_requires_its_key_and_sends_the_backends_key(locked_engines: dict[str, StandInEngine],
                                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POF_TEST_ROUTER_KEY", ROUTER_KEY)
    (tmp_path / "backend.key").write_text(BACKEND_KEY + "\n")
    config = router_config(locked_engines, policy="least_loaded", api_key_env="POF_TEST_ROUTER_KEY",
                           backend_api_key_file=str(tmp_path / "backend.key"))
    assert ROUTER_KEY not in repr(config) and BACKEND_KEY not in repr(config)
    router, _ = build(config)
    with TestClient(make_app(router)) as client:
        body = {"model": "m", "prompt": "hello", "max_tokens": 4}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": ROUTER_KEY}):
            for path in ("/v1/completions", "/tokenize", "/pof/backends", "/v1/models"):
                get = path in ("/pof/backends", "/v1/models")
                r = client.get(path, headers=headers) if get else client.post(path, json=body, headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
                assert r.json()["error"]["type"] == "authentication_error"
                assert r.headers["www-authenticate"] == "Bearer"
                assert ROUTER_KEY not in r.text
        assert client.get("/health").status_code == 200          # probes and scrapers stay open, as in vLLM
        assert client.get("/metrics").status_code == 200
        auth = {"Authorization": f"Bearer {ROUTER_KEY}"}
        r = client.post("/v1/completions", json=body, headers=auth)         # text: tokenized by a backend first
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].startswith(r.headers["x-pof-backend"])
        assert client.post("/tokenize", json=body, headers=auth).status_code == 200
        assert client.get("/v1/models", headers=auth).status_code == 404      # the stand-ins' answer: no such path
    seen = [h for e in locked_engines.values() for h in e.authorizations]
    assert seen and set(seen) == {f"Bearer {BACKEND_KEY}"}                # the router's key never reaches them


def test_without_a_backend_key_the_clients_header_is_passed_on(locked_engines: dict[str, StandInEngine]) -> None:
    router, _ = build(router_config(locked_engines, policy="round_robin"))
    with TestClient(make_app(router)) as client:
        r = client.post("/v1/completions", json={"prompt": [1, 2]}, headers={"Authorization": f"Bearer {BACKEND_KEY}"})
        assert r.status_code == 200
        assert client.post("/v1/completions", json={"prompt": [1, 2]}).status_code == 401   # the backend's 401


@pytest.mark.parametrize("extra,key", [
    ({"api_key_env": "POF_TEST_UNSET_VAR"}, "api_key_env"),
    ({"api_key_file": "/nonexistent/key"}, "api_key_file"),
    ({"backend_api_key_env": "POF_TEST_UNSET_VAR"}, "backend_api_key_env"),
    ({"api_key_env": "HOME", "api_key_file": "/etc/hostname"}, "api_key_env, api_key_file"),
    ({"index_url": "rediss://pof@h:1/0", "index_password_env": "POF_TEST_UNSET_VAR"}, "index_password_env"),
    ({"index_url": "rediss://pof@h:1/0", "index_tls_ca_file": "/nonexistent/ca"}, "index_tls_ca_file"),
])
def test_router_secrets_are_checked_at_start_up(extra: dict[str, object], key: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POF_TEST_UNSET_VAR", raising=False)
    with pytest.raises(ConfigError, match=key) as e:
        RouterConfig.from_mapping({"backends": [{"name": "a", "url": "http://127.0.0.1:1"}], **extra})
    assert "Value error" not in str(e.value) and "allowed keys" not in str(e.value)
