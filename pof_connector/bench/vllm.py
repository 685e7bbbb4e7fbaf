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
connector can beat, since vLLM still computes the prompt's last partial block. The example
server times the same hit after each of its loads, and each connector's overhead is read
against its own server's floor (the servers run minutes apart).

``fabric`` (``--fabric``): two pof servers A and B run side by side, each with its own CPU DRAM
tier, sharing only the index; their pools are connected through NIXL (UCX over TCP on loopback,
so the bytes take the network path, not shared memory). For each prompt A computes it (timed:
a recompute with a connector configured) and stores it; B's timed request is then served with
pages READ from A's tier over NIXL; then the same prompt once more on B (its own prefix cache,
the floor). ``fabric.ratio`` = B's median TTFT / the same recompute the local ratio uses.

Needs a Python with vLLM (run it from the venv ``ci/vllm_venv.sh`` builds); ``fabric`` also
needs NIXL in it.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from pof_connector.bench import BenchError
from pof_connector.bench.router import _own_cores as own_cores
from pof_connector.bench.vllm_load import timed_copy
from pof_connector.bench.vllm_server import VllmServer, build_model, connector_config
from pof_connector.fabric import nixl_installed
from pof_connector.fabric.nixl_api import INSTALL_HINT
from pof_connector.index.embedded import stop_embedded

Progress = Callable[[str], None]
HITS = "vllm:external_prefix_cache_hits_total"
LOADED_BYTES = "vllm:pof_loaded_bytes_total"
WAIT_SUM, WAIT_COUNT = "vllm:pof_load_wait_seconds_sum", "vllm:pof_load_wait_seconds_count"
SETUPS = ("recompute", "pof", "example", "fabric")
ENGINE_THREADS = len(os.sched_getaffinity(0))
"""vLLM's CPU worker runs one OpenMP thread per core it may use: the servers here get every core."""
FABRIC_STAGING = "512MiB"
"""B's fabric.staging_size: a 6,000-token prompt of the bench model is 47 pages of 2 MiB, and
the staging must hold a whole load (the excess would be recomputed)."""


NOTE = ("ratio = median pof TTFT / the fastest median recompute (with or without a connector configured); "
        "floor_s = median TTFT of the same prompt as a hit in vLLM's own prefix cache (timed right after each "
        "pof load, repeats per prompt); pof_s, example_s = median TTFT served by each connector; "
        "loaded_bytes = page bytes pof loaded per timed request (its counters); "
        "memcpy_s = one numpy.copyto of loaded_bytes in this run; overhead_ratio = (pof_s - floor_s) / memcpy_s; "
        "memcpy_threads_s = the same bytes copied in as many parts side by side as the engine has threads (pof's "
        "load copies on as many threads); overhead_ratio_vs_memcpy_threads = (pof_s - floor_s) / "
        "memcpy_threads_s; load_wait_s = mean time the forward's thread spent in pof in a step that loaded "
        "(the server's vllm:pof_load_wait_seconds: opening the pages, the copies and checks it waited for), "
        "load_wait_ratio = load_wait_s / memcpy_s: pof's own part of overhead_ratio, without the TTFT's noise; "
        "example_floor_s = the same hit on the example server, timed right after each of its loads; "
        "pof_vs_example_above_floor = (pof_s - floor_s) / (example_s - example_floor_s): each connector against "
        "the floor of its own server, timed in the same moments as its loads (servers run minutes apart); "
        "pof_vs_example = median pof TTFT / median ExampleConnector TTFT; load_overhead_s = each connector's "
        "median TTFT above its own server's floor; pof_above_floor_paired_s = median over timed loads of (the "
        "load's TTFT - the floor timed right after it), less sensitive to a busy machine than "
        "the difference of medians; fabric.ratio = median TTFT of B served from A's pool over NIXL / "
        "median recompute of the same prompts by A (the pair runs side by side, each server on half of the "
        "cores, as two hosts would); servers run one at a time (the fabric pair together) with the same flags; "
        "answers checked equal")


def _prompts(count: int, tokens: int, vocab: int = 1900) -> list[list[int]]:
    rnd = random.Random(1234)
    return [[rnd.randrange(3, vocab) for _ in range(tokens)] for _ in range(count)]


