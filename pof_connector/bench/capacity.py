"""``pof bench capacity``: how much load a KV-constrained cluster serves within a TTFT SLO, with and
without the pool, on real vLLM CPU servers (issue 14).

The workload is a trace (:mod:`.capacity_trace`: ``--trace FILE`` or the seeded fragmenting mix),
replayed open-loop (:mod:`.capacity_replay`) through each set-up (:mod:`.capacity_fleet`:
``static``, ``round_robin``, ``cache_aware``, ``cache_aware_offload``, ``pof``), each on freshly started
servers.

- **SLO**: ``SLO_MULTIPLE`` x the unloaded TTFT, measured at the start of the run: the p90 TTFT of
  a sample of the trace's prompt sizes, sent one at a time, cold, to an idle server.
- **Goodput** of a set-up: the highest offered load (the trace's arrival rate x a factor) at which
  p90 TTFT stays within the SLO and no request fails, found by :mod:`.capacity_search` (doubling or
  halving from 1, then bisecting geometrically; no factor ceiling: each set-up searches for a time
  budget, and one cut by it while still passing is reported ``at_bound``; time the others left
  unspent goes afterwards to those, highest goodput first, on fresh servers; each factor is one
  trial with fresh token content, so trials share no cached prefix).
- Per trial: mean/p90 TTFT, preemptions (``vllm:num_preemptions_total``), pages resumed requests
  loaded from the pool (``vllm:pof_loaded_pages``), tokens recomputed (tokens the engines
  computed, ``vllm:iteration_tokens_total``, beyond the first-touch minimum: every prompt block
  once in the cluster plus the decode steps; a lower bound: vLLM 0.32 counts a request's first
  prefill only, so the re-prefill of a request resumed without the pool is in no counter and
  shows as ``preemptions``; concurrent first touches of one prefix count once each), and the
  fragmentation spread (mean and p90 over time of max - min ``vllm:kv_cache_usage_perc`` across
  servers).

``ratio`` = pof goodput / static goodput; ``ratio_vs_best`` = pof goodput / the best other set-up;
``ratio_bound`` / ``ratio_vs_best_bound`` say when either is only a bound. Needs vLLM (and
vllm-router for the ``cache_aware`` set-ups) in this Python: checked before anything starts.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pof_connector.bench import BenchError, Progress, nearest_rank
from pof_connector.bench.capacity_fleet import SETUPS, VLLM_ROUTER_SETUPS, Fleet, FleetSpec, UsageSampler
from pof_connector.bench.capacity_replay import Replay, Trial
from pof_connector.bench.capacity_report import SLO_MULTIPLE, draw, setup_row
from pof_connector.bench.capacity_report import report as _report
from pof_connector.bench.capacity_search import RESOLUTION, SAFETY_CAP, GoodputSearch, bounded_search, ratio_bound
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
from pof_connector.bench.needs import MATPLOTLIB, VLLM, VLLM_ROUTER, Need, check
from pof_connector.bench.vllm_server import build_model, stream_completion

DECODE_STEPS = 16
"""Tokens each unloaded sample decodes after its first: their pace is the engine's step time at that context."""
BATCH_STEPS = 32
"""Tokens each request of a decode-batch sample decodes."""
BATCH_PROMPT = 32
"""Prompt tokens of each request of a decode-batch sample (short: its prefill barely delays the others)."""
BLOCK = 128
TIME_BUDGET_S, QUICK_TIME_BUDGET_S = 900.0, 300.0
"""Seconds of trials each set-up's search gets (``--time-budget-s``)."""
MIN_RESUME_S = 60.0
"""Left-over time below which no set-up is restarted to search further (a start alone takes about that)."""
ROUTER_NICE = -10
"""The routers' default niceness in this bench: a router that a deployment runs on a host of its own
is not made to wait behind the engines that share this host's cores (``--router-nice``)."""


