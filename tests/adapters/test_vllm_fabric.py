"""Two real vLLM CPU servers whose pools are joined only through NIXL (issue 4, must-show 2).

A and B each have a private CPU DRAM tier (no shared CXL region) and share a real
Redis-protocol index; ``fabric.enabled`` with UCX over TCP on loopback. A prompt computed by A is
served to B from A's tier with NIXL READs: B's greedy answer equals a server's without the
connector, vLLM's own hit counter moves by the pool's share of the prompt, and B's pof counters
show the pages came from a remote tier. Then A is killed while the index still offers its pages:
B's remote load fails, vLLM recomputes (the answer is still right) and B keeps serving.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from pof_connector.bench.vllm_server import VllmServer, build_model, connector_config
from pof_connector.fabric import nixl_installed
from pof_connector.index.server import RedisServer
from tests.adapters.server_workdir import server_workdir
from tests.adapters.test_vllm import DTYPE, HITS, pool_tokens, prompt

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow,
              # ci/test.sh sets POF_REQUIRE_NIXL=1: there a missing NIXL fails the test instead.
              pytest.mark.skipif(not nixl_installed() and os.environ.get("POF_REQUIRE_NIXL") != "1",
                                 reason="NIXL is not installed in this venv (ci/vllm_venv.sh installs it)")]

def wait_for(pred: Callable[[], bool], server: VllmServer, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"condition not reached; {diagnosis(server)}"
        time.sleep(0.5)


def diagnosis(server: VllmServer) -> str:
    """pof's counters and log lines: vLLM's start-up banner alone fills a tail of the log."""
    try:
        counters = "\n".join(f"  {k} = {v}" for k, v in sorted(server.metrics().items()) if k.startswith("vllm:pof_"))
    except OSError as e:          # a server that died still has its log lines to show
        counters = f"  (no /metrics: {e})"
    lines = [line for line in server.log.read_text(errors="replace").splitlines()
             if ("pof" in line.lower() and "non-default args" not in line) or "Error" in line]
    return f"{server.log}\npof counters:\n{counters}\npof log lines:\n" + "\n".join(lines[-80:])


def series(server: VllmServer, name: str, label: str) -> float:
    """Sum of ``name``'s samples whose labels contain ``label`` (e.g. ``tier="remote:cpu_dram"``)."""
    return sum(v for k, v in server.metrics().items() if k.startswith(name + "{") and label in k)


@pytest.fixture(scope="module")
def model() -> Path:
    return build_model("tiny")


@pytest.fixture
def workdir(request: pytest.FixtureRequest) -> Iterator[Path]:
    yield from server_workdir(request, "pof-vfab-")


def fabric_server(model: Path, workdir: Path, node: str, index_url: str) -> VllmServer:
    cfg: dict[str, Any] = {
        "node_id": node, "index_url": index_url, "runtime_dir": str(workdir / f"rt-{node}"),
        "tiers": {"cpu_dram": {"size": "256MiB"}},
        # TLS=tcp on lo: the pages take the network path (else UCX would copy through shared memory).
        "fabric": {"enabled": True, "tls": "tcp", "ucx_devices": "lo", "timeout_s": 10.0}}
    return VllmServer(model, workdir / node, kv_transfer=connector_config(cfg), env={"NIXL_LOG_LEVEL": "WARN"},
                      dtype=DTYPE)


def test_b_is_served_from_a_over_nixl_and_answers_like_no_connector(
        model: Path, workdir: Path, redis_server: RedisServer) -> None:
    prompts = {"ab": prompt(1000, seed=71), "ba": prompt(777, seed=72), "dead": prompt(900, seed=73),
               "after": prompt(600, seed=74)}
    # The reference: a server without the connector, run first and alone (three servers would not fit).
    baseline = VllmServer(model, workdir / "baseline", dtype=DTYPE).start()
    try:
        reference = {name: baseline.complete(p) for name, p in prompts.items()}
    finally:
        baseline.stop()

    a = fabric_server(model, workdir, "a", redis_server.url)
    b = fabric_server(model, workdir, "b", redis_server.url)
    try:
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda s: s.start(), (a, b)))
        assert a.complete(prompts["ab"]) == reference["ab"]          # A computes and stores it
        time.sleep(1.5)                                              # ... and publishes its pages
        hits = b.metrics()[HITS]
        assert b.complete(prompts["ab"]) == reference["ab"]          # B: from A's tier over NIXL
        assert b.metrics()[HITS] - hits == pool_tokens(1000) == 896
        assert re.search(r"1000 prompt tokens, 0 from the engine's prefix cache, 896 from the pool "
                         r"\(cpu_dram: 896; node a\), 104 to compute", b.log.read_text()), diagnosis(b)
        wait_for(lambda: series(b, "vllm:pof_loaded_pages_total", 'tier="remote:cpu_dram"') >= 7, b)
        assert series(b, "vllm:pof_load_failures_total", "") == 0, diagnosis(b)

        # And the other way round: B computes, A reads from B.
        assert b.complete(prompts["ba"]) == reference["ba"]
        time.sleep(1.5)
        hits = a.metrics()[HITS]
        assert a.complete(prompts["ba"]) == reference["ba"]
        assert a.metrics()[HITS] - hits == pool_tokens(777) == 768
        wait_for(lambda: series(a, "vllm:pof_loaded_pages_total", 'tier="remote:cpu_dram"') >= 6, a)
        for s in (a, b):
            assert "pof fabric: connected to" in s.log.read_text(), diagnosis(s)

        # A dies (SIGKILL, by its process group) right after computing a prompt whose pages the
        # index still offers: B's remote load fails, vLLM recomputes, and B keeps serving.
        assert a.complete(prompts["dead"]) == reference["dead"]
        time.sleep(1.5)
        assert a.proc is not None
        os.killpg(a.proc.pid, signal.SIGKILL)
        failures = series(b, "vllm:pof_load_failures_total", "")
        assert b.complete(prompts["dead"]) == reference["dead"]      # not a wrong token: recomputed
        wait_for(lambda: series(b, "vllm:pof_load_failures_total", "") > failures, b)   # it did try A
        assert b.complete(prompts["after"]) == reference["after"]
        assert b.complete(prompts["ab"]) == reference["ab"]
    finally:
        a.stop()
        b.stop()
