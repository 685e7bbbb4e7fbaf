"""Issue 19: secrets never appear in logs, ``pof stats``, metrics, responses or error messages.

One distinctive secret in every place a secret goes (the index ACL user's password, from an
environment variable; a wrong password; the router's API key; the locality API's token), then
start-up, an authentication failure, ``pof stats``, ``/metrics`` and the APIs' answers; none of
what they print, log or answer holds any of the secrets. The index is a real Redis 7 server with
TLS and an ACL user (tests/tls_redis.py)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest

from pof_connector.bench.vllm_server import free_port
from pof_connector.cli import main
from pof_connector.config import PofConfig
from pof_connector.index.cli import _api_token
from pof_connector.metrics import register_prometheus
from pof_connector.pool import Pool
from pof_connector.router.proxy import make_app
from pof_connector.router.serve import build
from tests.conftest import TLS_PASSWORD
from tests.locality.test_api import NS, SPEC
from tests.router.test_proxy import StandInEngine, router_config
from tests.tls_redis import TlsRedis

WRONG_PASSWORD = "pof-WRONG-pw-5c7d"
ROUTER_KEY = "pof-router-SECRET-4d2a"
API_TOKEN = "pof-api-SECRET-8e1b"
SECRETS = (TLS_PASSWORD, WRONG_PASSWORD, ROUTER_KEY, API_TOKEN)
SEG = [np.zeros(512, np.uint8)] * 2


def _get(url: str, token: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _locality_api(config: Path, seen: list[str]) -> None:
    """`pof index api --config FILE --token-env NAME`: 401 without the token, answers with it."""
    port = free_port()
    argv = [sys.executable, "-m", "pof_connector.cli", "index", "api", "--config", str(config),
            "--token-env", "POF_T_API_TOKEN", "--http-port", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if _get(base + "/healthz")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        for token in (None, "wrong", TLS_PASSWORD):
            status, body = _get(base + "/v1/nodes", token)
            assert status == 401
            seen.append(body)
        status, body = _get(base + "/v1/nodes", API_TOKEN)
        assert status == 200 and "n1" in body
        seen.append(body)
        status, body = _get(base + "/metrics", API_TOKEN)
        assert status == 200
        seen.append(body)
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=15)
        seen += [out, err, " ".join(argv)]


def _router(engines: dict[str, StandInEngine], url: str, ca: str, seen: list[str]) -> None:
    config = router_config(engines, index_url=url, index_password_env="POF_T_INDEX_PW", index_tls_ca_file=ca,
                           api_key_env="POF_T_ROUTER_KEY")
    router, index = build(config)
    try:
        with TestClient(make_app(router)) as client:
            for headers in ({}, {"Authorization": f"Bearer {API_TOKEN}"}):
                r = client.post("/v1/completions", json={"prompt": [1, 2, 3]}, headers=headers)
                assert r.status_code == 401
                seen.append(r.text + json.dumps(dict(r.headers)))
            auth = {"Authorization": f"Bearer {ROUTER_KEY}"}
            r = client.post("/v1/completions", json={"prompt": list(range(40))}, headers=auth)
            assert r.status_code == 200 and r.headers["x-pof-reason"] == "pof"     # the TLS index answered
            seen += [r.text, json.dumps(dict(r.headers)), client.get("/metrics").text,
                     client.get("/pof/backends", headers=auth).text, client.get("/health").text,
                     repr(config), config.model_dump_json()]
    finally:
        if index is not None:
            index.close()


def test_no_secret_shows_in_logs_stats_metrics_answers_or_errors(
        tls_redis: TlsRedis, runtime_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("POF_T_INDEX_PW", TLS_PASSWORD)
    monkeypatch.setenv("POF_T_ROUTER_KEY", ROUTER_KEY)
    monkeypatch.setenv("POF_T_API_TOKEN", API_TOKEN)
    ca = str(tls_redis.certs.ca)
    raw = {"node_id": "n1", "index_url": tls_redis.url, "runtime_dir": runtime_dir, "heartbeat_s": 0.1,
           "node_ttl_s": 30.0, "index_timeout_s": 2.0, "tiers": {"cpu_dram": {"size": "1MiB"}},
           "index_password_env": "POF_T_INDEX_PW", "index_tls_ca_file": ca}
    config_file = tmp_path / "pof.yaml"
    config_file.write_text(yaml.safe_dump(raw))
    seen: list[str] = []
    pool = Pool(PofConfig.from_file(config_file), SPEC, NS, meta={"model": "m"})          # start-up
    engines = {n: StandInEngine(n).start() for n in ("n1",)}
    try:
        pool.store([(k, SEG) for k in pool.keys_for(list(range(40)))]).result()
        pool.flush()
        pool.heartbeat()
        registry = CollectorRegistry()
        register_prometheus(pool.stats, registry)
        seen += [repr(pool.config), json.dumps(pool.config.to_mapping()), generate_latest(registry).decode()]
        assert main(["stats", "--config", str(config_file)]) == 0
        assert main(["stats", "--config", str(config_file), "--json"]) == 0
        assert "n1" in capsys.readouterr().out
        _locality_api(config_file, seen)
        _router(engines, tls_redis.url, ca, seen)

        monkeypatch.setenv("POF_T_INDEX_PW", WRONG_PASSWORD)                              # an auth failure
        assert main(["stats", "--config", str(config_file)]) == 1
        wrong = Pool(PofConfig.from_mapping({**raw, "node_id": "n2"}), SPEC, NS)
        try:
            wrong.heartbeat()
            assert wrong.lookup(wrong.keys_for(list(range(200, 240)))).pages == 0
        finally:
            wrong.close()
        registry = CollectorRegistry()
        register_prometheus(wrong.stats, registry)
        seen.append(generate_latest(registry).decode())
    finally:
        pool.close()
        for e in engines.values():
            e.stop()
    out = capsys.readouterr()
    assert "invalid username-password" in out.err + caplog.text       # the failure is told, without the secret
    seen += [out.out, out.err, caplog.text]
    seen += [f"{r.getMessage()} {r.args} {r.exc_info} {r.exc_text}" for r in caplog.records]
    everything = "\n".join(seen)
    for secret in SECRETS:
        assert secret not in everything


def test_api_token_from_a_file_and_a_warning_for_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "token").write_text(API_TOKEN + "\n")
    ns = argparse.Namespace(token=None, token_env=None, token_file=str(tmp_path / "token"))
    assert _api_token(ns) == API_TOKEN
    assert _api_token(argparse.Namespace(token=API_TOKEN, token_env=None, token_file=None)) == API_TOKEN
    err = capsys.readouterr().err
    assert "--token shows in `ps`" in err and API_TOKEN not in err


def test_a_missing_token_variable_stops_serve_before_it_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("POF_T_UNSET_TOKEN", raising=False)
    rt = tmp_path / "rt"
    assert main(["index", "serve", "--runtime-dir", str(rt), "--token-env", "POF_T_UNSET_TOKEN"]) == 1
    assert "token_env: the environment variable 'POF_T_UNSET_TOKEN' is not set" in capsys.readouterr().err
    assert not (rt / "embedded.lock").exists()                 # no server was started
