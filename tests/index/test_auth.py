"""The index over TLS with a Redis ACL user, its password read from an environment variable or
a file: against a real Redis 7 server with TLS (tests/tls_redis.py), never skipped."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from pof_connector.cli import main
from pof_connector.config import ConfigError, PofConfig
from pof_connector.index import IndexUnavailable, open_index
from pof_connector.pool import Pool
from tests.conftest import TLS_PASSWORD
from tests.locality.test_api import NS, SPEC
from tests.tls_redis import TlsRedis

SEG = [np.zeros(512, np.uint8)] * 2


def pool_config(name: str, runtime_dir: str, url: str, **auth: Any) -> PofConfig:
    return PofConfig.from_mapping({"node_id": name, "index_url": url, "runtime_dir": runtime_dir,
                                   "heartbeat_s": 0.1, "node_ttl_s": 5.0, "index_timeout_s": 2.0,
                                   "tiers": {"cpu_dram": {"size": "1MiB"}}, **auth})


def no_secret(text: str) -> None:
    assert TLS_PASSWORD not in text


@pytest.mark.parametrize("source", ["env", "file"])
def test_pool_works_over_tls_as_an_acl_user(tls_redis: TlsRedis, runtime_dir: str, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    if source == "env":
        monkeypatch.setenv("POF_TEST_INDEX_PASSWORD", TLS_PASSWORD)
        auth = {"index_password_env": "POF_TEST_INDEX_PASSWORD"}
    else:
        (tmp_path / "pw").write_text(TLS_PASSWORD + "\n")      # the trailing newline is stripped
        auth = {"index_password_file": str(tmp_path / "pw")}
    auth["index_tls_ca_file"] = str(tls_redis.certs.ca)
    a = Pool(pool_config("a", runtime_dir, tls_redis.url, **auth), SPEC, NS, meta={"model": "m"})
    b = Pool(pool_config("b", runtime_dir, tls_redis.url, **auth), SPEC, NS, meta={"model": "m"})
    try:
        keys = a.keys_for(list(range(16 * 4)))
        a.store([(k, SEG) for k in keys]).result()
        a.flush()
        deadline = time.monotonic() + 5
        while b.lookup(keys).elsewhere.get("a") != 4:      # b sees a's pages through the index
            assert time.monotonic() < deadline, "b never saw a's pages through the TLS index"
            time.sleep(0.05)
        assert a.config.to_mapping()["index_tls_ca_file"] == str(tls_redis.certs.ca)
        assert TLS_PASSWORD not in repr(a.config) + str(a.config.to_mapping())
    finally:
        a.close()
        b.close()


def test_wrong_password_or_no_ca_means_misses_and_no_secret_shown(
        tls_redis: TlsRedis, runtime_dir: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("POF_TEST_INDEX_PASSWORD", TLS_PASSWORD + "-wrong")
    wrong = pool_config("a", runtime_dir, tls_redis.url, index_password_env="POF_TEST_INDEX_PASSWORD",
                        index_tls_ca_file=str(tls_redis.certs.ca))
    with pytest.raises(IndexUnavailable, match="invalid username-password") as e:
        open_index(wrong, None).nodes()
    assert TLS_PASSWORD not in str(e.value)
    monkeypatch.setenv("POF_TEST_INDEX_PASSWORD", TLS_PASSWORD)
    no_ca = pool_config("b", runtime_dir, tls_redis.url, index_password_env="POF_TEST_INDEX_PASSWORD")
    with pytest.raises(IndexUnavailable, match="CERTIFICATE_VERIFY_FAILED") as e:
        open_index(no_ca, None).nodes()
    assert TLS_PASSWORD not in str(e.value)
    for config in (wrong, no_ca):               # a pool that cannot reach its index misses, never fails
        pool = Pool(config, SPEC, NS, meta={"model": "m"})
        try:
            keys = pool.keys_for(list(range(32)))
            pool.store([(k, SEG) for k in keys]).result()
            pool.flush()
            pool.heartbeat()
            assert pool.lookup(pool.keys_for(list(range(100, 132)))).pages == 0
        finally:
            pool.close()
    assert caplog.records, "the failing index was not logged"
    no_secret("\n".join(r.getMessage() + str(r.exc_info) + str(r.args) for r in caplog.records))
    no_secret(caplog.text)


@pytest.mark.parametrize("extra,key", [
    ({"index_password_env": "POF_TEST_UNSET_VAR"}, "index_password_env"),
    ({"index_password_file": "/nonexistent/pw"}, "index_password_file"),
    ({"index_tls_ca_file": "/nonexistent/ca.crt"}, "index_tls_ca_file"),
    ({"index_tls_cert_file": "/etc/hostname"}, "index_tls_key_file"),
    ({"index_username": "pof"}, "index_username"),                  # the URL names one already
    ({"index_url": "redis://pof:" + TLS_PASSWORD + "@h:1/0", "index_password_file": "/etc/hostname"},
     "index_password_env / index_password_file"),
    ({"index_url": "embedded", "index_password_env": "HOME"}, "index_password_env"),
    ({"index_url": "redis://h:1/0", "index_tls_ca_file": "/etc/hostname"}, "rediss://"),
])
def test_credentials_are_checked_at_start_up(extra: dict[str, Any], key: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POF_TEST_UNSET_VAR", raising=False)
    raw = {"index_url": "rediss://pof@localhost:6380/0", **extra}
    with pytest.raises(ConfigError, match=key.replace("/", ".")) as e:
        PofConfig.from_mapping(raw)
    assert "unknown" not in str(e.value)
    no_secret(str(e.value))


def test_an_empty_password_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("\n")
    with pytest.raises(ConfigError, match=r"index_password_file.*empty"):
        PofConfig.from_mapping({"index_url": "redis://localhost:6379/0", "index_password_file": str(tmp_path / "pw")})


def test_bench_index_on_a_tls_server_with_credentials(tls_redis: TlsRedis, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("POF_TEST_INDEX_PASSWORD", TLS_PASSWORD)
    config = tmp_path / "pof.yaml"
    config.write_text(yaml.safe_dump({"index_url": tls_redis.url, "index_password_env": "POF_TEST_INDEX_PASSWORD",
                                      "index_tls_ca_file": str(tls_redis.certs.ca)}))
    assert main(["bench", "index", "--json", "--config", str(config), "--pages", "40", "--iterations", "3",
                 "--memory-pages", "100"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["server"] == tls_redis.url
    no_secret(out.out + out.err)
