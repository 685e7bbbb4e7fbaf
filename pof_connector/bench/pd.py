"""``pof bench pd``: prefill/decode disaggregation through the pool against the same two servers
co-located, and against vLLM's own P/D (NixlConnector), on a prefill-heavy mix.

The mix: ``chat`` requests (a short prompt, a long streamed answer: the decoding that users watch)
and ``long`` requests (a long prompt, a short answer: the prefills that disturb it), each a Poisson
stream of its own, every prompt unique (no prefix cache helps either set-up). Two vLLM servers,
each on its own half of the cores as two hosts would be, serve it three ways, one after another:

- ``pd_pool``: `pof router` in P/D mode, server A the prefill group, server B the decode group;
  the hand-off goes through the pool (one shared CXL region, one index): B loads the prompt's
  pages and computes only the tail;
- ``colocated``: the same two servers (the same processes) behind `pof router` as two ordinary
  backends, each computing prompts and decoding;
- ``nixl``: vLLM's own P/D, ``NixlConnector`` with a host buffer (``kv_buffer_device: cpu``),
  behind the stock ``vllm-router --vllm-pd-disaggregation``: KV goes from A's blocks to B's over
  NIXL/UCX, A holds the blocks until B read them. Run when NIXL can be imported.

Per set-up: TTFT p50/p90 (all requests and per class), inter-token latency p50/p99 over every
streamed chunk after the first, and goodput: requests per second that met both SLOs (TTFT at most
``ttft_slo_s``; mean time per output token after the first at most ``tpot_slo_s``), over the
phase's wall time, as vLLM's ``benchmark_serving --goodput`` counts it. Every request must be
answered; a failed one is counted and named.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pof_connector.bench import BenchError, nearest_rank
from pof_connector.bench.needs import VLLM, VLLM_ROUTER, Need, check
from pof_connector.bench.router import ROUTER_NICE, _own_cores, model_path
from pof_connector.bench.router_process import RouterProcess
from pof_connector.bench.vllm_server import VllmServer, connector_config, free_port, stream_completion
from pof_connector.index.server import RedisServer

Progress = Callable[[str], None]
NEEDS: list[Need] = [VLLM, Need("the stock router (vllm-router)", VLLM_ROUTER.package, binary="vllm-router")]
SETUPS = ("pd_pool", "pd_split", "colocated", "nixl")
BLOCK = 128


@dataclass(frozen=True)
class Mix:
    """The request mix (defaults: the bench model on this project's 2-core test machines)."""

    model: str = "bench"
    seconds: float = 150.0
    """How long requests keep arriving, per set-up."""
    chat_rate: float = 0.4
    chat_prompt: int = 257
    chat_tokens: int = 96
    long_rate: float = 0.12
    long_prompt: int = 2049
    long_tokens: int = 8
    ttft_slo_s: float = 10.0
    tpot_slo_s: float = 0.25
    kv_tokens: int = 16384
    """KV cache per server, in tokens."""
    split_below: int = 512
    """``pd_split``'s ``pd_min_prefill_tokens``: shorter prompts are computed on the decode server."""


@dataclass(frozen=True)
class Req:
    at: float
    kind: str
    prompt: list[int]
    max_tokens: int


def make_requests(mix: Mix, seed: int, vocab: int, content: str = "") -> list[Req]:
    """The mix's requests: arrivals and lengths from ``seed`` alone, so every set-up gets the same
    schedule; token ids from ``seed`` and ``content`` (the set-up's name), so no set-up finds the
    prompts of one that ran before it in the pool (set-ups share servers and their pool)."""
    rnd, words = random.Random(seed), random.Random(f"{seed}:{content}")
    out: list[Req] = []
    for kind, rate, n, tokens in (("chat", mix.chat_rate, mix.chat_prompt, mix.chat_tokens),
                                  ("long", mix.long_rate, mix.long_prompt, mix.long_tokens)):
        at = rnd.expovariate(rate)
        while at < mix.seconds:
            out.append(Req(at, kind, [words.randrange(3, vocab) for _ in range(n)], tokens))
            at += rnd.expovariate(rate)
    return sorted(out, key=lambda r: (r.at, r.kind))


@dataclass
class Outcome:
    kind: str
    ttft: float = 0.0
    chunks: list[float] = dataclasses.field(default_factory=list)
    error: str = ""
    headers: dict[str, str] = dataclasses.field(default_factory=dict)


def drive(url: str, reqs: list[Req]) -> tuple[list[Outcome], float]:
    """Open loop: each request is sent at its arrival time whatever the others do."""
    outs = [Outcome(r.kind) for r in reqs]
    t0 = time.perf_counter()

    def one(i: int) -> None:
        r, o = reqs[i], outs[i]
        time.sleep(max(0.0, t0 + r.at - time.perf_counter()))
        try:
            o.ttft, _ = stream_completion(url, r.prompt, r.max_tokens, chunk_times=o.chunks, headers=o.headers)
        except Exception as e:          # counted and named in the result, never hidden
            o.error = f"{type(e).__name__}: {e}"[:200]

    with ThreadPoolExecutor(len(reqs)) as ex:
        for f in [ex.submit(one, i) for i in range(len(reqs))]:
            f.result()
    return outs, time.perf_counter() - t0


def _q(values: list[float], q: float) -> float | None:
    return round(nearest_rank(sorted(values), q), 4) if values else None


def summarize(outs: list[Outcome], wall: float, mix: Mix) -> dict[str, Any]:
    done = [o for o in outs if not o.error and o.chunks]
    itl = [b - a for o in done for a, b in zip(o.chunks, o.chunks[1:], strict=False)]
    good = 0
    for o in done:
        tpot = (o.chunks[-1] - o.chunks[0]) / (len(o.chunks) - 1) if len(o.chunks) > 1 else 0.0
        good += o.ttft <= mix.ttft_slo_s and tpot <= mix.tpot_slo_s
    row: dict[str, Any] = {
        "requests": len(outs), "answered": len(done), "failed": len(outs) - len(done),
        "ttft_p50_s": _q([o.ttft for o in done], 0.5), "ttft_p90_s": _q([o.ttft for o in done], 0.9),
        "itl_p50_s": _q(itl, 0.5), "itl_p99_s": _q(itl, 0.99), "itl_max_s": _q(itl, 1.0),
        "goodput_rps": round(good / wall, 4), "slo_met": good, "wall_s": round(wall, 1)}
    for kind in ("chat", "long"):
        mine = [o for o in done if o.kind == kind]
        mine_itl = [b - a for o in mine for a, b in zip(o.chunks, o.chunks[1:], strict=False)]
        row[kind] = {"answered": len(mine), "ttft_p50_s": _q([o.ttft for o in mine], 0.5),
                     "ttft_p90_s": _q([o.ttft for o in mine], 0.9), "itl_p50_s": _q(mine_itl, 0.5),
                     "itl_p99_s": _q(mine_itl, 0.99)}
    errors = [o.error for o in outs if o.error]
    if errors:
        row["errors"] = sorted(set(errors))[:5]
    prefill = [o.headers.get("x-pof-prefill", "") for o in done]
    if any(prefill):
        row["handoffs"] = sum(1 for p in prefill if p and not p.startswith("none:"))
        row["no_handoff"] = sorted({p for p in prefill if p.startswith("none:")})
    return row


def _counters(servers: list[VllmServer]) -> list[dict[str, float]]:
    names = ("vllm:prompt_tokens_total", "vllm:external_prefix_cache_hits_total", "vllm:generation_tokens_total",
             "vllm:pof_load_failures_total")
    out = []
    for s in servers:
        m = s.metrics(names)
        out.append({n.split(":")[1].removesuffix("_total"): m.get(n, 0.0) for n in names})
    return out


def _phase(name: str, url: str, servers: list[VllmServer], reqs: list[Req], mix: Mix,
           progress: Progress) -> dict[str, Any]:
    progress(f"  {name}: {len(reqs)} requests over {mix.seconds:g} s ...")
    before = _counters(servers)
    outs, wall = drive(url, reqs)
    after = _counters(servers)
    row = summarize(outs, wall, mix)
    row["servers"] = [{k: int(a[k] - b[k]) for k in a} for a, b in zip(after, before, strict=True)]
    progress(f"  {name}: TTFT p50 {row['ttft_p50_s']} s p90 {row['ttft_p90_s']} s; ITL p50 {row['itl_p50_s']} s "
             f"p99 {row['itl_p99_s']} s; goodput {row['goodput_rps']} req/s; failed {row['failed']}")
    return row


def nixl_why_not() -> str | None:
    """Why vLLM's NixlConnector cannot run here (``None``: it can be tried)."""
    if importlib.util.find_spec("nixl") is None and importlib.util.find_spec("nixl_cu13") is None:
        return "NIXL is not installed in this Python"
    return None


def nixl_shim(tmp: Path) -> str | None:
    """vLLM imports ``nixl._api``; the light install (``nixl-cu13`` alone) has ``nixl_cu13._api``.
    A two-line package ``nixl`` under ``tmp`` that re-exports it, for the servers' PYTHONPATH
    (``None``: ``nixl`` itself is installed)."""
    if importlib.util.find_spec("nixl") is not None:
        return None
    shim = tmp / "nixl-shim" / "nixl"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "__init__.py").write_text("from nixl_cu13 import *  # noqa\n")
    (shim / "_api.py").write_text("from nixl_cu13._api import *  # noqa\n")
    (shim / "_bindings.py").write_text("from nixl_cu13._bindings import *  # noqa\n")
    return str(shim.parent)