def _time_server(name: str, server: VllmServer, prompts: list[list[int]], *, warm: bool, repeats: int,
                 progress: Progress) -> dict[str, list[Any]]:
    """Per prompt: the cold TTFT (connector servers: their first pass, which stores the prompt),
    the TTFT after a prefix-cache reset (served by the connector, if any), the answer, the tokens
    the connector served, and (connector servers) the TTFT of a hit in vLLM's own prefix cache.
    Connector servers time ``repeats`` load / floor pairs per prompt, alternating (reset, the
    load, then the same prompt as a hit in the engine's own cache), so both medians see the same
    moments of a noisy machine; every answer must equal the prompt's first."""
    out: dict[str, list[Any]] = {"cold": [], "ttft": [], "answers": [], "hits": [], "engine_hit": []}
    for i, p in enumerate(prompts):
        if warm:
            out["cold"].append(server.timed_complete(p, max_tokens=1)[0])
            time.sleep(1.0)                    # let the connector finish storing
        for r in range(repeats if warm else 1):
            server.reset_prefix_cache()
            before = server.metrics().get(HITS, 0.0)
            ttft, answer = server.timed_complete(p, max_tokens=1)
            out["hits"].append(server.metrics().get(HITS, 0.0) - before)
            out["ttft"].append(ttft)
            if r == 0:
                out["answers"].append(answer)
            elif answer != out["answers"][-1]:
                raise BenchError(f"{name}: prompt {i + 1}'s greedy answer changed between timed loads")
            if warm:
                out["engine_hit"].append(server.timed_complete(p, max_tokens=1)[0])
            progress(f"  {name}: prompt {i + 1}/{len(prompts)}: TTFT {ttft:.3f} s, {out['hits'][-1]:.0f} tokens "
                     f"from the connector")
    if name == "pof":
        time.sleep(2.0)         # vLLM exports the worker's pof counters with its periodic stats
        m = server.metrics()
        out["loaded_bytes"] = [m.get(LOADED_BYTES, 0.0)]
        out["wait_s"] = [m.get(WAIT_SUM, 0.0) / m[WAIT_COUNT] if m.get(WAIT_COUNT) else 0.0]
    return out


def memcpy_seconds(nbytes: int, repeat: int = 5, threads: int = 1) -> float:
    """Best-of-``repeat`` time of one ``numpy.copyto`` of ``nbytes`` between buffers already faulted
    in (``threads`` > 1: split into that many parts copied side by side): what moving a load's
    bytes once costs on this host, right now."""
    src = np.ones(max(nbytes, 1), dtype=np.uint8)
    dst = np.zeros_like(src)
    with ThreadPoolExecutor(threads) as pool:
        return min(timed_copy(dst, src, pool if threads > 1 else None, threads) for _ in range(repeat))


def _time_fabric(a: VllmServer, b: VllmServer, prompts: list[list[int]], progress: Progress) -> dict[str, list[Any]]:
    """Per prompt: A's cold TTFT (it computes and stores the prompt), B's TTFT served from A's
    tier over NIXL, B's answer, the tokens B's connector served, and B's own prefix-cache hit."""
    out: dict[str, list[Any]] = {"cold": [], "ttft": [], "answers": [], "hits": [], "engine_hit": [],
                                 "remote_pages": [], "a_answers": []}
    for i, p in enumerate(prompts):
        cold, a_answer = a.timed_complete(p, max_tokens=1)
        out["cold"].append(cold)
        out["a_answers"].append(a_answer)
        time.sleep(1.0)                        # A's store thread publishes the pages
        b.reset_prefix_cache()
        m0 = b.metrics()
        ttft, answer = b.timed_complete(p, max_tokens=1)
        out["ttft"].append(ttft)
        out["answers"].append(answer)
        out["hits"].append(b.metrics().get(HITS, 0.0) - m0.get(HITS, 0.0))
        out["engine_hit"].append(b.timed_complete(p, max_tokens=1)[0])
        progress(f"  fabric: prompt {i + 1}/{len(prompts)}: A computed it in {out['cold'][-1]:.3f} s, B's TTFT "
                 f"{ttft:.3f} s with {out['hits'][-1]:.0f} tokens read from A over NIXL")
    time.sleep(2.0)         # vLLM exports the worker's pof counters with its periodic stats
    out["remote_pages"].append(sum(v for k, v in b.metrics().items()
                                   if k.startswith("vllm:pof_loaded_pages_total{") and 'tier="remote:' in k))
    return out


