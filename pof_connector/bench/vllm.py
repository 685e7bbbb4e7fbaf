"""``pof bench vllm``: time to first token of a long prompt served from the pool, against the same
prompt recomputed and against vLLM's own ``ExampleConnector`` (disk), all in one run.

Three real vLLM servers run one after another with identical flags (model, dtype, block size,
batch limits): ``recompute`` (no connector), ``pof`` (PoFConnector, a CPU DRAM tier) and
``example`` (ExampleConnector on a local directory). For each prompt: the connector servers
first compute it once (which stores it), ``POST /reset_prefix_cache`` drops the engine's own
prefix cache, then the timed request must be served by the connector; the recompute server is
timed right after a reset. TTFT is the client-side latency of a one-token greedy completion.
Every timed answer is checked to equal the recompute server's.

Two more figures bound the result. ``recompute_with_pof``: the connector servers' first, cold
pass is timed too (vLLM with a connector configured prefills faster on this CPU than without
one, so the ratio uses the faster recompute of the two). ``engine_prefix_cache``: the same
prompt once more on the pof server, now a hit in vLLM's own prefix cache — the floor no
connector can beat, since vLLM still computes the prompt's last partial block.

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
                 progress: Progress) -> dict[str, list[Any]]:
    """Per prompt: the cold TTFT (connector servers: their first pass, which stores the prompt),
    the TTFT after a prefix-cache reset (served by the connector, if any), the answer, the tokens
    the connector served, and (connector servers) the TTFT of a hit in vLLM's own prefix cache."""
    out: dict[str, list[Any]] = {"cold": [], "ttft": [], "answers": [], "hits": [], "engine_hit": []}
    for i, p in enumerate(prompts):
        if warm:
            out["cold"].append(server.timed_complete(p, max_tokens=1)[0])
            time.sleep(1.0)                    # let the connector finish storing
        server.reset_prefix_cache()
        before = server.metrics().get(HITS, 0.0)
        ttft, answer = server.timed_complete(p, max_tokens=1)
        out["hits"].append(server.metrics().get(HITS, 0.0) - before)
        out["ttft"].append(ttft)
        out["answers"].append(answer)
        if warm:
            out["engine_hit"].append(server.timed_complete(p, max_tokens=1)[0])
        progress(f"  {name}: prompt {i + 1}/{len(prompts)}: TTFT {ttft:.3f} s, {out['hits'][-1]:.0f} tokens from the "
                 f"connector")
    return out


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
    results: dict[str, dict[str, list[Any]]] = {}
    try:
        for name, kv, warm in setups:
            progress(f"starting vLLM ({name}) with {model_dir.name}, {dtype}, block size {block_size} ...")
            server = VllmServer(model_dir, work / name, kv_transfer=kv, max_model_len=max_len, kv_cache_gib=4,
                                extra_args=common).start()
            try:
                results[name] = _time_server(name, server, data, warm=warm, progress=progress)
            except Exception as e:      # keep the server logs for the post-mortem, then re-raise
                raise BenchError(f"{name} server failed: {e}; its log: {server.log}\n{server.tail(30)}") from e
            finally:
                server.stop()
        shutil.rmtree(work, ignore_errors=True)
    finally:
        stop_embedded(runtime_dir)
    reference = results["recompute"]["answers"]
    for name in ("pof", "example"):
        if results[name]["answers"] != reference:
            raise BenchError(f"{name}'s greedy answers differ from the recompute server's")
    if min(results["pof"]["hits"]) <= 0:
        raise BenchError("the pool served no tokens: the timed requests were recomputed")
    med = {name: statistics.median(r["ttft"]) for name, r in results.items()}
    med["recompute_with_pof"] = statistics.median(results["pof"]["cold"])
    med["engine_prefix_cache"] = statistics.median(results["pof"]["engine_hit"])
    recompute = min(med["recompute"], med["recompute_with_pof"])
    return {
        "bench": "vllm",
        "ratio": round(med["pof"] / recompute, 4),
        "pof_vs_example": round(med["pof"] / med["example"], 3),
        "ttft_s": {name: round(v, 4) for name, v in med.items()},
        "ttft_runs_s": {name: [round(x, 4) for x in r["ttft"]] for name, r in results.items()},
        "load_overhead_s": {"pof": round(med["pof"] - med["engine_prefix_cache"], 4),
                            "example": round(med["example"] - med["engine_prefix_cache"], 4)},
        "pool_tokens": results["pof"]["hits"],
        "example_tokens": results["example"]["hits"],
        "prompt_tokens": prompt_tokens,
        "prompts": prompts,
        "model": str(model_dir),
        "dtype": dtype,
        "block_size": block_size,
        "note": "ratio = median pof TTFT / the faster median recompute (with or without a connector configured); "
                "pof_vs_example = median pof TTFT / median ExampleConnector TTFT; load_overhead_s = TTFT above a "
                "hit in vLLM's own prefix cache (the floor); servers run one at a time with the same flags; "
                "answers checked equal",
    }
