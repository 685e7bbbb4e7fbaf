"""``pof bench capacity``: how much load a KV-constrained cluster serves within a TTFT SLO, with and
without the pool, on real vLLM CPU servers (issue 14).

The workload is a trace (:mod:`.capacity_trace`: ``--trace FILE`` or the seeded fragmenting mix),
replayed open-loop (:mod:`.capacity_replay`) through each set-up (:mod:`.capacity_fleet`:
``static``, ``round_robin``, ``cache_aware``, ``cache_aware_offload``, ``pof``), each on freshly started
servers.

- **SLO**: ``SLO_MULTIPLE`` x the unloaded TTFT, measured at the start of the run: the p90 TTFT of
  a sample of the trace's prompt sizes, sent one at a time, cold, to an idle server.
- **Goodput** of a set-up: the highest offered load (the trace's arrival rate x a factor) at which
  p90 TTFT stays within the SLO and no request fails, found by a bounded search over the factor
  (doubling or halving from 1, then bisecting geometrically; each factor is one trial with fresh
  token content, so trials share no cached prefix).
- Per trial: mean/p90 TTFT, preemptions (``vllm:num_preemptions_total``), pages resumed requests
  loaded from the pool (``vllm:pof_loaded_pages``), tokens recomputed (tokens the engines
  computed, ``vllm:iteration_tokens_total``, beyond the first-touch minimum: every prompt block
  once in the cluster plus the decode steps; a lower bound: vLLM 0.32 counts a request's first
  prefill only, so the re-prefill of a request resumed without the pool is in no counter and
  shows as ``preemptions``; concurrent first touches of one prefix count once each), and the
  fragmentation spread (mean and p90 over time of max - min ``vllm:kv_cache_usage_perc`` across
  servers).

``ratio`` = pof goodput / static goodput; ``ratio_vs_best`` = pof goodput / the best other set-up.
Needs vLLM (and vllm-router for the ``cache_aware`` set-ups) in this Python.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pof_connector.bench import BenchError, Progress, nearest_rank
from pof_connector.bench.capacity_fleet import SETUPS, VLLM_ROUTER_SETUPS, Fleet, FleetSpec, UsageSampler
from pof_connector.bench.capacity_replay import Replay, Trial
from pof_connector.bench.capacity_trace import (
    Mix,
    TraceRequest,
    check_sessions,
    fragmenting_trace,
    read_trace,
    summary,
    tokens_for,
)
from pof_connector.bench.make_model import PRESETS
from pof_connector.bench.vllm_server import build_model, stream_completion

SLO_MULTIPLE = 4.0
"""The SLO is this many times the unloaded p90 TTFT."""
DECODE_STEPS = 16
"""Tokens each unloaded sample decodes after its first: their pace is the engine's step time at that context."""
BATCH_STEPS = 32
"""Tokens each request of a decode-batch sample decodes."""
BATCH_PROMPT = 32
"""Prompt tokens of each request of a decode-batch sample (short: its prefill barely delays the others)."""
BLOCK = 128
MAX_FACTOR, MIN_FACTOR = 16.0, 1 / 16
ROUTER_NICE = -10
"""The routers' default niceness in this bench: a router that a deployment runs on a host of its own
is not made to wait behind the engines that share this host's cores (``--router-nice``)."""