def _fabric_pair(model_dir: Path, work: Path, runtime_dir: Path, max_len: int, common: list[str],
                 progress: Progress, prompts: list[list[int]]) -> dict[str, list[Any]]:
    if not nixl_installed():
        raise BenchError(f"fabric: NIXL is not installed in this Python: {INSTALL_HINT}")
    # Both pools talk to one embedded index (one runtime_dir); their tiers are private memory,
    # so the only way B reads A's pages is a NIXL READ. TLS=tcp on lo: the network path.
    def extra(node: str) -> dict[str, Any]:
        return {"node_id": node, "index_url": "embedded", "runtime_dir": str(runtime_dir),
                "tiers": {"cpu_dram": {"size": "4GiB"}},
                "fabric": {"enabled": True, "tls": "tcp", "ucx_devices": "lo", "timeout_s": 10.0,
                           "staging_size": FABRIC_STAGING}}
    progress(f"starting vLLM (fabric A and B, pools joined over NIXL) with {model_dir.name} ...")
    # Each server computes on its own half of the cores, as two hosts would (sharing them, the
    # idle server's OpenMP threads spin while the other computes: B measured 3-4x slower).
    servers = [VllmServer(model_dir, work / f"fabric-{n}", kv_transfer=connector_config(extra(n)),
                          max_model_len=max_len, kv_cache_gib=2, extra_args=common,
                          env={"NIXL_LOG_LEVEL": "WARN", **own_cores(i)}) for i, n in enumerate(("a", "b"))]
    try:
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda s: s.start(), servers))
        a, b = servers
        try:
            return _time_fabric(a, b, prompts, progress)
        except Exception as e:
            raise BenchError(f"fabric servers failed: {e}; logs: {a.log}, {b.log}\n{b.tail(30)}") from e
    finally:
        for server in servers:
            server.stop()


def run(*, model: str | None, prompt_tokens: int, prompts: int, dtype: str, block_size: int,
        progress: Progress, setups: tuple[str, ...] = ("recompute", "pof", "example"),
        repeats: int = 1, audit_rates: tuple[float, ...] = ()) -> dict[str, Any]:
    """``setups``: which of :data:`SETUPS` to run (``fabric`` is the pair of servers joined by NIXL);
    ``repeats``: timed loads (each with its floor) per prompt on the pof and example servers;
    ``audit_rates``: the pof server again with each ``audit.sample_rate`` (its cost: an audited
    hit is recomputed)."""
    if repeats < 1:
        raise BenchError(f"repeats must be at least 1, got {repeats}")
    if not setups or any(s not in SETUPS for s in setups):
        raise BenchError(f"setups must be some of {', '.join(SETUPS)}, got {', '.join(setups) or 'none'}")
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
    single: list[tuple[str, dict[str, Any] | None, bool]] = [
        ("recompute", None, False), ("pof", connector_config(pof_extra), True), ("example", example, True)]
    for rate in audit_rates:           # seeded: each run samples the same requests
        audited = connector_config({**pof_extra, "audit": {"sample_rate": rate, "seed": 7}})
        single.append((f"pof_audit_{rate:g}", audited, True))
    setups = (*setups, *(f"pof_audit_{r:g}" for r in audit_rates))
    data = _prompts(prompts, prompt_tokens)
    results: dict[str, dict[str, list[Any]]] = {}
    try:
        for name, kv, warm in single:
            if name not in setups:
                continue
            progress(f"starting vLLM ({name}) with {model_dir.name}, {dtype}, block size {block_size} ...")
            server = VllmServer(model_dir, work / name, kv_transfer=kv, max_model_len=max_len, kv_cache_gib=4,
                                extra_args=common).start()
            try:
                results[name] = _time_server(name, server, data, warm=warm, repeats=repeats,
                                             progress=progress)
            except Exception as e:      # keep the server logs for the post-mortem, then re-raise
                raise BenchError(f"{name} server failed: {e}; its log: {server.log}\n{server.tail(30)}") from e
            finally:
                server.stop()
            if name == "pof":      # a memcpy of the bytes each timed request loaded, in this run
                per_request = int(results[name]["loaded_bytes"][0] / max(len(results[name]["ttft"]), 1))
                results[name]["loaded_bytes"] = [per_request]
                results[name]["memcpy_s"] = [memcpy_seconds(per_request)]
                results[name]["memcpy_threads_s"] = [memcpy_seconds(per_request, threads=ENGINE_THREADS)]
        if "fabric" in setups:
            results["fabric"] = _fabric_pair(model_dir, work, runtime_dir / "fabric", max_len, common, progress,
                                             data)
        shutil.rmtree(work, ignore_errors=True)
    finally:
        stop_embedded(runtime_dir)
        stop_embedded(runtime_dir / "fabric")
    audits = {name: results.pop(name) for name in [n for n in results if n.startswith("pof_audit_")]}
    summary = _summary(results, prompt_tokens, prompts, model_dir, dtype, block_size)
    if audits:
        summary["audit"] = _audit_cost(results, audits)
    return {**summary, "repeats": repeats}


