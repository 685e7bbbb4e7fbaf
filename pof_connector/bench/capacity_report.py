"""What ``pof bench capacity`` reports: each set-up's row, the run's JSON and its plot (kept apart
from :mod:`.capacity`, which runs the set-ups)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pof_connector.bench.capacity_fleet import FleetSpec
from pof_connector.bench.capacity_search import GoodputSearch, ratio_bound
from pof_connector.bench.capacity_stats import interval_of, median_row, recompute_headroom, spread

SLO_MULTIPLE = 4.0
"""The SLO is this many times the unloaded p90 TTFT."""


def setup_row(search: GoodputSearch, trials: list[dict[str, Any]], base_rps: float,
              verdicts: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A set-up's result: its goodput, the trials around it, whether it is only a bound;
    ``verdicts``: each factor's trial outcomes and verdict, as run (:mod:`.capacity_stats`)."""
    best = search.passed
    failed = search.failed
    return {"goodput_rps": round(best * base_rps, 4),
            "failed_at_rps": None if math.isinf(failed) else round(failed * base_rps, 4),
            **search.summary(),
            "factors": verdicts if verdicts is not None else [{"factor": round(f, 4), "trials": [ok], "passed": ok}
                                                              for f, ok in search.trials],
            "at_goodput": next((t for t in trials if t["passed"] and t["factor"] == round(best, 4)), None),
            "at_reference_load": next((t for t in trials if t["factor"] == 1.0), None),
            "trials": sorted(trials, key=lambda t: t["factor"])}


def merge_namings(results: dict[str, dict[str, Any]], keys: list[str]
                  ) -> tuple[dict[str, dict[str, Any]], dict[str, Any] | None]:
    """``results`` with static's namings (``keys``, e.g. ``static``, ``static@1``) folded into one
    ``static`` row, the median naming's (:func:`~.capacity_stats.median_row`; its key in the row's
    ``naming_key``), in the set-ups' order; and their spread (``None``: static did not run)."""
    runs = {k: results[k] for k in keys if k in results}
    if not runs:
        return results, None
    middle = median_row(runs)
    out: dict[str, dict[str, Any]] = {}
    for k, row in results.items():
        if k not in runs:
            out[k] = row
        elif "static" not in out:
            out["static"] = {**runs[middle], "naming_key": middle}
    goodputs = [r["goodput_rps"] for r in runs.values()]
    return out, {"median": middle, "goodput_rps": spread(goodputs),
                 "namings": {k: {"naming": r.get("naming"), "goodput_rps": r["goodput_rps"],
                                 "failed_at_rps": r.get("failed_at_rps"), "at_bound": r.get("at_bound")}
                             for k, r in runs.items()},
                 "rows": {k: r for k, r in runs.items() if k != middle}}


