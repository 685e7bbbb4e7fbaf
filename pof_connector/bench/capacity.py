"""``pof bench capacity``: how much load a KV-constrained cluster serves within a TTFT SLO, with and
without the pool, on real vLLM CPU servers (issue 14).

The workload is a trace (:mod:`.capacity_trace`: ``--trace FILE`` or the seeded fragmenting mix),
replayed open-loop (:mod:`.capacity_replay`) through each set-up's own front door (its router, or
the client's choice) after a warm-up (:func:`~.capacity_probe.warm_up`), each on freshly started
servers with the same total of tier memory (:mod:`.capacity_setups`: ``static`` over several
namings, ``round_robin``, ``cache_aware``, ``kv_aware``, ``pof_private``, ``pof``).

- **SLO**: ``SLO_MULTIPLE`` x the unloaded TTFT, measured at the start of the run: the p90 TTFT of
  a sample of the trace's prompt sizes, sent one at a time, cold, to an idle server.
- **Goodput** of a set-up: the highest offered load (the trace's arrival rate x a factor) at which
  p90 TTFT stays within the SLO and no request fails, found by :mod:`.capacity_search` (doubling or
  halving from 1, then bisecting geometrically; no factor ceiling: each set-up searches for a time
  budget, and one cut by it while still passing is reported ``at_bound``; time the others left
  unspent goes afterwards to those, highest goodput first, on fresh servers). Each factor runs
  ``--trials-per-factor`` trials (:mod:`.capacity_stats`: it passes by ``--pass-rule``), each with
  fresh token content, so trials share no cached prefix.
- Per trial: mean/p90 TTFT, preemptions (``vllm:num_preemptions_total``), pages resumed requests
  loaded from the pool (``vllm:pof_loaded_pages``), tokens recomputed (tokens the engines
  computed, ``vllm:iteration_tokens_total``, beyond the first-touch minimum: every prompt block
  once in the cluster plus the decode steps; a lower bound: vLLM 0.32 counts a request's first
  prefill only, so the re-prefill of a request resumed without the pool is in no counter and
  shows as ``preemptions``; concurrent first touches of one prefix count once each), and the
  fragmentation spread (mean and p90 over time of max - min ``vllm:kv_cache_usage_perc`` across
  servers), and the tiers' evictions (``vllm:pof_evicted_pages``) and peak use
  (``vllm:pof_tier_used_bytes``, sampled).

``ratio`` = pof goodput / static goodput (the median naming); ``ratio_vs_best`` = pof goodput / the
best other set-up; ``ratio_bound`` / ``ratio_vs_best_bound`` say when either is only a bound, and
``intervals`` give every ratio as the interval the search's brackets allow. Needs vLLM (and
vllm-router for its set-ups) in this Python: checked before anything starts.
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
from pathlib import Path
from typing import Any

from pof_connector.bench import BenchError, Progress, nearest_rank
from pof_connector.bench.capacity_fleet import Fleet, FleetSpec
from pof_connector.bench.capacity_probe import (
    batch_decode_steps,
    host_sharing,
    prompt_sizes,
    router_latency,
    unloaded_ttft,
)
from pof_connector.bench.capacity_report import SLO_MULTIPLE, draw, merge_namings, setup_row
from pof_connector.bench.capacity_report import report as _report
from pof_connector.bench.capacity_search import (
    BURST,
    RESOLUTION,
    SAFETY_CAP,
    GoodputSearch,
    bounded_search,
    burst_factor,
    ratio_bound,
    take_turns,
)
from pof_connector.bench.capacity_setup_run import BLOCK, SetupRun
from pof_connector.bench.capacity_setups import (
    SETUPS,
    VLLM_ROUTER_SETUPS,
    kv_bytes_per_token,
    tier_share,
)
from pof_connector.bench.capacity_stats import PASS_RULES, TRIALS_PER_FACTOR, needed
from pof_connector.bench.capacity_trace import (
    Mix,
    check_sessions,
    fragmenting_trace,
    read_trace,
    summary,
)
from pof_connector.bench.front_door import SCHEDS, can_use_rr
from pof_connector.bench.make_model import PRESETS
from pof_connector.bench.needs import MATPLOTLIB, VLLM, VLLM_ROUTER, Need, check
from pof_connector.bench.vllm_server import build_model

TIME_BUDGET_S, QUICK_TIME_BUDGET_S = 900.0, 300.0
"""Seconds of trials each set-up's search gets per trial of a factor (``--time-budget-s``)."""
STATIC_NAMINGS = 3
"""``static`` runs under this many namings (``--static-namings``; ``--quick``: 1)."""
TIER_KV_MULTIPLE = 2
"""Default ``--tier-bytes``: this many times the engines' KV memory, in all (each server's tier holds
twice its engine's KV cache: enough to keep what the engines evict for a while, not the whole trace)."""
FIXED_SHARES = "fixed shares"
"""The ``pof_cost_variants`` label of the pof set-up run with ``tiers.cxl.trade: false``."""
MIN_RESUME_S = 60.0
"""Left-over time below which no set-up is restarted to search further (a start alone takes about that)."""
ROUTER_NICE = -10
"""The routers' default niceness in this bench: a router that a deployment runs on a host of its own
is not made to wait behind the engines that share this host's cores (``--router-nice``)."""