def needs(setups: list[str], plot: bool) -> list[Need]:
    """The packages a run of ``setups`` (and ``--plot``) needs. No set-up uses LMCache:
    ``cache_aware_offload``'s per-server tier is pof's connector."""
    out = [VLLM]
    if any(s in VLLM_ROUTER_SETUPS for s in setups):
        out.append(VLLM_ROUTER)
    if plot:
        out.append(MATPLOTLIB)
    return out


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

    def __init__(self, fleet: Fleet, trace: list[TraceRequest], vocab: int, slo_s: float, progress: Progress,
                 trials: list[dict[str, Any]] | None = None) -> None:
        """``trials``: the rows of an earlier fleet of this set-up, when its search goes on here."""
        self.fleet = fleet
        self.trace = trace
        self.vocab = vocab
        self.slo_s = slo_s
        self.progress = progress
        self.trials: list[dict[str, Any]] = trials if trials is not None else []
        self._variant = len(self.trials)

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

    def search(self, search: GoodputSearch, budget_s: float | None) -> GoodputSearch:
        """``search`` carried on with this fleet for ``budget_s`` seconds (``None``: until it ends)."""
        return search.run(self.trial, budget_s)


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
        kv_tokens: int | None, max_trials: int | None, progress: Progress, time_budget_s: float | None = None,
        resolution: float = RESOLUTION, router_nice: int = ROUTER_NICE,
        audit_rates: tuple[float, ...] = ()) -> dict[str, Any]:
    """``audit_rates``: after the set-ups, the pof set-up again with each ``audit.sample_rate``
    (same trace, same SLO): what the audit costs in goodput. ``time_budget_s``: seconds of trials
    each set-up's search gets (default :data:`TIME_BUDGET_S`); ``max_trials``: a cap on its trials
    besides (default: none; ``quick``: 2)."""
    if servers not in (2, 3):
        raise BenchError(f"--servers must be 2 or 3, got {servers}")
    bad = [s for s in setups if s not in SETUPS]
    if bad or not setups:
        raise BenchError(f"unknown set-ups {bad}; allowed: {', '.join(SETUPS)}")
    check(needs(setups, plot=False), "capacity")
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
    budget = time_budget_s or (QUICK_TIME_BUDGET_S if quick else TIME_BUDGET_S)
    limit = max_trials or (2 if quick else None)
    runs = len(setups) + len(audit_rates)
    plan = {"time_budget_s_per_setup": budget, "time_budget_s_total": budget * runs, "max_trials": limit,
            "resolution": resolution, "safety_cap": SAFETY_CAP, "min_resume_s": MIN_RESUME_S}
    progress(f"trace: {info['requests']} requests, {info['sessions']} sessions ({info['multi_turn_sessions']} "
             f"multi-turn, longest context {longest} tokens), {info['tenants']} tenants over {info['span_s']} s; "
             f"{servers} servers with KV for {blocks * BLOCK} tokens each; set-ups {', '.join(setups)}; "
             f"search: {budget:g} s of trials per set-up ({budget * runs:g} s in all, the unspent part going to "
             f"set-ups still passing when theirs ran out), bisecting to {resolution:.0%}"
             f"{f', at most {limit} trials each' if limit else ''}, factor cap x{SAFETY_CAP:g}")
    workdir = Path(tempfile.mkdtemp(prefix="pof-bench-capacity-", dir="/tmp"))
    results: dict[str, dict[str, Any]] = {}
    slo_s = unloaded = 0.0
    samples: list[tuple[int, float]] = []
    steps: list[tuple[int, int, float]] = []
    host: list[tuple[int, float, float]] = []
    audits: dict[str, dict[str, Any]] = {}
    searches: dict[str, GoodputSearch] = {}
    rows: dict[str, list[dict[str, Any]]] = {}
    starts = itertools.count()       # a fresh work directory per fleet (a set-up may start twice)

    def one(name: str, fleet_spec: FleetSpec, key: str, budget_s: float) -> dict[str, Any]:
        """Start ``name``'s fleet, carry its goodput search (``searches[key]``) on for ``budget_s``
        seconds, stop it."""
        nonlocal slo_s, unloaded, samples, steps, host
        search = searches.setdefault(key, GoodputSearch(max_trials=limit, resolution=resolution))
        progress(f"{name}: starting {servers} vLLM servers ...")
        # a number, not the name: vLLM's and the index's unix sockets live below it (107 bytes at most)
        fleet = start_fleet(name, model_path, workdir / str(next(starts)), fleet_spec, progress)
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
            progress(f"{name}: searching for {budget_s:.0f} s" + (f" more, from x{search.passed:.3g} passed"
                                                                    if search.trials else ""))
            SetupRun(fleet, trace, vocab, slo_s, progress, rows.setdefault(key, [])).search(search, budget_s)
        finally:
            fleet.stop()
        row = setup_row(search, rows[key], len(trace) / max(trace[-1].at, 1e-3))
        row.update({"router_added_latency_s": added, "router_nice": nice, "index_nice": index_nice})
        progress(f"{name}: goodput {row['goodput_rps']} req/s (x{search.passed:.3g}"
                 + (f", at a bound: {row['bound_reason']}, still passing" if row["at_bound"] else
                    f", failed at x{search.failed:.3g}" if not math.isinf(search.failed) else "")
                 + f"; {search.stop}, {search.spent_s:.0f} s of trials)")
        return row

    try:
        for name in setups:
            results[name] = one(name, spec, name, budget)
        for rate in audit_rates:       # the pof set-up again, auditing that share of its hits
            progress(f"pof with audit.sample_rate {rate:g}:")
            audits[f"{rate:g}"] = one("pof", dataclasses.replace(spec, audit_rate=rate), f"audit {rate:g}", budget)
        # what the set-ups that ended early left goes to those still passing, the highest first, so
        # the ones that rank highest are the ones measured to the end
        left = budget * runs - sum(s.spent_s for s in searches.values())
        for name in sorted((n for n in setups if searches[n].resumable), key=lambda n: -searches[n].passed):
            if left < MIN_RESUME_S:
                break
            progress(f"{name}: {left:.0f} s left over, searching further on fresh servers")
            spent = searches[name].spent_s
            results[name] = one(name, spec, name, left)
            left -= searches[name].spent_s - spent
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out = _report(results, {}, info, slo_s, unloaded, spec, seed, trace_file, model_path, search=plan)
    if audits:
        base = results.get("pof", {})
        out["audit"] = {rate: {"goodput_rps": row["goodput_rps"], "failed_at_rps": row["failed_at_rps"],
                               "at_bound": row["at_bound"],
                               "vs_no_audit": (round(row["goodput_rps"] / base["goodput_rps"], 4)
                                               if base.get("goodput_rps") else None),
                               "vs_no_audit_bound": ratio_bound(row["at_bound"], base.get("at_bound", False)),
                               "at_reference_load": row["at_reference_load"]}
                        for rate, row in audits.items()}
    out["unloaded_samples"] = [[n, round(t, 4)] for n, t in samples]
    out["decode_samples"] = [[b, n, round(t, 5)] for b, n, t in steps]
    out["host_samples"] = [[n, round(a, 4), round(t, 4)] for n, a, t in host]
    return out


__all__ = ["QUICK_TIME_BUDGET_S", "RESOLUTION", "SETUPS", "SLO_MULTIPLE", "TIME_BUDGET_S", "bounded_search", "draw",
           "needs", "prompt_sizes", "run"]
