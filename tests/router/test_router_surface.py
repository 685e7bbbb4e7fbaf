"""What `pof router` tells the client and the bench: local tokenization (and its fallback), its own
overhead, the KV-capacity choice and its reason, in headers and /metrics; the fit learns only from
streamed first tokens, corrected by the cached tokens the engine reports. Real pool nodes and a real
Redis-protocol index; the engines are the stand-ins of test_proxy.py (their /metrics serve vLLM's
metric names)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from pof_connector.config import ConfigError
from pof_connector.index.server import RedisServer
from pof_connector.router.cost_model import CostModel, Estimate
from pof_connector.router.proxy import make_app
from pof_connector.router.serve import build
from tests.locality.test_api import node
from tests.locality.test_engine_load import VLLM
from tests.router.test_proxy import StandInEngine, router_config

SEG = [np.zeros(512, np.uint8)] * 2
PREFIX = list(range(7000, 7000 + 16 * 8))


def vllm_metrics(usage: float, waiting: int, preemptions: int, blocks: int = 64, block: int = 16) -> str:
    """vLLM 0.32's /metrics (names as in vllm/v1/metrics/loggers.py) for one engine."""
    return VLLM.replace('vllm:num_requests_waiting{engine="0",model_name="m"} 5.0',
                        f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}.0') + (
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {usage}\n'
        "# TYPE vllm:num_preemptions_total counter\n"
        f'vllm:num_preemptions_total{{engine="0",model_name="m"}} {preemptions}.0\n'
        "# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{block_size="{block}",engine="0",num_gpu_blocks="{blocks}"}} 1.0\n')