def _audit_cost(results: dict[str, dict[str, list[Any]]], audits: dict[str, dict[str, list[Any]]]) -> dict[str, Any]:
    """Per ``audit.sample_rate``: the timed requests' mean and median TTFT, how many were audited
    (the pool served none of their tokens: the engine recomputed them), against pof without it."""
    base = results["pof"]
    rows: dict[str, Any] = {"0": {"mean_ttft_s": round(statistics.mean(base["ttft"]), 4),
                                  "median_ttft_s": round(statistics.median(base["ttft"]), 4),
                                  "audited_requests": sum(h <= 0 for h in base["hits"]), "requests": len(base["ttft"])}}
    for name, r in audits.items():
        if "recompute" in results and r["answers"] != results["recompute"]["answers"]:
            raise BenchError(f"{name}'s greedy answers differ from the recompute server's")
        rows[name.removeprefix("pof_audit_")] = {
            "mean_ttft_s": round(statistics.mean(r["ttft"]), 4),
            "median_ttft_s": round(statistics.median(r["ttft"]), 4),
            "audited_requests": sum(h <= 0 for h in r["hits"]), "requests": len(r["ttft"]),
            "mean_vs_no_audit": round(statistics.mean(r["ttft"]) / statistics.mean(base["ttft"]), 3)}
    return {"rows": rows, "note": "the pof server once more per audit.sample_rate (seed 7), same prompts and repeats; "
                                  "an audited request is served by the engine's own compute (0 tokens from the pool)"}