def _vocab(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def model_dir(spec: str | None) -> Path:
    """``--model``: a model directory, or the name of a local preset, built when missing (default
    ``tiny``). Raises :class:`BenchError` when it is neither."""
    if spec is None or (spec in PRESETS and not Path(spec).is_dir()):
        return build_model(spec or "tiny")
    path = Path(spec)
    if not (path / "config.json").is_file():
        raise BenchError(f"--model: {spec!r} is neither a model directory (with a config.json) nor a local "
                         f"preset ({', '.join(sorted(PRESETS))})")
    return path


def check_context(model: Path, spec_name: str | None, max_len: int, longest: int) -> None:
    """Refuse a model whose position range is shorter than the trace's longest context (vLLM would
    refuse to start each server, after minutes)."""
    positions = json.loads((model / "config.json").read_text()).get("max_position_embeddings")
    if isinstance(positions, int) and positions < max_len:
        fits = sorted(n for n, p in PRESETS.items() if p.max_position_embeddings >= max_len)
        hint = f"; local presets long enough: {', '.join(fits)}" if fits else ""
        raise BenchError(f"--model {spec_name or 'tiny'}: the model holds {positions} positions, the trace's longest "
                         f"context needs {max_len} ({longest} tokens and an answer){hint} (--model NAME)")


ERROR_LINE = re.compile(r"(\b\w+(?:Error|Exception): .*)")
"""An error's name and message on a log line (after the engine's log prefix)."""


def start_fleet(setup: str, model: Path, workdir: Path, spec: FleetSpec, progress: Progress,
                attempts: int = 2) -> Fleet:
    """``setup``'s processes, started afresh (new ports, new logs) when one failed to start: a
    start is not what the bench measures, and two engines starting side by side can race for a
    port. The last failure is raised with its cause."""
    for attempt in range(1, attempts + 1):
        try:
            return Fleet(setup, model, workdir / f"start-{attempt}", spec).start()
        except (RuntimeError, TimeoutError) as e:
            if attempt == attempts:
                raise
            progress(f"{setup}: start {attempt} failed ({failure_cause(str(e))}); starting again")
    raise AssertionError("unreachable")


def failure_cause(message: str) -> str:
    """The first line of a failed start's message that names an error: the root cause, which
    :meth:`~.service_process.ServiceProcess.tail` puts before the launcher's own traceback; else
    the message's first line."""
    named = ERROR_LINE.search(message)
    return (named.group(1) if named else message.split("\n", 1)[0]).strip()[:300]


def prompt_sizes(trace: list[TraceRequest]) -> list[int]:
    """Each request's prompt length, answers counted at their ``max_tokens``."""
    context: dict[str, int] = {}
    out = []
    for r in trace:
        n = context.get(r.session, r.system_tokens) + r.turn_tokens
        out.append(n)
        context[r.session] = n + r.max_tokens
    return out


def unloaded_ttft(url: str, trace: list[TraceRequest], vocab: int,
                  samples: int) -> tuple[list[tuple[int, float]], list[tuple[int, int, float]]]:
    """(prompt tokens, TTFT) of cold prompts of the trace's sizes (evenly spread quantiles), one at a
    time; and for each, (1, prompt tokens, seconds per decode step) from the pace of the
    :data:`DECODE_STEPS` tokens it decodes after its first."""
    sizes = sorted(prompt_sizes(trace))
    picks = [sizes[min(len(sizes) - 1, round(q * (len(sizes) - 1) / max(samples - 1, 1)))] for q in range(samples)]
    out, steps = [], []
    for i, n in enumerate(picks):
        times: list[float] = []
        ttft, _ = stream_completion(url, tokens_for("unloaded", str(i), n, vocab, variant=-1),
                                    max_tokens=DECODE_STEPS + 1, chunk_times=times)
        out.append((n, ttft))
        if len(times) > 1:
            steps.append((1, n, (times[-1] - times[0]) / (len(times) - 1)))
    return out, steps


def host_sharing(urls: list[str], vocab: int, prompt_tokens: int, pairs: int = 2) -> list[tuple[int, float, float]]:
    """(prompt tokens, mean TTFT of a cold prompt on the first server alone, mean TTFT of one on
    every server at once), ``pairs`` times each: how much the servers, sharing this host's cores,
    slow each other (``pof sim calibrate``'s ``host_slowdown``)."""
    def cold(tag: str, url: str) -> float:
        return stream_completion(url, tokens_for("host", tag, prompt_tokens, vocab, variant=-1), max_tokens=1)[0]
    alone = [cold(f"alone/{k}", urls[0]) for k in range(pairs)]
    together: list[float] = []
    with ThreadPoolExecutor(len(urls)) as ex:
        for k in range(pairs):
            together += ex.map(lambda i, k=k: cold(f"both/{k}/{i}", urls[i]), range(len(urls)))
    return [(prompt_tokens, statistics.fmean(alone), statistics.fmean(together))]


def batch_decode_steps(url: str, vocab: int, batches: list[int]) -> list[tuple[int, int, float]]:
    """(batch, prompt tokens, seconds per decode step) of ``batch`` short requests decoding
    together: each decodes :data:`BATCH_STEPS` tokens; the step time is the mean pace of their
    middle halves, when all of them are decoding (the first and last quarters overlap the others'
    prefills and ends)."""
    out = []
    for b in batches:
        paces: list[float] = []

        def one(i: int, b: int = b, paces: list[float] = paces) -> None:
            times: list[float] = []
            stream_completion(url, tokens_for("batch", f"{b}/{i}", BATCH_PROMPT, vocab, variant=-1),
                              max_tokens=BATCH_STEPS + 1, chunk_times=times)
            q = len(times) // 4
            if len(times) - 2 * q > 1:
                paces.append((times[-q - 1] - times[q]) / (len(times) - 2 * q - 1))
        with ThreadPoolExecutor(b) as ex:
            list(ex.map(one, range(b)))
        if paces:
            out.append((b, BATCH_PROMPT, statistics.fmean(paces)))
    return out


class SetupRun:
    """The trials of one set-up on its fleet."""

    def __init__(self, fleet: Fleet, trace: list[TraceRequest], vocab: int, slo_s: float, progress: Progress) -> None:
        self.fleet = fleet
        self.trace = trace
        self.vocab = vocab
        self.slo_s = slo_s
        self.progress = progress
        self.trials: list[dict[str, Any]] = []
        self._variant = 0

    def trial(self, factor: float) -> bool:
        self._variant += 1
        self._quiesce()
        replay = Replay(self.trace, self.fleet.route(self.trace), vocab=self.vocab, variant=self._variant, block=BLOCK,
                        slo_s=self.slo_s, timeout_s=max(60.0, 20 * self.slo_s))
        before = self.fleet.counters()
        with UsageSampler(self.fleet) as sampler:
            trial = replay.run(factor)
        self._quiesce()
        after = self.fleet.counters()
        row = trial.figures(self.slo_s)
        row.update(sampler.figures())
        row.update(self._work(trial, before, after, row["mean_ttft_s"]))
        row["backends"] = _shares(trial)
        self.trials.append(row)
        verdict = "meets" if row["passed"] else "misses"
        errors = ", ".join(f"{n} {why}" for why, n in row["errors"].items() if not why.startswith("not sent"))
        self.progress(f"  {self.fleet.setup} x{factor:.3g} ({row['offered_rps']:.2f} req/s): p90 TTFT "
                      f"{row['p90_ttft_s']} s, {row['late']} late, {row['failed']} failed"
                      f"{f' ({errors})' if errors else ''}{', gave up' if trial.gave_up else ''}, "
                      f"{row['preemptions']:.0f} preemptions, spread {row['spread_mean']} "
                      f"(floor {row['spread_floor_mean']}), mean TTFT parts {_parts_text(row['ttft_parts_s'])}"
                      f"{_router_text(row)} -> {verdict} the SLO")
        return bool(row["passed"])

    def _work(self, trial: Trial, before: dict[str, float], after: dict[str, float],
              mean_ttft_s: float | None) -> dict[str, Any]:
        """What the engines did in ``trial`` (their counters ``before`` and ``after`` it);
        ``mean_ttft_s``: the trial's mean TTFT as the client saw it (``None``: no first token)."""
        d = {k: after[k] - before[k] for k in after}
        computed = d["vllm:iteration_tokens_total_sum"]
        sent = [o for o in trial.outcomes if not o.error.startswith("not sent")]
        minimum = sum(o.first_touch_tokens + o.max_tokens - 1 for o in sent)
        return {"preemptions": d["vllm:num_preemptions_total"], "tokens_computed": int(computed),
                "tokens_first_touch": minimum, "tokens_recomputed": int(max(0.0, computed - minimum)),
                "engine_hit_tokens": int(d["vllm:prefix_cache_hits_total"]),
                "pool_hit_tokens": int(d["vllm:external_prefix_cache_hits_total"]),
                "pool_loaded_pages": int(d["vllm:pof_loaded_pages_total"]),
                "ttft_parts_s": ttft_parts(d, mean_ttft_s),
                "engine_first_tokens": {k.split(":")[0]: int(v) for k, v in d.items() if k.endswith(":first_tokens")}}

    def _quiesce(self, timeout_s: float = 120.0) -> None:
        """Until no request runs or waits (streams closed by a give-up are aborted a moment later),
        then drop the engines' prefix caches."""
        deadline = time.monotonic() + timeout_s
        while not self.fleet.idle():
            if time.monotonic() > deadline:
                raise BenchError(f"{self.fleet.setup}: the servers still had requests {timeout_s:g} s after a trial")
            time.sleep(0.5)
        self.fleet.reset_caches()

    def search(self, max_trials: int) -> float:
        """The highest passing factor found within ``max_trials`` trials (0: none passed)."""
        return bounded_search(self.trial, max_trials)


def _router_text(row: dict[str, Any]) -> str:
    """The pof router's own mean time before sending on, part of ``outside`` ('' without one)."""
    spent = row.get("router_decision_mean_s")
    return "" if spent is None else f" (of it pof router before sending {spent})"


def _parts_text(parts: dict[str, float | None]) -> str:
    return " / ".join(f"{k} {v}" for k, v in parts.items() if k != "engine")


def ttft_parts(d: dict[str, float], client_mean_s: float | None) -> dict[str, float | None]:
    """Where a trial's mean TTFT went, from the engines' own histograms (``d``: their increase over
    the trial): ``queue`` (waiting for the scheduler: KV memory or a batch slot), ``prefill`` (first
    scheduled to first token: compute, or a load from the pool), ``engine`` (vLLM's TTFT, from
    arrival at its API server), and ``outside`` = the client's mean TTFT - ``engine``: HTTP, the
    router, the tokenizer. Means over requests that got a first token; ``None``: none did."""
    def mean(name: str) -> float | None:
        n = d.get(f"vllm:{name}_seconds_count", 0.0)
        return round(d[f"vllm:{name}_seconds_sum"] / n, 4) if n > 0 else None
    engine = mean("time_to_first_token")
    return {"queue": mean("request_queue_time"), "prefill": mean("request_prefill_time"), "engine": engine,
            "outside": round(client_mean_s - engine, 4) if client_mean_s is not None and engine is not None else None}


def bounded_search(trial: Callable[[float], bool], max_trials: int) -> float:
    """The goodput search: ``trial(factor)`` at 1, doubling while it passes (up to
    ``MAX_FACTOR``) or halving while it fails (down to ``MIN_FACTOR``), then bisecting
    geometrically between the highest pass and the lowest failure; the highest passing factor
    found within ``max_trials`` trials (0: none passed). ``pof sim validate`` replays a bench with
    this same search."""
    passed, failed = 0.0, math.inf
    f = 1.0
    for _ in range(max_trials):
        if trial(f):
            passed = f
        else:
            failed = f
        if math.isinf(failed):
            if f >= MAX_FACTOR:
                break
            f *= 2
        elif passed == 0.0:
            if f <= MIN_FACTOR:
                break
            f /= 2
        else:
            f = math.sqrt(passed * failed)
    return passed


def _shares(trial: Trial) -> dict[str, int]:
    out: dict[str, int] = {}
    for o in trial.outcomes:
        if o.backend:
            out[o.backend] = out.get(o.backend, 0) + 1
    return out


def router_latency(fleet: Fleet, vocab: int, n: int = 5) -> float | None:
    """Mean TTFT through the set-up's router minus direct, on cold 512-token prompts (None: no router)."""
    if fleet.router is None:
        return None
    direct, routed = [], []
    for i in range(n):
        direct.append(stream_completion(fleet.servers[i % len(fleet.servers)].url,
                                        tokens_for("latency-direct", str(i), 512, vocab, variant=-2), 2)[0])
        routed.append(stream_completion(fleet.router.url, tokens_for("latency-routed", str(i), 512, vocab,
                                                                     variant=-2), 2)[0])
    return round(statistics.fmean(routed) - statistics.fmean(direct), 4)


def run(*, servers: int, quick: bool, trace_file: Path | None, seed: int, model: str | None, setups: list[str],
        kv_tokens: int | None, max_trials: int | None, plot: Path | None, progress: Progress,
        router_nice: int = ROUTER_NICE, audit_rates: tuple[float, ...] = ()) -> dict[str, Any]:
    """``audit_rates``: after the set-ups, the pof set-up again with each ``audit.sample_rate``
    (same trace, same SLO): what the audit costs in goodput."""
    if servers not in (2, 3):
        raise BenchError(f"--servers must be 2 or 3, got {servers}")
    bad = [s for s in setups if s not in SETUPS]
    if bad or not setups:
        raise BenchError(f"unknown set-ups {bad}; allowed: {', '.join(SETUPS)}")
    mix = Mix().scaled(0.3) if quick else Mix()
    trace = read_trace(trace_file) if trace_file is not None else fragmenting_trace(seed, mix)
    check_sessions(trace)
    info = summary(trace)
    if trace_file is None:
        info["mix"] = dataclasses.asdict(mix)       # what `pof sim validate` rebuilds the trace from
    model_path = model_dir(model)
    vocab = _vocab(model_path)
    longest = int(info["max_context_tokens"])
    max_len = -(-(longest + 64) // BLOCK) * BLOCK
    check_context(model_path, model, max_len, longest)
    kv = kv_tokens or 2 * longest          # one server holds two of the longest sessions
    # vLLM keeps one block aside (its null block): a server of max_len // BLOCK blocks refuses to start
    blocks = max(-(-kv // BLOCK), max_len // BLOCK + 1)
    spec = FleetSpec(servers=servers, kv_blocks=blocks, block=BLOCK, max_model_len=max_len, max_num_seqs=8,
                     router_nice=router_nice)
    trials = max_trials or (2 if quick else 6)
    progress(f"trace: {info['requests']} requests, {info['sessions']} sessions ({info['multi_turn_sessions']} "
             f"multi-turn, longest context {longest} tokens), {info['tenants']} tenants over {info['span_s']} s; "
             f"{servers} servers with KV for {blocks * BLOCK} tokens each; set-ups {', '.join(setups)}")
    workdir = Path(tempfile.mkdtemp(prefix="pof-bench-capacity-", dir="/tmp"))
    results: dict[str, dict[str, Any]] = {}
    slo_s = unloaded = 0.0
    samples: list[tuple[int, float]] = []
    steps: list[tuple[int, int, float]] = []
    host: list[tuple[int, float, float]] = []
    skipped: dict[str, str] = {}
    audits: dict[str, dict[str, Any]] = {}

    def one(name: str, fleet_spec: FleetSpec, k: int) -> dict[str, Any]:
        """Start ``name``'s fleet, search its goodput, stop it."""
        nonlocal slo_s, unloaded, samples, steps, host
        progress(f"{name}: starting {servers} vLLM servers ...")
        # a number, not the name: vLLM's and the index's unix sockets live below it (107 bytes at most)
        fleet = start_fleet(name, model_path, workdir / str(k), fleet_spec, progress)
        try:
            if not slo_s:
                samples, steps = unloaded_ttft(fleet.servers[0].url, trace, vocab, samples=6 if quick else 10)
                steps += batch_decode_steps(fleet.servers[0].url, vocab,
                                            sorted({max(fleet_spec.max_num_seqs // 2, 1), fleet_spec.max_num_seqs}))
                if len(fleet.servers) > 1:
                    host = host_sharing([v.url for v in fleet.servers], vocab, int(nearest_rank(
                        sorted(n for n, _ in samples), 0.9)))
                unloaded = nearest_rank(sorted(t for _, t in samples), 0.9)
                slo_s = SLO_MULTIPLE * unloaded
                progress(f"unloaded p90 TTFT {unloaded:.3f} s -> SLO {slo_s:.3f} s (x{SLO_MULTIPLE:g})")
            added = router_latency(fleet, vocab)
            nice = fleet.router.niceness() if fleet.router is not None else None
            index_nice = fleet.index_niceness()
            setup = SetupRun(fleet, trace, vocab, slo_s, progress)
            best = setup.search(trials)
        finally:
            fleet.stop()
        base_rps = len(trace) / max(trace[-1].at, 1e-3)
        at_best = next((t for t in setup.trials if t["passed"] and t["factor"] == round(best, 4)), None)
        at_one = next((t for t in setup.trials if t["factor"] == 1.0), None)
        failed = [t["factor"] for t in setup.trials if not t["passed"]]
        row = {"goodput_rps": round(best * base_rps, 4), "goodput_factor": round(best, 4),
               "failed_at_rps": round(min(failed) * base_rps, 4) if failed else None,
               "router_added_latency_s": added, "router_nice": nice, "index_nice": index_nice,
               "at_goodput": at_best, "at_reference_load": at_one,
               "trials": sorted(setup.trials, key=lambda t: t["factor"])}
        progress(f"{name}: goodput {row['goodput_rps']} req/s (x{best:.3g})")
        return row

    try:
        for k, name in enumerate(setups):
            if name in VLLM_ROUTER_SETUPS and shutil.which("vllm-router") is None \
                    and not (Path(sys.executable).parent / "vllm-router").exists():
                skipped[name] = "vllm-router is not installed"
                progress(f"{name}: skipped ({skipped[name]})")
                continue
            results[name] = one(name, spec, k)
        for j, rate in enumerate(audit_rates):       # the pof set-up again, auditing that share of its hits
            progress(f"pof with audit.sample_rate {rate:g}:")
            audits[f"{rate:g}"] = one("pof", dataclasses.replace(spec, audit_rate=rate), len(setups) + j)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out = _report(results, skipped, info, slo_s, unloaded, spec, seed, trace_file, model_path)
    if audits:
        base = results.get("pof", {})
        out["audit"] = {rate: {"goodput_rps": row["goodput_rps"], "failed_at_rps": row["failed_at_rps"],
                               "vs_no_audit": (round(row["goodput_rps"] / base["goodput_rps"], 4)
                                               if base.get("goodput_rps") else None),
                               "at_reference_load": row["at_reference_load"]}
                        for rate, row in audits.items()}
    out["unloaded_samples"] = [[n, round(t, 4)] for n, t in samples]
    out["decode_samples"] = [[b, n, round(t, 5)] for b, n, t in steps]
    out["host_samples"] = [[n, round(a, 4), round(t, 4)] for n, a, t in host]
    if plot is not None:
        draw(results, slo_s, plot)
        out["plot"] = str(plot)
    return out


def _report(results: dict[str, dict[str, Any]], skipped: dict[str, str], info: dict[str, Any], slo_s: float,
            unloaded: float, spec: FleetSpec, seed: int, trace_file: Path | None, model: Path) -> dict[str, Any]:
    def ratio(a: float | None, b: float | None) -> float | None:
        """``a / b``; ``None`` when either is unknown or ``b`` is 0 (JSON has no infinity)."""
        if a is None or b is None or b <= 0:
            return None
        return round(a / b, 4)

    pof = results.get("pof", {}).get("goodput_rps")
    static = results.get("static", {}).get("goodput_rps")
    others = [n for n in results if n != "pof"]
    best = max(others, key=lambda n: (results[n]["goodput_rps"], results[n].get("failed_at_rps") or math.inf),
               default=None)

    def ratio_range(a: str, b: str | None) -> list[float | None] | None:
        """Where ``a``'s goodput / ``b``'s lies, given that each set-up's goodput is at least the load
        it passed and below the lowest load it failed: [low, high] (``None``: unbounded that side)."""
        if a not in results or b is None or b not in results:
            return None
        ra, rb = results[a], results[b]
        return [ratio(ra["goodput_rps"], rb.get("failed_at_rps")), ratio(ra.get("failed_at_rps"), rb["goodput_rps"])]

    def spread(name: str, field: str = "spread_mean") -> float | None:
        row = (results.get(name) or {}).get("at_reference_load") or {}
        return row.get(field)

    return {
        "bench": "capacity",
        "ratio": ratio(pof, static),
        "ratio_vs_best": ratio(pof, results[best]["goodput_rps"]) if best else None,
        "best_other": best,
        "ratio_range": ratio_range("pof", "static"),
        "ratio_vs_best_range": ratio_range("pof", best),
        "goals": {"ratio": 2.0, "ratio_vs_best": 1.3, "pof_spread_vs_static": 0.5},
        "fragmentation": {"pof_spread_mean": spread("pof"), "static_spread_mean": spread("static"),
                          "pof_vs_static": ratio(spread("pof"), spread("static")),
                          "pof_floor_mean": spread("pof", "spread_floor_mean"),
                          "static_floor_mean": spread("static", "spread_floor_mean"),
                          "pof_floor_vs_static": ratio(spread("pof", "spread_floor_mean"), spread("static"))},
        "slo_s": round(slo_s, 4), "slo_multiple": SLO_MULTIPLE, "unloaded_p90_ttft_s": round(unloaded, 4),
        "setups": results, "skipped": skipped,
        "trace": {**info, "source": str(trace_file) if trace_file else f"seeded fragmenting mix (seed {seed})",
                  "seed": seed},
        "cluster": {"servers": spec.servers, "kv_tokens_per_server": spec.kv_blocks * spec.block,
                    "block": spec.block, "max_model_len": spec.max_model_len, "max_num_seqs": spec.max_num_seqs,
                    "dtype": spec.dtype, "model": str(model), "router_nice": spec.router_nice},
        "note": f"goodput = highest offered load (trace arrival rate x factor, bounded search) with p90 TTFT <= SLO "
                "and no failed request (0: none of the loads tried passed; failed_at_rps: the lowest that failed, "
                "so goodput lies below it); ratio = pof / static goodput (null when static's is 0), ratio_range: "
                "[pof goodput / static failed_at, pof failed_at / static goodput], what the search's resolution "
                f"allows; SLO = {SLO_MULTIPLE:g} x the unloaded p90 TTFT of the trace's prompt sizes "
                "(cold, one at a time; unloaded_samples: [prompt tokens, TTFT s] of each; decode_samples: "
                "[batch, prompt tokens, s per decode step] of each alone, then of short requests decoding together; "
                "host_samples: [prompt tokens, cold TTFT on one server alone, on every server at once]); "
                "ratio_vs_best = pof / the best other set-up's goodput (best_other); "
                "spread = max - min vllm:kv_cache_usage_perc across servers, sampled every 0.5 s, at the reference "
                "load (factor 1); spread_floor: the least spread any placement of the requests running at each "
                "sample could have had (a server running one request shows its size, which goes whole to one "
                "server; several count as divisible), so pof_floor_vs_static above the goal means no placement of "
                "pof's requests meets it; tokens_recomputed = engine-computed tokens (first prefills + decode, as vLLM "
                "counts them) beyond every prompt block once in the cluster plus decode steps: a lower bound, since a "
                "re-prefill after a preemption is in no vLLM counter (see preemptions, pool_loaded_pages)",
    }


def draw(results: dict[str, dict[str, Any]], slo_s: float, path: Path,
         title: str = "pof bench capacity: p90 TTFT vs offered load") -> None:
    """p90 TTFT against offered load, one line per set-up, the SLO as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ceiling = 2 * slo_s       # where a trial that failed or gave up (no p90) is marked
    for name, row in results.items():
        pts = [(t["offered_rps"], t["p90_ttft_s"] if t["passed"] or t["p90_ttft_s"] is not None else ceiling)
               for t in row["trials"]]
        if pts:
            line = ax.plot(*zip(*pts, strict=True), marker="o", label=name)[0]
            failed = [(t["offered_rps"], ceiling) for t in row["trials"] if not t["passed"] and t["p90_ttft_s"] is None]
            if failed:
                ax.scatter(*zip(*failed, strict=True), marker="x", s=80, color=line.get_color())
    ax.axhline(ceiling, linestyle=":", color="lightgrey", label="failed / gave up (x)")
    ax.axhline(slo_s, linestyle="--", color="grey", label=f"SLO {slo_s:.2f} s")
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("p90 TTFT (s)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["SETUPS", "SLO_MULTIPLE", "bounded_search", "draw", "prompt_sizes", "run"]