@pytest.fixture
def engines() -> Iterator[dict[str, StandInEngine]]:
    es = {n: StandInEngine(n).start() for n in ("a", "b")}
    yield es
    for e in es.values():
        e.stop()


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    """A model directory with a real (tiny) byte-level BPE tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["hello world, the quick brown fox"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def wait_for(check: Any, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_text_prompts_are_tokenized_locally_with_the_backends_model(
        engines: dict[str, StandInEngine], tokenizer_dir: Path) -> None:
    for e in engines.values():
        e.model_root = str(tokenizer_dir)
    router, _ = build(router_config(engines, policy="least_loaded"))
    with TestClient(make_app(router)) as client:
        wait_for(lambda: client.get("/pof/backends").json()["tokenizer"].startswith("local:"), "no local tokenizer")
        r = client.post("/v1/completions", json={"model": "m", "prompt": "hello world", "max_tokens": 4})
        assert r.status_code == 200 and r.headers["x-pof-tokens"] == "local"
        assert 0 <= float(r.headers["x-pof-router-overhead"]) < 1.0
        ids = client.post("/v1/completions", json={"prompt": [1, 2, 3]})
        assert ids.headers["x-pof-tokens"] == "request"
        assert sum(e.tokenized for e in engines.values()) == 0           # no /tokenize round trip
        text = client.get("/metrics").text
        assert "pof_router_overhead_seconds_count 2.0" in text
        assert 'pof_router_prompt_tokens_from_total{source="local"} 1.0' in text


def test_without_a_local_tokenizer_the_backend_tokenizes_and_the_log_says_so_once(
        engines: dict[str, StandInEngine], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for e in engines.values():
        e.model_root = str(tmp_path / "on-another-host")
    router, _ = build(router_config(engines, policy="least_loaded"))
    with caplog.at_level(logging.INFO, logger="pof.router"), TestClient(make_app(router)) as client:
        wait_for(lambda: "no local tokenizer" in caplog.text, "no fallback line")
        for _ in range(3):
            r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
            assert r.headers["x-pof-tokens"] == "backend"
        time.sleep(0.3)                               # several health rounds: no second line
        assert caplog.text.count("no local tokenizer") == 1
        assert client.get("/pof/backends").json()["tokenizer"] == "backend"
    assert sum(e.tokenized for e in engines.values()) == 3


def test_tokenizer_setting_backend_or_a_path(engines: dict[str, StandInEngine], tokenizer_dir: Path) -> None:
    for e in engines.values():
        e.model_root = str(tokenizer_dir)
    router, _ = build(router_config(engines, policy="least_loaded", tokenizer="backend"))
    with TestClient(make_app(router)) as client:
        time.sleep(0.3)
        assert client.get("/pof/backends").json()["tokenizer"] == "backend"
        assert client.post("/v1/completions", json={"prompt": "hi"}).headers["x-pof-tokens"] == "backend"
    router, _ = build(router_config(engines, policy="least_loaded", tokenizer=str(tokenizer_dir)))
    with TestClient(make_app(router)) as client:
        assert client.post("/v1/completions", json={"prompt": "hi"}).headers["x-pof-tokens"] == "local"
    router, _ = build(router_config(engines, tokenizer=str(tokenizer_dir / "nothing")))
    with pytest.raises(ConfigError, match="tokenizer: cannot load"):
        make_app(router)


def test_saturated_holder_is_passed_over_and_the_answer_says_why(
        engines: dict[str, StandInEngine], redis_server: RedisServer, runtime_dir: str, shm_path: str) -> None:
    cxl = {"path": shm_path, "size": "1MiB", "partitions": 2}
    a = node("a", redis_server.url, runtime_dir, cxl=cxl)
    b = node("b", redis_server.url, runtime_dir, cxl=cxl)
    try:
        a.store([(k, SEG) for k in a.keys_for(PREFIX)]).result()
        engines["a"].metrics_text = vllm_metrics(0.2, 0, 0)
        engines["b"].metrics_text = vllm_metrics(0.2, 0, 0)
        router, index = build(router_config(engines, index_url=redis_server.url,
                                            capacity={"metrics_interval_s": 0.05}))
        with TestClient(make_app(router)) as client:
            def post() -> Any:
                return client.post("/v1/completions", json={"prompt": [*PREFIX, 1, 2], "max_tokens": 30})
            wait_for(lambda: post().headers.get("x-pof-route-reason") == "prefix-holder", "a never held the prefix")
            r = post()
            assert r.headers["x-pof-backend"] == "a" and r.headers["x-pof-kv-need-blocks"] == "10"
            assert r.headers["x-pof-kv-free-blocks"] == str(int(0.8 * 64))
            assert "x-pof-saturated" not in r.headers
            engines["a"].metrics_text = vllm_metrics(0.97, 3, 5)      # a fills up and queues
            wait_for(lambda: post().headers["x-pof-backend"] == "b", "the full holder kept its requests")
            r = post()
            assert (r.headers["x-pof-backend"], r.headers["x-pof-route-reason"], r.headers["x-pof-saturated"]) == \
                ("b", "holder-saturated:pool", "a")
            assert r.headers["x-pof-reason"] == "pof"
            text = client.get("/metrics").text
            assert 'pof_router_routes_total{backend="b",route_reason="holder-saturated:pool"}' in text
            assert 'pof_router_engine{backend="a",quantity="kv_usage"} 0.97' in text
            assert 'pof_router_engine{backend="a",quantity="preemptions"} 5.0' in text
            state = client.get("/pof/backends").json()["backends"][0]
            assert state["engine"]["kv_usage"] == 0.97 and state["engine"]["kv_capacity_tokens"] == 64 * 16
        assert index is not None
        index.close()
    finally:
        a.close()
        b.close()


def test_the_fit_learns_from_streamed_first_tokens_with_the_engines_cached_count(
        engines: dict[str, StandInEngine], redis_server: RedisServer, runtime_dir: str) -> None:
    a = node("a", redis_server.url, runtime_dir)
    try:
        engines["a"].cached_tokens = 96
        router, index = build(router_config({"a": engines["a"]}, index_url=redis_server.url))
        seen: list[tuple[Estimate, float, int | None]] = []
        plain = CostModel.observe

        def spy(est: Estimate, ttft_s: float, cached_tokens: int | None = None) -> None:
            seen.append((est, ttft_s, cached_tokens))
            plain(router.cost, est, ttft_s, cached_tokens)
        router.cost.observe = spy  # type: ignore[method-assign]
        with TestClient(make_app(router)) as client:
            body = {"prompt": list(range(128)), "max_tokens": 4}
            client.post("/v1/completions", json=body)                               # not streamed: no TTFT
            # no usage asked: the router sent this backend the whole prompt before, so it counts it cached
            client.post("/v1/completions", json={**body, "stream": True})
            client.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
            client.post("/v1/completions", json={**body, "prompt": list(range(500, 600)), "stream": True})
        assert [c for _, _, c in seen] == [128, 96, 0]                # the engine's own count wins
        assert router.cost.observed == 3
        est = seen[1][0]
        assert est.recompute_tokens == 128 and est.corrected(96)[1] == pytest.approx(0.032)
        assert index is not None
        index.close()
    finally:
        a.close()


def test_sent_prefixes_count_leading_chunks_per_backend() -> None:
    from pof_connector.router.sent_prefixes import SentPrefixes

    sent = SentPrefixes(chunk_tokens=16, max_chunks=8)
    p = list(range(100))
    assert sent.cached_then_record("a", p) == 0
    assert sent.cached_then_record("a", [*p, 1, 2]) == 96          # whole chunks only
    assert sent.cached_then_record("b", p) == 0                     # per backend
    assert sent.cached_then_record("a", [7, *p]) == 0               # a prefix, not any substring
    assert sent.cached_then_record("a", list(range(1000, 1200))) == 0
    assert sent.cached_then_record("a", p) == 0                     # forgotten: at most 8 chunks kept
