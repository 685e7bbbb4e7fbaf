"""The router's own time by stage (header x-pof-router-stages, histogram pof_router_stage_seconds),
the exact prefix-cached tokenizer, and `pof bench router-overhead` running (no timing is asserted:
benches measure, tests check)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from fastapi.testclient import TestClient

from pof_connector.bench.vllm_server import build_model
from pof_connector.locality.locator import hf_tokenizer
from pof_connector.router.prefix_tokenizer import PrefixTokenizer
from pof_connector.router.proxy import make_app
from pof_connector.router.serve import build
from pof_connector.router.stage_clock import STAGES
from tests.router.test_proxy import StandInEngine, engines, router_config  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[2]


def test_stages_add_up_to_the_overhead(engines: dict[str, StandInEngine]) -> None:  # noqa: F811
    router, _ = build(router_config(engines, policy="least_loaded"))
    with TestClient(make_app(router)) as client:
        for _ in range(3):
            r = client.post("/v1/completions", json={"model": "m", "prompt": list(range(200)), "max_tokens": 4})
            assert r.status_code == 200
            stages = dict(p.split("=") for p in r.headers["x-pof-router-stages"].split(","))
            assert tuple(stages) == STAGES
            seconds = {k: float(v) for k, v in stages.items()}
            assert all(v >= 0 for v in seconds.values())
            # each printed to the microsecond: the sum is the total within their rounding
            assert abs(sum(seconds.values()) - float(r.headers["x-pof-router-overhead"])) <= 5e-6 * (len(STAGES) + 1)
        page = client.get("/metrics").text
    for stage in STAGES:
        assert f'pof_router_stage_seconds_count{{stage="{stage}"}} 3.0' in page
    assert "pof_router_overhead_seconds_count 3.0" in page
    assert 'pof_router_choices_total{ran="inline"} 3.0' in page       # fast choices: on the event loop
    assert 'pof_router_choices_total{ran="thread"} 0.0' in page


def test_prefix_tokenizer_is_exact() -> None:
    tok = hf_tokenizer(str(build_model("tiny", tokenizer_only=True)))     # the core venv has no torch
    cached = PrefixTokenizer(tok, block_chars=64)
    assert cached.cached
    rnd = random.Random(3)
    pieces = ["a", "b", "é", "1", " ", "  ", "\n", "\t", ".", "'s", "<|bos|>", "<|eos|>", "中", "😀", "_", "\u00a0"]
    shared = "".join(rnd.choice(pieces) for _ in range(400))
    for i in range(300):
        text = (shared if i % 2 else "") + "".join(rnd.choice(pieces) for _ in range(rnd.randrange(0, 300)))
        if i % 3:
            cached.uncached_chars(text)        # as the router asks first (the call reuses what it found)
        assert cached(text) == tok.encode(text, add_special_tokens=True).ids, text
    words = " ".join(rnd.choice(["alpha", "beta", "gamma"]) for _ in range(100))
    assert cached(words + " one") == tok.encode(words + " one", add_special_tokens=True).ids
    assert cached.uncached_chars(words + " two") < 64          # its leading text was kept


def test_bench_router_overhead_runs(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "pof_connector.cli", "bench", "router-overhead", "--json",
                          "--requests", "50", "--backends", "2", "--concurrency", "2", "--paced-requests", "6",
                          "--paced-rate", "20"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert set(result["runs"]) == {"text", "ids", "chat", "text_c2", "text_direct", "text_paced_20_per_s"}
    assert result["runs"]["text_paced_20_per_s"]["requests"] == 6
    text = result["runs"]["text"]
    assert set(text["stages_s"]) == set(STAGES) and {"p50", "p99"} <= set(text["overhead_s"])
    assert text["routes"].get("prefix-holder", 0) > 0        # the lookup found the pages the pool nodes hold
    # chat requests too: the router rendered and tokenized them as the pool nodes' chat pages were
    # (the stand-ins have no /tokenize to ask)
    chat = result["runs"]["chat"]
    assert set(chat["stages_s"]) == set(STAGES) and chat["routes"].get("prefix-holder", 0) == chat["requests"]
    assert {"p50", "p99"} <= set(result["index_ping_s"]) and "proxy_hop_p50_s" in result