def needs(setups: list[str], plot: bool) -> list[Need]:
    """The packages a run of ``setups`` (and ``--plot``) needs. No set-up uses LMCache: the
    baselines' per-server tiers are pof's connector's (:mod:`.capacity_setups` says why)."""
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


def run(*, servers: int, quick: bool, trace_file: Path | None, seed: int, model: str | None, setups: list[str],
        kv_tokens: int | None, max_trials: int | None, progress: Progress, time_budget_s: float | None = None,
        resolution: float = RESOLUTION, router_nice: int = ROUTER_NICE, audit_rates: tuple[float, ...] = (),
        tier_bytes: int | None = None, trials_per_factor: int | None = None, pass_rule: str = "majority",
        static_namings: int | None = None, router_sched: str = "auto",
        pof_costs: tuple[tuple[tuple[str, float], ...], ...] = (), interleave: bool = False,
        fixed_shares: bool = False) -> dict[str, Any]:
    """``audit_rates``: after the set-ups, the pof set-up again with each ``audit.sample_rate``
    (same trace, same SLO): what the audit costs in goodput. ``pof_costs``: after those, the pof
    set-up again with each of these settings of its router's ``cost`` section (an A/B of a
    routing rule under the same SLO, e.g. ``(("displacement_weight", 0.0),)``). ``fixed_shares``:
    then the pof set-up again with its servers keeping their first shares of the region
    (``tiers.cxl.trade: false``): what trading slots buys. ``time_budget_s``: seconds of trials
    each set-up's search gets (default :data:`TIME_BUDGET_S` per trial of a factor); ``max_trials``:
    a cap on its factors besides (default: none; ``quick``: 2). ``tier_bytes``: tier memory in all
    (default :data:`TIER_KV_MULTIPLE` x the engines' KV); ``trials_per_factor`` / ``pass_rule``:
    :mod:`.capacity_stats` (default 3, ``quick`` 1); ``static_namings``: how many namings
    ``static`` runs under (default :data:`STATIC_NAMINGS`, ``quick`` 1). ``router_sched``: the front
    door's scheduling class, ``rr``, ``nice`` or ``auto`` (``rr`` where permitted; :mod:`.front_door`).
    ``interleave``: every fleet up at once and their searches advanced one factor at a time in
    turn, the order rotated each round (else one set-up after another, in the order given)."""
    if servers not in (2, 3):
        raise BenchError(f"--servers must be 2 or 3, got {servers}")
    bad = [s for s in setups if s not in SETUPS]
    if bad or not setups:
        raise BenchError(f"unknown set-ups {bad}; allowed: {', '.join(SETUPS)}")
    repeats = trials_per_factor or (1 if quick else TRIALS_PER_FACTOR)
    namings = static_namings or (1 if quick else STATIC_NAMINGS)
    try:
        needed(repeats, pass_rule)
    except ValueError as e:
        raise BenchError(f"--trials-per-factor / --pass-rule: {e}") from e
    check(needs(setups, plot=False), "capacity")
    if router_sched not in ("auto", *SCHEDS):
        raise BenchError(f"--router-sched: {router_sched!r}; allowed: auto, {', '.join(SCHEDS)}")
    permitted = can_use_rr() if router_sched != "nice" else False
    if router_sched == "rr" and not permitted:
        raise BenchError("--router-sched rr: this user may not use SCHED_RR (it needs root or CAP_SYS_NICE); "
                         "run with --router-sched nice")
    sched = "rr" if permitted else "nice"
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
                     router_nice=router_nice, router_sched=sched)
    kv_bytes = servers * blocks * BLOCK * kv_bytes_per_token(json.loads((model_path / "config.json").read_text()),
                                                            spec.dtype)
    total = tier_bytes or TIER_KV_MULTIPLE * kv_bytes
    try:
        share = tier_share(total, servers)
    except ValueError as e:
        raise BenchError(str(e)) from e
    spec = dataclasses.replace(spec, tier_bytes=share * servers)
    budget = time_budget_s or (QUICK_TIME_BUDGET_S if quick else TIME_BUDGET_S * repeats)
    limit = max_trials or (2 if quick else None)
    # (search key, set-up, spec): static once per naming, "static" being the bare hash of earlier runs
    runs = [(n if n != "static" or k == 0 else f"static@{k}", n, dataclasses.replace(spec, naming=k))
            for n in setups for k in range(namings if n == "static" else 1)]
    total_budget = budget * (len(runs) + len(audit_rates) + len(pof_costs) + int(fixed_shares))
    plan: dict[str, Any] = {"time_budget_s_per_setup": budget, "time_budget_s_total": total_budget,
            "max_trials": limit, "resolution": resolution, "safety_cap": SAFETY_CAP, "min_resume_s": MIN_RESUME_S,
            "trials_per_factor": repeats, "pass_rule": pass_rule, "static_namings": namings,
            "side_by_side": interleave}
    progress(f"trace: {info['requests']} requests, {info['sessions']} sessions ({info['multi_turn_sessions']} "
             f"multi-turn, longest context {longest} tokens), {info['tenants']} tenants over {info['span_s']} s; "
             f"{servers} servers with KV for {blocks * BLOCK} tokens each ({kv_bytes / 2**20:.0f} MiB in all), "
             f"tiers of {spec.tier_bytes / 2**20:.0f} MiB in all; set-ups {', '.join(k for k, _, _ in runs)}; "
             f"search: {budget:g} s of trials per set-up ({total_budget:g} s in all, the unspent "
             f"part going to set-ups still passing when theirs ran out), {repeats} trial(s) a factor "
             f"({pass_rule} pass), bisecting to {resolution:.0%}"
             f"{f', at most {limit} factors each' if limit else ''}, factor cap x{SAFETY_CAP:g}; routers, index "
             f"and relays {'in SCHED_RR' if sched == 'rr' else f'at niceness {router_nice}'}")
    workdir = Path(tempfile.mkdtemp(prefix="pof-bench-capacity-", dir="/tmp"))
    results: dict[str, dict[str, Any]] = {}
    slo_s = unloaded = 0.0
    samples: list[tuple[int, float]] = []
    steps: list[tuple[int, int, float]] = []
    host: list[tuple[int, float, float]] = []
    audits: dict[str, dict[str, Any]] = {}
    variants: dict[str, dict[str, Any]] = {}
    searches: dict[str, GoodputSearch] = {}
    rows: dict[str, list[dict[str, Any]]] = {}
    verdicts: dict[str, list[dict[str, Any]]] = {}
    starts = itertools.count()       # a fresh work directory per fleet (a set-up may start twice)

    def start(name: str, fleet_spec: FleetSpec, key: str) -> tuple[SetupRun, dict[str, Any]]:
        """``name``'s fleet started and warmed up, its search (``searches[key]``) ready to go on; the
        fleet's facts for its row. The first fleet of the run measures the SLO."""
        nonlocal slo_s, unloaded, samples, steps, host
        searches.setdefault(key, GoodputSearch(max_trials=limit, resolution=resolution))
        progress(f"{key}: starting {servers} vLLM servers ...")
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
                progress(f"unloaded p90 TTFT {unloaded:.3f} s -> SLO {slo_s:.3f} s (x{SLO_MULTIPLE:g}); past "
                         f"x{burst_factor(float(info['span_s']), slo_s):.3g} the whole trace arrives within one SLO")
            # past the burst factor a faster replay loads the fleet no more: a pass there is a bound
            search = searches[key]
            search.cap, search.cap_reason = burst_factor(float(info["span_s"]), slo_s), BURST
            plan["burst_factor"] = round(search.cap, 4)
            facts = {"router_added_latency_s": router_latency(fleet, vocab),
                     "router_nice": fleet.router.niceness() if fleet.router is not None else None,
                     "index_nice": fleet.index_niceness(), "front_door_sched": fleet.front_door_sched(),
                     "naming": fleet_spec.naming if name == "static" else None}
            setup_run = SetupRun(fleet, trace, vocab, slo_s, progress, rows.setdefault(key, []),
                                 trials_per_factor=repeats, pass_rule=pass_rule,
                                 verdicts=verdicts.setdefault(key, []), label=key)
            setup_run.warm_up()
        except BaseException:
            fleet.stop()
            raise
        return setup_run, facts

    def finish(key: str, facts: dict[str, Any]) -> dict[str, Any]:
        """The row of ``key``'s search so far (its fleet stopped)."""
        search = searches[key]
        row = setup_row(search, rows[key], len(trace) / max(trace[-1].at, 1e-3), verdicts[key])
        row.update(facts)
        progress(f"{key}: goodput {row['goodput_rps']} req/s (x{search.passed:.3g}"
                 + (f", at a bound: {row['bound_reason']}, still passing" if row["at_bound"] else
                    f", failed at x{search.failed:.3g}" if not math.isinf(search.failed) else "")
                 + f"; {search.stop}, {search.spent_s:.0f} s of trials)")
        return row

    def one(name: str, fleet_spec: FleetSpec, key: str, budget_s: float) -> dict[str, Any]:
        """Start ``name``'s fleet, carry its goodput search on for ``budget_s`` seconds, stop it."""
        setup_run, facts = start(name, fleet_spec, key)
        search = searches[key]
        try:
            progress(f"{key}: searching for {budget_s:.0f} s" + (f" more, from x{search.passed:.3g} passed"
                                                                   if search.trials else ""))
            setup_run.search(search, budget_s)
        finally:
            setup_run.fleet.stop()
        return finish(key, facts)

    def side_by_side(jobs: list[tuple[str, str, FleetSpec]], budget_s: float) -> dict[str, dict[str, Any]]:
        """Every job's fleet up at once, their searches advanced one factor at a time in turn, the
        order rotated each round (AB, BA, AB, ...), each for ``budget_s`` seconds of trials: a host
        whose speed drifts over the run shifts every set-up alike instead of the last ones."""
        opened: list[tuple[str, SetupRun, dict[str, Any]]] = []
        try:
            for key, name, job_spec in jobs:
                setup_run, facts = start(name, job_spec, key)
                opened.append((key, setup_run, facts))
            progress(f"searching {len(opened)} set-ups side by side, {budget_s:.0f} s of trials each")
            take_turns({key: (searches[key], setup_run.decide) for key, setup_run, _ in opened}, budget_s)
        finally:
            for _, setup_run, _ in opened:
                setup_run.fleet.stop()
        return {key: finish(key, facts) for key, _, facts in opened}

    # the pof set-up again, auditing that share of its hits; then with its router's cost model set otherwise
    extra = [(f"audit {rate:g}", "pof", dataclasses.replace(spec, audit_rate=rate)) for rate in audit_rates]
    extra += [(f"pof cost {cost_label(cost)}", "pof", dataclasses.replace(spec, router_cost=cost))
              for cost in pof_costs]
    if fixed_shares:
        extra.append((FIXED_SHARES, "pof", dataclasses.replace(spec, region_trade=False)))
    try:
        if interleave:
            done = side_by_side([*runs, *extra], budget)
        else:
            done = {key: one(name, run_spec, key, budget) for key, name, run_spec in [*runs, *extra]}
        results.update({key: done[key] for key, _, _ in runs})
        audits.update({f"{rate:g}": done[f"audit {rate:g}"] for rate in audit_rates})
        variants.update({cost_label(cost): done[f"pof cost {cost_label(cost)}"] for cost in pof_costs})
        if fixed_shares:
            variants[FIXED_SHARES] = done[FIXED_SHARES]
        # what the set-ups that ended early left goes to those still passing, the highest first, so
        # the ones that rank highest are the ones measured to the end
        left = total_budget - sum(s.spent_s for s in searches.values())
        for key, name, run_spec in sorted((r for r in runs if searches[r[0]].resumable),
                                          key=lambda r: -searches[r[0]].passed):
            if left < MIN_RESUME_S:
                break
            progress(f"{key}: {left:.0f} s left over, searching further on fresh servers")
            spent = searches[key].spent_s
            results[key] = one(name, run_spec, key, left)
            left -= searches[key].spent_s - spent
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results, static_spread = merge_namings(results, [k for k, n, _ in runs if n == "static"])
    out = _report(results, {}, info, slo_s, unloaded, spec, seed, trace_file, model_path, search=plan)
    out["static_namings"] = static_spread
    # each set-up's planned tiers, summed: the same total by construction (tests hold it to that)
    sums = {n: spec.plan(n, workdir, "redis://index", "region", port=lambda: 0).tier_bytes() for n in setups}
    out["memory"] = {"tier_bytes_total": spec.tier_bytes, "tier_bytes_per_server": share,
                     "kv_cache_bytes_total": kv_bytes, "tier_bytes_by_setup": sums}
    base = results.get("pof", {})
    if audits:
        out["audit"] = {rate: {"goodput_rps": row["goodput_rps"], "failed_at_rps": row["failed_at_rps"],
                               "at_bound": row["at_bound"],
                               **dict(zip(("vs_no_audit", "vs_no_audit_bound"), against(row, base), strict=True)),
                               "at_reference_load": row["at_reference_load"]}
                        for rate, row in audits.items()}
    if variants:
        out["pof_cost_variants"] = {
            label: {**dict(zip(("vs_pof", "vs_pof_bound"), against(row, base), strict=True)), **row}
            for label, row in variants.items()}
    out["unloaded_samples"] = [[n, round(t, 4)] for n, t in samples]
    out["decode_samples"] = [[b, n, round(t, 5)] for b, n, t in steps]
    out["host_samples"] = [[n, round(a, 4), round(t, 4)] for n, a, t in host]
    out["host_sharing_slowdown"] = sharing_slowdown(host)
    return out


