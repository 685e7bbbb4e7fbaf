"""What the pool does for a full node, on real vLLM CPU servers (issue 14, must-show 1).

* **Preemption costs a load, not a recompute.** A server whose KV cache cannot hold its running
  requests preempts one (vLLM v1 frees its blocks and puts it back in the waiting queue with no
  computed tokens); when it resumes, vLLM asks the connector again (``get_num_new_matched_tokens``)
  and the full pages it had computed, prompt *and* generated tokens, come back from the pool.
  vLLM 0.32 records a resumed request's connector hits as "preempted", outside
  ``vllm:external_prefix_cache_hits``, so pof's ``vllm:pof_loaded_pages`` counts them. The
  engine's own prefix cache is off, so nothing else can serve them.
* **Sessions move with their KV.** A conversation's first turn runs on server A; its second
  turn (the first turn's prompt, the model's answer, a new user turn) is sent to server B, whose
  pool loads the first turn's pages from the region both pools share: B's external-hit counter
  covers them.

Both compare greedy outputs with a reference server that has no connector and room for all.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from pof_connector.bench.chaos import UNPINNED
from pof_connector.bench.vllm_server import VllmServer, build_model, connector_config
from pof_connector.index.server import RedisServer
from tests.adapters.server_workdir import server_workdir
from tests.adapters.test_vllm import DTYPE

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 128
VOCAB = 1900
# float32: bf16 is emulated on these CPUs, and its coarser sums make near-tie greedy tokens flip
# between a batch of three and a request alone.
COMMON = ["--block-size", str(BLOCK), "--dtype", "float32"]


@pytest.fixture(scope="module")
def workdir(request: pytest.FixtureRequest) -> Iterator[Path]:
    yield from server_workdir(request, "pof-capacity-")


@pytest.fixture(scope="module")
def model() -> Path:
    return build_model("tiny")


@pytest.fixture(scope="module")
def reference(model: Path, workdir: Path) -> Iterator[VllmServer]:
    """No connector, KV for every request at once: never preempts, never loads."""
    server = VllmServer(model, workdir / "reference", max_model_len=2048, extra_args=COMMON, env=UNPINNED, dtype=DTYPE)
    try:
        yield server.start()
    finally:
        server.stop()


def complete(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return [int(t) for t in json.loads(r.read())["choices"][0]["token_ids"]]


def together(url: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    with ThreadPoolExecutor(len(prompts)) as ex:
        return list(ex.map(lambda p: complete(url, p, max_tokens), prompts))


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(3, VOCAB) for _ in range(length)] for _ in range(n)]


def test_a_preempted_request_resumes_from_the_pool(model: Path, workdir: Path, reference: VllmServer) -> None:
    # 10 blocks of 128 tokens; three requests that each grow to 300 + 420 tokens (6 blocks):
    # all three start, and as they decode the scheduler must preempt to let the others grow.
    pool: dict[str, Any] = {"node_id": "full", "index_url": "embedded", "runtime_dir": str(workdir / "rt-full"),
                            "tiers": {"cpu_dram": {"size": "256MiB"}}}
    server = VllmServer(model, workdir / "full", kv_transfer=connector_config(pool), max_model_len=1024, dtype=DTYPE,
                        extra_args=[*COMMON, "--num-gpu-blocks-override", "10", "--max-num-seqs", "3",
                                    "--no-enable-prefix-caching"], env=UNPINNED)
    jobs = prompts(seed=11, n=3, length=300)
    try:
        server.start()
        got = together(server.url, jobs, max_tokens=420)
        m = server.metrics()
        log = server.tail(100000)
    finally:
        server.stop()
    preemptions = m.get("vllm:num_preemptions_total", 0.0)
    assert preemptions >= 1, f"the server never preempted: {m}\n{log[-20000:]}"
    # vLLM leaves a resumed request's connector hits out of vllm:external_prefix_cache_hits
    # (it records them as "preempted"): pof's own counter shows the pages loaded. Nothing else
    # can load here: the prompts share no page and the engine's prefix cache is off.
    loaded_pages = m.get("vllm:pof_loaded_pages_total", 0.0)
    assert loaded_pages >= preemptions, f"{loaded_pages} pages loaded for {preemptions} preemptions\n{log[-20000:]}"
    # The connector's plan per resume (its log line): pages past the prompt (300 tokens, two
    # whole pages) hold generated tokens, so a resume that loads more than two pages had some.
    loaded = [int(w.split()[0]) for w in log.split("from the engine's prefix cache, ")[1:]]
    assert len(loaded) >= preemptions and max(loaded) > 2 * BLOCK, f"resumes loaded {loaded}\n{log[-20000:]}"
    want = together(reference.url, jobs, max_tokens=420)
    assert reference.metrics().get("vllm:num_preemptions_total", 0.0) == 0
    assert got == want


def test_a_session_continues_on_another_node_with_its_kv(model: Path, workdir: Path, reference: VllmServer) -> None:
    redis = RedisServer(workdir / "redis").start()
    region = Path(tempfile.mkdtemp(prefix="pof-capacity-", dir="/dev/shm")) / "shared.region"
    servers: dict[str, VllmServer] = {}
    try:
        for i, name in enumerate(("a", "b")):
            pool = {"node_id": name, "index_url": redis.url, "runtime_dir": str(workdir / f"rt-{name}"),
                    "tiers": {"cxl": {"path": str(region), "size": "256MiB", "partitions": 2, "partition": i}}}
            servers[name] = VllmServer(model, workdir / name, kv_transfer=connector_config(pool), dtype=DTYPE,
                                       max_model_len=2048, extra_args=COMMON, env=UNPINNED)
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda s: s.start(), servers.values()))
        system, turn1, turn2 = prompts(seed=5, n=3, length=400)
        first = system + turn1[:200]
        answer = complete(servers["a"].url, first, max_tokens=100)
        second = first + answer + turn2[:150]
        before = servers["b"].metrics().get("vllm:external_prefix_cache_hits_total", 0.0)
        time.sleep(2.0)        # A stores and publishes its pages a moment after it answers
        got = complete(servers["b"].url, second, max_tokens=32)
        hits = servers["b"].metrics().get("vllm:external_prefix_cache_hits_total", 0.0) - before
        # every full page of turn one (prompt and answer but its last token, whose KV A never
        # computed) came from A's pages in the shared region
        turn_one_pages = (len(first) + len(answer) - 1) // BLOCK
        assert hits >= turn_one_pages * BLOCK, (hits, turn_one_pages, servers["b"].tail(100))
        assert answer == complete(reference.url, first, max_tokens=100)
        assert got == complete(reference.url, second, max_tokens=32)
    finally:
        for s in servers.values():
            s.stop()
        redis.stop()
        shutil.rmtree(region.parent, ignore_errors=True)

