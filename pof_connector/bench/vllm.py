"""``pof bench vllm``: time to first token of a long prompt served from the pool, against the same
prompt recomputed and against vLLM's own ``ExampleConnector`` (disk), all in one run.

Three real vLLM servers run one after another with identical flags (model, dtype, block size,
batch limits): ``recompute`` (no connector), ``pof`` (PoFConnector, a CPU DRAM tier) and
``example`` (ExampleConnector on a local directory). For each prompt: the connector servers
first compute it once (which stores it), ``POST /reset_prefix_cache`` drops the engine's own
prefix cache, then the timed request must be served by the connector; the recompute server is
timed right after a reset. TTFT is the client-side latency of a one-token greedy completion.
Every timed answer is checked to equal the recompute server's.

Needs a Python with vLLM (run it from the venv ``ci/vllm_venv.sh`` builds).
"""

from __future__ import annotations

import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pof_connector.bench import BenchError
from pof_connector.bench.vllm_server import VllmServer, build_model, connector_config
from pof_connector.index.embedded import stop_embedded

Progress = Callable[[str], None]
HITS = "vllm:external_prefix_cache_hits_total"


def _prompts(count: int, tokens: int, vocab: int = 1900) -> list[list[int]]:
    rnd = random.Random(1234)
    return [[rnd.randrange(3, vocab) for _ in range(tokens)] for _ in range(count)]


def _time_server(name: str, server: VllmServer, prompts: list[list[int]], *, warm: bool,
                 progress: Progress) -> tuple[list[float], list[list[int]], list[float]]:
    """TTFT of each prompt (after a prefix-cache reset; with ``warm`` after one untimed pass that
    fills the connector), the one-token answers, and external-cache hit tokens per prompt."""
    ttfts, answers, hits = [], [], []
    for i, p in enumerate(prompts):
        if warm:
            server.complete(p, max_tokens=1)
            time.sleep(1.0)                    # let the connector finish storing
        server.reset_prefix_cache()
        before = server.metrics().get(HITS, 0.0)
        ttft, answer = server.timed_complete(p, max_tokens=1)
        hits.append(server.metrics().get(HITS, 0.0) - before)
        ttfts.append(ttft)
        answers.append(answer)
        progress(f"  {name}: prompt {i + 1}/{len(prompts)}: TTFT {ttft:.3f} s, {hits[-1]:.0f} tokens from the "
                 f"connector")
    return ttfts, answers, hits


def run(*, model: str | None, prompt_tokens: int, prompts: int, dtype: str, block_size: int,
        progress: Progress) -> dict[str, Any]:
    model_dir = Path(model) if model else build_model("bench")
    work = Path(tempfile.mkdtemp(prefix="pof-bench-vllm-", dir="/tmp"))
    runtime_dir = work / "rt"
    common = ["--dtype", dtype, "--block-size", str(block_size), "--max-num-batched-tokens", "16384",
              "--max-num-seqs", "4"]
    max_len = max(4096, prompt_tokens + 64)
    pof_extra = {"node_id": "bench", "index_url": "embedded", "runtime_dir": str(runtime_dir),
                 "tiers": {"cpu_dram": {"size": "4GiB"}}}
    example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
               "kv_connector_extra_config": {"shared_storage_path": str(work / "example-store")}}
    setups: list[tuple[str, dict[str, Any] | None, bool]] = [
        ("recompute", None, False), ("pof", connector_config(pof_extra), True), ("example", example, True)]
    data = _prompts(prompts, prompt_tokens)
    results: dict[str, tuple[list[float], list[list[int]], list[float]]] = {}
    try:
        for name, kv, warm in setups:
            progress(f"starting vLLM ({name}) with {model_dir.name}, {dtype}, block size {block_size} ...")
            server = VllmServer(model_dir, work / name, kv_transfer=kv, max_model_len=max_len, kv_cache_gib=4,
                                extra_args=common).start()
            try:
                results[name] = _time_server(name, server, data, warm=warm, progress=progress)
            finally:
                server.stop()
    finally:
        stop_embedded(runtime_dir)
        shutil.rmtree(work, ignore_errors=True)
    reference = results["recompute"][1]
    for name in ("pof", "example"):
        if results[name][1] != reference:
            raise BenchError(f"{name}'s greedy answers differ from the recompute server's")
    if min(results["pof"][2]) <= 0:
        raise BenchError("the pool served no tokens: the timed requests were recomputed")
    med = {name: statistics.median(r[0]) for name, r in results.items()}
    return {
        "bench": "vllm",
        "ratio": round(med["pof"] / med["recompute"], 4),
        "pof_vs_example": round(med["pof"] / med["example"], 3),
        "ttft_s": {name: round(v, 4) for name, v in med.items()},
        "ttft_runs_s": {name: [round(x, 4) for x in r[0]] for name, r in results.items()},
        "pool_tokens": results["pof"][2],
        "example_tokens": results["example"][2],
        "prompt_tokens": prompt_tokens,
        "prompts": prompts,
        "model": str(model_dir),
        "dtype": dtype,
        "block_size": block_size,
        "note": "ratio = median pof TTFT / median recompute TTFT; pof_vs_example = median pof TTFT / median "
                "ExampleConnector TTFT; each server alone on the machine, same flags, answers checked equal",
    }