def against(row: dict[str, Any], base: dict[str, Any]) -> tuple[float | None, str | None]:
    """``row``'s goodput over ``base``'s (``None``: base has none) and what that ratio is
    (:func:`~.capacity_search.ratio_bound`): a pof re-run (audit, cost variant) against pof."""
    ratio = round(row["goodput_rps"] / base["goodput_rps"], 4) if base.get("goodput_rps") else None
    return ratio, ratio_bound(row["at_bound"], base.get("at_bound", False))


def cost_label(cost: tuple[tuple[str, float], ...]) -> str:
    """``displacement_weight=0``: how a ``--pof-cost`` variant is named in the progress and the JSON."""
    return ",".join(f"{k}={v:g}" for k, v in cost)


def sharing_slowdown(host: list[tuple[int, float, float]]) -> float | None:
    """How many times longer a cold prompt takes when every server computes one at once than on one
    server alone (median of the host samples; ``None`` without any). Near 1 the servers compute
    side by side as separate hosts would; well above 1 they share this host's cores, so a set-up
    that spreads load over them adds no compute here, and one that keeps a server idle gains."""
    ratios = sorted(t / a for _, a, t in host if a > 0)
    return round(statistics.median(ratios), 2) if ratios else None


__all__ = ["FIXED_SHARES", "PASS_RULES", "QUICK_TIME_BUDGET_S", "RESOLUTION", "SETUPS", "SLO_MULTIPLE",
           "STATIC_NAMINGS", "TIER_KV_MULTIPLE", "TIME_BUDGET_S", "TRIALS_PER_FACTOR", "bounded_search", "draw",
           "needs", "prompt_sizes", "run"]