def report(results: dict[str, dict[str, Any]], skipped: dict[str, str], info: dict[str, Any], slo_s: float,
           unloaded: float, spec: FleetSpec, seed: int, trace_file: Path | None, model: Path,
           search: dict[str, Any] | None = None) -> dict[str, Any]:
    """``search``: the search's limits, as the JSON states them."""
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

    def bound(a: str, b: str | None) -> str | None:
        """Whether ``a``'s goodput / ``b``'s is only a bound (a set-up cut while still passing)."""
        if a not in results or b is None or b not in results:
            return None
        return ratio_bound(bool(results[a].get("at_bound")), bool(results[b].get("at_bound")))

    def spread(name: str, field: str = "spread_mean") -> float | None:
        row = (results.get(name) or {}).get("at_reference_load") or {}
        return row.get(field)

    return {
        "bench": "capacity",
        "ratio": ratio(pof, static),
        "ratio_vs_best": ratio(pof, results[best]["goodput_rps"]) if best else None,
        "ratio_bound": bound("pof", "static"),
        "ratio_vs_best_bound": bound("pof", best),
        "best_other": best,
        "at_bound": sorted(n for n, r in results.items() if r.get("at_bound")),
        "search": search,
        "ratio_range": ratio_range("pof", "static"),
        "ratio_vs_best_range": ratio_range("pof", best),
        # every ratio as its interval: pof against each set-up, and the steps that separate causes
        "intervals": {f"{a}/{b}": interval_of(results[a], results[b])
                      for a, b in [*(("pof", n) for n in others), ("pof", "pof_private"), ("pof_private", "kv_aware"),
                                   ("kv_aware", "cache_aware"), ("cache_aware", "round_robin")]
                      if a in results and b in results and a != b},
        # how far a pool could lift each other set-up by saving its recomputed tokens
        "headroom": {n: recompute_headroom(results[n]) for n in others},
        "ratio_vs_best_ceiling": (recompute_headroom(results[best]) or {}).get("ceiling") if best else None,
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
                    "tier_bytes": spec.tier_bytes,
                    "block": spec.block, "max_model_len": spec.max_model_len, "max_num_seqs": spec.max_num_seqs,
                    "dtype": spec.dtype, "model": str(model), "router_nice": spec.router_nice,
                    "router_sched": spec.router_sched},
        "note": f"goodput = highest offered load (trace arrival rate x factor: doubled from 1 while it passes, halved "
                "while it fails, then bisected geometrically until the lowest failure is within search.resolution "
                "of the highest pass) with p90 TTFT <= SLO and no failed request (0: none of the loads tried passed; "
                "failed_at_rps: the lowest that failed, so goodput lies below it); no factor ceiling: each set-up "
                "searches for search.time_budget_s_per_setup s of trials (no trial starts after it; the one "
                "running ends), then the time the others left unspent goes to those still passing, highest "
                "goodput first, on fresh servers; a set-up cut while still passing (by that time, max_trials, "
                "search.burst_factor: past it the whole trace arrives within one SLO, so a faster replay loads "
                "the fleet no more, or the safety_cap factor) is at_bound (bound_reason): its goodput is only a "
                "lower bound, and ratio_bound / ratio_vs_best_bound say so of a ratio taken from it: lower (the "
                "true ratio is at least it), upper (at most it), unknown (both set-ups at a bound), null (measured); "
                "search.order: [factor, passed] of each factor as decided; factors: each factor's trial outcomes "
                "and verdict (search.trials_per_factor trials, search.pass_rule: majority = more than half met the "
                "SLO, decided as soon as certain; all = every one); trials: every trial (repeat: its index at its "
                "factor); intervals[A/B]: A's goodput / B's as the search brackets allow, [A goodput / B failed_at, "
                "A failed_at / B goodput], text '>= x' where A never failed (its goodput only a lower bound), "
                "'<= y' where B never failed; static runs under search.static_namings namings (the hash salted): "
                "setups.static is the median naming's row, static_namings their spread; memory: every set-up's "
                "engines read back memory.tier_bytes_total of tier (private per server, or pof's one shared "
                "region), tier_evicted_pages / tier_peak_used_bytes per trial from vllm:pof_evicted_pages and "
                "vllm:pof_tier_used_bytes (sampled every 0.5 s); tier_hit_tokens: prompt tokens loaded from a tier, "
                "pool_hit_tokens: those of them loaded from the shared pool (pof only); "
                "ratio = pof / static goodput (null when static's is 0), ratio_range: "
                "[pof goodput / static failed_at, pof failed_at / static goodput], what the search's resolution "
                f"allows; SLO = {SLO_MULTIPLE:g} x the unloaded p90 TTFT of the trace's prompt sizes "
                "(cold, one at a time; unloaded_samples: [prompt tokens, TTFT s] of each; decode_samples: "
                "[batch, prompt tokens, s per decode step] of each alone, then of short requests decoding together; "
                "host_samples: [prompt tokens, cold TTFT on one server alone, on every server at once]; "
                "host_sharing_slowdown: their median ratio, near 1 when the servers compute side by side); "
                "ratio_vs_best = pof / the best other set-up's goodput (best_other); "
                "spread = max - min vllm:kv_cache_usage_perc across servers, sampled every 0.5 s, at the reference "
                "load (factor 1); spread_floor: the least spread any placement of the requests running at each "
                "sample could have had (a server running one request shows its size, which goes whole to one "
                "server; several count as divisible), so pof_floor_vs_static above the goal means no placement of "
                "pof's requests meets it; tokens_recomputed = engine-computed tokens (first prefills + decode, as vLLM "
                "counts them) beyond every prompt block once in the cluster plus decode steps: a lower bound, since a "
                "re-prefill after a preemption is in no vLLM counter (see preemptions, pool_loaded_pages); "
                "headroom[S]: S's tokens_recomputed / tokens_computed over its trials at its lowest failing factor "
                "(its goodput's when it never failed), and ceiling = 1 / (1 - that share): on engines bound by "
                "their throughput, what saving every recomputed token could add to S's goodput (tokens, not "
                "seconds: a guide, not a proof); ratio_vs_best_ceiling: best_other's ceiling, so a ratio_vs_best "
                "goal above it cannot be met by saved work on this host and trace",
    }


def draw(results: dict[str, dict[str, Any]], slo_s: float, path: Path,
         title: str = "pof bench capacity: p90 TTFT vs offered load") -> None:
    """p90 TTFT against offered load, one line per set-up, the SLO as a dashed line; below it, for
    every set-up whose reference-load trial sampled them, each server's KV usage over that trial
    (one server full while another idles is what a pool is for)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    usage = {name: u for name, row in results.items()
             if (u := (row.get("at_reference_load") or {}).get("kv_usage")) and u.get("t_s")}
    if usage:
        fig = plt.figure(figsize=(max(7.0, 2.4 * len(usage)), 7.5))
        grid = fig.add_gridspec(2, len(usage), height_ratios=(3, 2))
        ax = fig.add_subplot(grid[0, :])
    else:
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
    for i, (name, u) in enumerate(usage.items()):
        panel = fig.add_subplot(grid[1, i])
        for k, series in enumerate(u["by_server"]):
            panel.plot(u["t_s"], [100 * x for x in series], label=f"n{k}")
        panel.set_ylim(0, 100)
        panel.set_title(f"{name}: KV use at x1", fontsize=9)
        panel.set_xlabel("s into the trial", fontsize=8)
        if i == 0:
            panel.set_ylabel("KV cache used (%)", fontsize=8)
            panel.legend(fontsize=7)
        panel.tick_params(labelsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["SLO_MULTIPLE", "draw", "report", "setup_row"]
