"""The locality API over a real Redis-protocol index (one server, or a Redis Cluster) and real pool nodes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from pof_connector.config import PofConfig
from pof_connector.index import redis_index
from pof_connector.index.redis import RedisIndex
from pof_connector.index.server import RedisServer
from pof_connector.locality.api import make_app
from pof_connector.pages.keys import Namespace
from pof_connector.pages.layout import PageSpec
from pof_connector.pool import Pool

SPEC = PageSpec(num_layers=2, segment_bytes=512, page_tokens=16)
NS = Namespace("org/model-a", "bfloat16", "mha", SPEC).digest


def node(name: str, url: str, runtime_dir: str, **tiers: Any) -> Pool:
    cfg = PofConfig.from_mapping({"node_id": name, "index_url": url, "runtime_dir": runtime_dir, "heartbeat_s": 0.1,
                                  "node_ttl_s": 5.0, "tiers": tiers or {"cpu_dram": {"size": "1MiB"}}})
    return Pool(cfg, SPEC, NS, meta={"engine": "test", "model": "org/model-a"})


@pytest.fixture(params=["redis_server", "redis_cluster"])
def index_url(request: pytest.FixtureRequest) -> str:
    """One Redis-protocol server, or a Redis Cluster of 3 masters + 3 replicas."""
    url: str = request.getfixturevalue(request.param).url
    return url


@pytest.fixture
def cluster(index_url: str, runtime_dir: str, shm_path: str) -> Iterator[dict[str, Any]]:
    a = node("a", index_url, runtime_dir)
    b = node("b", index_url, runtime_dir, cxl={"path": shm_path, "size": "1MiB", "partitions": 2})
    tokens = list(range(1000, 1000 + 16 * 6))
    keys = a.keys_for(tokens)
    seg = [np.zeros(512, np.uint8)] * 2
    a.store([(k, seg) for k in keys[:5]]).result()
    b.store([(k, seg) for k in keys[:2]]).result()
    a.store([(k, seg) for k in a.keys_for(tokens, cache_salt="t2")[:1]]).result()
    deadline = time.monotonic() + 5
    reader = redis_index(index_url, None)
    while len(reader.longest_prefix(keys)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    yield {"tokens": tokens, "index": reader}
    for p in (a, b):
        p.close()
    reader.close()


def test_locality_per_node_and_tier(cluster: dict[str, Any]) -> None:
    client = TestClient(make_app(cluster["index"]))
    r = client.post("/v1/locality", json={"model": "org/model-a", "tokens": cluster["tokens"] + [1, 2, 3]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["page_tokens"] == 16 and body["prompt_tokens"] == 99
    nodes = {n["node_id"]: n for n in body["nodes"]}
    assert [n["node_id"] for n in body["nodes"]] == ["a", "b"]                # longest first
    assert nodes["a"]["matched_tokens"] == 80 and nodes["a"]["tiers"] == {"cpu_dram": 80}
    assert nodes["b"]["matched_tokens"] == 32 and nodes["b"]["tiers"] == {"cxl": 32}
    assert nodes["b"]["free_bytes"]["cxl"] > 0 and nodes["a"]["meta"]["engine"] == "test"
    salted = client.post("/v1/locality", json={"tokens": cluster["tokens"], "cache_salt": "t2"}).json()
    assert [(n["node_id"], n["matched_tokens"]) for n in salted["nodes"]] == [("a", 16)]   # model is implied
    assert client.get("/v1/nodes").json()[0]["tiers"]
    assert client.get("/healthz").json() == {"ok": True, "nodes": 2}
    assert "pof_api_requests_total" in client.get("/metrics").text
    assert "/v1/locality" in client.get("/openapi.json").json()["paths"]


@pytest.mark.parametrize("body,status,words", [
    ({"model": "org/model-a"}, 422, "exactly one of"),
    ({"model": "org/model-a", "tokens": [1], "text": "x"}, 422, "exactly one of"),
    ({"model": "org/model-a", "tokens": [-1]}, 422, "token ids"),
    ({"model": "org/model-a", "tokens": ["a"]}, 422, "tokens"),
    ({"model": "nope", "tokens": [1, 2]}, 404, "org/model-a"),
    ({"model": "org/model-a", "text": "hello"}, 422, "--tokenizer"),
])
def test_bad_queries_get_4xx_with_a_message(cluster: dict[str, Any], body: dict[str, Any], status: int,
                                            words: str) -> None:
    r = TestClient(make_app(cluster["index"])).post("/v1/locality", json=body)
    assert r.status_code == status and words in r.text, r.text


def test_bad_json_and_oversize(cluster: dict[str, Any]) -> None:
    client = TestClient(make_app(cluster["index"]))
    r = client.post("/v1/locality", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422
    r = client.post("/v1/locality", json={"tokens": [1] * ((1 << 20) + 1)})
    assert r.status_code == 422 and "at most" in r.text


def test_a_huge_bad_query_gets_a_short_answer(cluster: dict[str, Any]) -> None:
    """Issue 19: the 422 for a 50 MB body echoed the whole input (52 MB; 4 MB for 2M token ids)."""
    client = TestClient(make_app(cluster["index"]))
    r = client.post("/v1/locality", json={"tokens": ["x"] * 200_000})
    assert r.status_code == 422 and len(r.content) < 4096, len(r.content)
    assert "more errors" in r.text and '"x"' not in r.text
    r = client.post("/v1/locality", json={"text": "y" * (9 << 20)})
    assert r.status_code == 422 and len(r.content) < 4096 and "yyyy" not in r.text
    r = client.post("/v1/locality", content=b"z" * (17 << 20), headers={"content-type": "application/json"})
    assert r.status_code == 413 and len(r.content) < 4096
    assert client.post("/v1/locality", json={"tokens": cluster["tokens"]}).status_code == 200    # still serving


def test_text_with_a_tokenizer_and_a_bearer_token(cluster: dict[str, Any]) -> None:
    words = {"alpha": cluster["tokens"][:48]}
    app = make_app(cluster["index"], token="s3cret", tokenizers={"org/model-a": lambda text: words[text]})
    client = TestClient(app)
    assert client.post("/v1/locality", json={"text": "alpha"}).status_code == 401
    r = client.post("/v1/locality", json={"text": "alpha"}, headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200 and r.json()["nodes"][0]["matched_tokens"] == 48
    assert client.get("/healthz").status_code == 200           # probes need no token


def test_index_down_is_503(runtime_dir: str) -> None:
    client = TestClient(make_app(RedisIndex(f"unix://{runtime_dir}/none.sock", None, timeout_s=0.2)))
    assert client.get("/healthz").status_code == 503
    assert client.post("/v1/locality", json={"model": "m", "tokens": [1]}).status_code == 503


def test_index_lost_and_back_is_logged_once_each_and_exported(redis_server: RedisServer,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    reader = RedisIndex(redis_server.url, None, timeout_s=0.5)
    client = TestClient(make_app(reader))
    with caplog.at_level("WARNING", logger="pof.api"):
        assert client.get("/healthz").status_code == 200
        redis_server.stop()
        for _ in range(3):
            r = client.post("/v1/locality", json={"model": "m", "tokens": [1]})
            assert r.status_code == 503 and r.headers["x-pof-reason"] == "fallback:IndexUnavailable"
        metrics = client.get("/metrics").text
        assert "pof_index_available 0.0" in metrics and 'pof_index_lost_total{reason="IndexUnavailable"} 1.0' in metrics
        redis_server.start()
        assert client.get("/healthz").status_code == 200
        assert "pof_index_available 1.0" in client.get("/metrics").text
    lines = [r.getMessage() for r in caplog.records if r.name == "pof.api"]
    assert len(lines) == 2 and "without the locality index" in lines[0] and "answers again" in lines[1], lines
    reader.close()


def test_a_body_without_a_length_is_bounded_too(cluster: dict[str, Any]) -> None:
    """A chunked body declares no Content-Length: it was read whole (17 MiB here, any size in
    general) before being refused; now it is refused once 16 MiB arrived."""
    client = TestClient(make_app(cluster["index"]))
    r = client.post("/v1/locality", content=iter([b"z" * (1 << 20)] * 17), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "over 16777216 bytes" in r.json()["detail"], r.text
    assert client.post("/v1/locality", json={"tokens": cluster["tokens"]}).status_code == 200