def _summary(results: dict[str, dict[str, list[Any]]], prompt_tokens: int, prompts: int, model_dir: Path,
             dtype: str, block_size: int) -> dict[str, Any]:
    # The reference answers: the no-connector server's, else fabric A's cold pass (A computed
    # those prompts itself: nothing was in any pool yet).
    reference = results["recompute"]["answers"] if "recompute" in results else None
    for name in ("pof", "example", "fabric"):
        if name in results and reference is not None and results[name]["answers"] != reference:
            raise BenchError(f"{name}'s greedy answers differ from the recompute server's")
        if name == "fabric" and name in results and results[name]["answers"] != results[name]["a_answers"]:
            raise BenchError("fabric: B's greedy answers differ from A's, which computed the prompts")
        if name in ("pof", "fabric") and name in results and min(results[name]["hits"]) <= 0:
            raise BenchError(f"{name}: the pool served no tokens: the timed requests were recomputed")
    med = {name: statistics.median(r["ttft"]) for name, r in results.items()}
    recomputes = [med[n] for n in ("recompute",) if n in med]
    if "pof" in results:
        med["recompute_with_pof"] = statistics.median(results["pof"]["cold"])
        med["engine_prefix_cache"] = statistics.median(results["pof"]["engine_hit"])
        recomputes.append(med["recompute_with_pof"])
    if "fabric" in results:
        med["fabric_a_recompute"] = statistics.median(results["fabric"]["cold"])
        med["fabric_b_engine_prefix_cache"] = statistics.median(results["fabric"]["engine_hit"])
        recomputes.append(med["fabric_a_recompute"])
    recompute = min(recomputes)
    out: dict[str, Any] = {"bench": "vllm"}
    if "fabric" in results:
        f = results["fabric"]
        # The pair's own recompute (A's cold pass) ran with the same cores per server as B's load:
        # that is the same-conditions ratio; the run's fastest recompute (all cores) is shown too.
        out["fabric"] = {"ratio": round(med["fabric"] / med["fabric_a_recompute"], 4),
                         "ratio_vs_fastest_recompute": round(med["fabric"] / recompute, 4),
                         "ttft_s": round(med["fabric"], 4),
                         "a_recompute_s": round(med["fabric_a_recompute"], 4),
                         "b_engine_prefix_cache_s": round(med["fabric_b_engine_prefix_cache"], 4),
                         "load_overhead_s": round(med["fabric"] - med["fabric_b_engine_prefix_cache"], 4),
                         "remote_tokens": f["hits"], "remote_pages_loaded": f["remote_pages"][-1],
                         "transport": "NIXL, UCX TLS=tcp on lo"}
    if "pof" not in results:
        return {**out, "ratio": out["fabric"]["ratio"] if "fabric" in out else None,
                "ttft_s": {name: round(v, 4) for name, v in med.items()},
                "ttft_runs_s": {name: [round(x, 4) for x in r["ttft"]] for name, r in results.items()},
                "prompt_tokens": prompt_tokens, "prompts": prompts, "model": str(model_dir), "dtype": dtype,
                "block_size": block_size, "note": NOTE}
    floor = med["engine_prefix_cache"]
    # Each connector against its own server's floor, timed in the same moments as its loads:
    # the servers run minutes apart, and this host's TTFTs drift by more than a load between them.
    floors = {name: statistics.median(results[name]["engine_hit"]) for name in ("pof", "example")
              if name in results and results[name]["engine_hit"]}
    overheads = {name: med[name] - f for name, f in floors.items()}
    loaded = results["pof"]["loaded_bytes"][0]
    memcpy_s = results["pof"]["memcpy_s"][0]
    memcpy_threads_s = results["pof"]["memcpy_threads_s"][0]
    above = overheads["pof"]          # = pof_s - floor_s
    return {
        **out,
        "ratio": round(med["pof"] / recompute, 4),
        "floor_s": round(floor, 4),
        "pof_s": round(med["pof"], 4),
        "example_s": round(med["example"], 4) if "example" in med else None,
        "loaded_bytes": loaded,
        "memcpy_s": round(memcpy_s, 6),
        "overhead_ratio": round(above / memcpy_s, 3) if memcpy_s > 0 and loaded > 0 else None,
        "memcpy_threads_s": round(memcpy_threads_s, 6),
        "overhead_ratio_vs_memcpy_threads": (round(above / memcpy_threads_s, 3)
                                             if memcpy_threads_s > 0 and loaded > 0 else None),
        "load_wait_s": round(results["pof"]["wait_s"][0], 6),
        "load_wait_ratio": round(results["pof"]["wait_s"][0] / memcpy_s, 3) if memcpy_s > 0 else None,
        "example_floor_s": round(floors["example"], 4) if "example" in floors else None,
        "pof_vs_example_above_floor": (round(above / overheads["example"], 3)
                                       if overheads.get("example", 0) > 0 else None),
        "pof_vs_example": round(med["pof"] / med["example"], 3) if "example" in med else None,
        "ttft_s": {name: round(v, 4) for name, v in med.items()},
        "ttft_runs_s": {**{name: [round(x, 4) for x in r["ttft"]] for name, r in results.items()},
                        "engine_prefix_cache": [round(x, 4) for x in results["pof"]["engine_hit"]],
                        **({"example_engine_prefix_cache": [round(x, 4) for x in results["example"]["engine_hit"]]}
                           if "example" in results else {})},
        "pof_above_floor_paired_s": round(statistics.median(
            t - f for t, f in zip(results["pof"]["ttft"], results["pof"]["engine_hit"], strict=True)), 4),
        "load_overhead_s": {name: round(v, 4) for name, v in overheads.items()},
        "pool_tokens": results["pof"]["hits"],
        "example_tokens": results["example"]["hits"] if "example" in results else None,
        "prompt_tokens": prompt_tokens,
        "prompts": prompts,
        "model": str(model_dir),
        "dtype": dtype,
        "block_size": block_size,
        "note": NOTE,
    }