def run(*, mix: Mix, setups: list[str], seed: int, progress: Progress) -> dict[str, Any]:
    bad = [s for s in setups if s not in SETUPS]
    if bad or not setups:
        raise BenchError(f"--setups: {', '.join(bad) or 'none'}; allowed: {', '.join(SETUPS)}")
    check(NEEDS, "pd")
    model_dir = model_path(mix.model)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    reqs = {name: make_requests(mix, seed, vocab, content=name) for name in SETUPS}
    first = reqs[SETUPS[0]]
    max_len = max(4096, max(mix.long_prompt, mix.chat_prompt) + max(mix.long_tokens, mix.chat_tokens) + 64)
    common = ["--num-gpu-blocks-override", str(mix.kv_tokens // BLOCK)]
    tmp = Path(tempfile.mkdtemp(prefix="pof-bench-pd-", dir="/tmp"))
    out: dict[str, Any] = {"bench": "pd", "mix": dataclasses.asdict(mix), "seed": seed, "model": str(model_dir),
                           "requests": {"chat": sum(r.kind == "chat" for r in first),
                                        "long": sum(r.kind == "long" for r in first)},
                           "setups": {}}
    try:
        if {"pd_pool", "pd_split", "colocated"} & set(setups):
            out["setups"].update(_pool_setups(model_dir, tmp, common, max_len, reqs, mix, setups, progress))
        if "nixl" in setups:
            why = nixl_why_not()
            out["setups"]["nixl"] = ({"skipped": why} if why else
                                     _nixl_setup(model_dir, tmp, common, max_len, reqs["nixl"], mix, progress))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    s = out["setups"]
    co = s.get("colocated", {})
    for name in ("pd_pool", "pd_split", "nixl"):
        pd = s.get(name, {})
        if not (pd.get("itl_p99_s") and co.get("itl_p99_s") and co.get("goodput_rps")):
            continue
        itl, good = round(pd["itl_p99_s"] / co["itl_p99_s"], 4), round(pd["goodput_rps"] / co["goodput_rps"], 4)
        out[f"{name}_vs_colocated"] = {"itl_p99_ratio": itl, "goodput_ratio": good,
                                       "goal_met": itl <= 0.5 and good >= 1.0}
    out["note"] = ("goal: ITL p99 <= 0.5 x colocated at equal or better goodput. Goodput = requests meeting TTFT "
                   "<= ttft_slo_s and mean time per output token <= tpot_slo_s, per second of the phase. pd_pool, "
                   "pd_split and colocated run on the same two server processes (each on its own half of the "
                   "cores), one after another, each with prompts of its own (same arrivals and lengths): none "
                   "finds another's prompts in the pool. pd_split: prompts under split_below tokens are computed "
                   "on the decode server (pof router's pd_min_prefill_tokens).")
    return out


def _pool_setups(model_dir: Path, tmp: Path, common: list[str], max_len: int, reqs: dict[str, list[Req]], mix: Mix,
                 setups: list[str], progress: Progress) -> dict[str, Any]:
    redis = RedisServer(tmp / "redis").start()
    region = Path(tempfile.mkdtemp(prefix="pof-bench-pd-", dir="/dev/shm")) / "cxl.region"
    servers: list[VllmServer] = []
    results: dict[str, Any] = {}
    try:
        pool = {"index_url": redis.url, "tiers": {"cxl": {"path": str(region), "size": "2GiB", "partitions": 2}},
                "pd": {"wait_s": 10}}
        for i, name in enumerate(("a", "b")):
            kv = connector_config({"node_id": name, "runtime_dir": str(tmp / f"rt-{name}"), **pool})
            servers.append(VllmServer(model_dir, tmp / name, kv_transfer=kv, max_model_len=max_len, extra_args=common,
                                      env=_own_cores(i)))
        progress("starting 2 vLLM servers with pof (one CXL region, one index) ...")
        _start(servers)
        a, b = servers
        pd: dict[str, Any] = {"policy": "least_loaded", "prefill": [{"name": "a", "url": a.url}],
                              "decode": [{"name": "b", "url": b.url}]}
        configs = {"pd_pool": pd, "pd_split": {**pd, "pd_min_prefill_tokens": mix.split_below},
                   "colocated": {"policy": "least_loaded", "index_url": redis.url,
                                 "backends": [{"name": "a", "url": a.url}, {"name": "b", "url": b.url}]}}
        for name in ("pd_pool", "pd_split", "colocated"):
            if name not in setups:
                continue
            router = RouterProcess.pof(tmp, configs[name], name=f"router-{name}").start(nice=ROUTER_NICE)
            try:
                results[name] = _phase(name, router.url, servers, reqs[name], mix, progress)
            finally:
                router.stop()
    finally:
        for s in servers:
            s.stop()
        redis.stop()
        shutil.rmtree(region.parent, ignore_errors=True)
    return results


def _nixl_setup(model_dir: Path, tmp: Path, common: list[str], max_len: int, reqs: list[Req], mix: Mix,
                progress: Progress) -> dict[str, Any]:
    shim = nixl_shim(tmp)
    servers: list[VllmServer] = []
    for i, name in enumerate(("na", "nb")):
        kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
        env = {**_own_cores(i), "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
               "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo"}
        if shim:
            env["PYTHONPATH"] = shim + os.pathsep + os.environ.get("PYTHONPATH", "")
        servers.append(VllmServer(model_dir, tmp / name, kv_transfer=kv, max_model_len=max_len, extra_args=common,
                                  env=env))
    try:
        progress("starting 2 vLLM servers with NixlConnector (kv_buffer_device cpu) ...")
        try:
            _start(servers)
        except Exception as e:
            why = next((line for s in servers for line in reversed(s.tail(400).splitlines())
                        if "Error" in line or "error" in line), str(e))
            progress(f"  nixl: the servers did not start: {why}")
            return {"skipped": f"vLLM with NixlConnector did not start on this CPU build: {why[:400]}"}
        port = free_port()
        exe = str(Path(sys.executable).parent / "vllm-router")
        router = RouterProcess([exe, "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
                                "--prefill", servers[0].url, "--decode", servers[1].url, "--policy", "round_robin",
                                "--prometheus-port", str(free_port())], port, tmp / "vllm-router-nixl.log")
        router.start(nice=ROUTER_NICE)
        try:
            return _phase("nixl", router.url, servers, reqs, mix, progress)
        finally:
            router.stop()
    finally:
        for s in servers:
            s.stop()


def _start(servers: list[VllmServer]) -> None:
    try:
        with ThreadPoolExecutor(len(servers)) as ex:
            list(ex.map(lambda s: s.start(timeout_s=900), servers))
    except Exception:
        for s in servers:
            s.stop()
        raise
