"""``pof bench capacity``: its arguments and its table (registered by :mod:`pof_connector.bench.cli`)."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from rich.table import Table

from pof_connector.bench import BenchError
from pof_connector.bench import capacity as bench_capacity
from pof_connector.bench.front_door import SCHEDS  # starts vLLM servers and routers; imports no vLLM
from pof_connector.bench.needs import check
from pof_connector.cli_support import out_console, print_json, progress

SHARED_HOST_SLOWDOWN = 1.5
"""A host-sharing slowdown (``host_sharing_slowdown``) from which the table warns that the servers
do not compute side by side."""


def _rates(text: str) -> list[float]:
    from pof_connector.bench.cli import _rates as rates

    return rates(text)


def _setups(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    bad = [n for n in names if n not in bench_capacity.SETUPS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"set-ups are some of {', '.join(bench_capacity.SETUPS)}, got {text!r}")
    return names


def _cost(text: str) -> tuple[tuple[str, float], ...]:
    """``KEY=VALUE[,KEY=VALUE]``: numeric settings of `pof router`'s ``cost`` section, checked
    against it here (a bad key or value fails before any server starts)."""
    from pydantic import ValidationError

    from pof_connector.router.router_config import CostConfig

    allowed = [k for k, f in CostConfig.model_fields.items() if f.annotation is float]
    out: list[tuple[str, float]] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in allowed:
            raise argparse.ArgumentTypeError(f"{part!r} is not KEY=VALUE with KEY one of "
                                             f"{', '.join(allowed)}")
        try:
            out.append((key, float(value)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{key}={value!r} is not a number") from None
    if not out:
        raise argparse.ArgumentTypeError(f"KEY=VALUE with KEY one of {', '.join(allowed)}")
    try:
        CostConfig.model_validate(dict(out))
    except ValidationError as e:
        first = e.errors()[0]
        raise argparse.ArgumentTypeError(f"{text!r}: {first['loc'][0]}: {first['msg']}") from None
    return tuple(out)


def _size(text: str) -> int:
    from pof_connector.config import ConfigError, parse_size

    try:
        return parse_size(text, "--tier-bytes")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def cmd_bench_capacity(args: argparse.Namespace) -> int:
    setups = args.setups or (["static", "pof"] if args.quick else list(bench_capacity.SETUPS))
    check(bench_capacity.needs(setups, plot=args.plot is not None), "capacity")     # before any server starts
    result = bench_capacity.run(servers=args.servers, quick=args.quick, trace_file=args.trace, seed=args.seed,
                                model=args.model, setups=setups, kv_tokens=args.kv_tokens,
                                max_trials=args.max_trials, time_budget_s=args.time_budget_s,
                                resolution=args.resolution, progress=progress,
                                router_nice=args.router_nice, router_sched=args.router_sched,
                                audit_rates=tuple(args.audit_rates), pof_costs=tuple(args.pof_cost),
                                tier_bytes=args.tier_bytes, trials_per_factor=args.trials_per_factor,
                                pass_rule=args.pass_rule, static_namings=args.static_namings,
                                interleave=args.side_by_side, fixed_shares=args.pof_fixed_shares)
    if args.plot is not None:
        result["plot"] = str(args.plot)
    # the run's result leaves first: a table or a plot that fails after it loses nothing
    save_json(result, args.out, quiet=args.json)
    if args.json:
        print_json(result)
    else:
        print_table(result)
    if args.plot is not None:
        plot(result, args.plot)
    return 0


def save_json(result: dict[str, Any], out: Path | None, quiet: bool) -> None:
    """``result`` to ``out``; without ``--out`` and ``--json`` to a file of its own (the table shows
    less than the JSON holds, and the run took long)."""
    if out is None and quiet:
        return
    if out is None:
        fd, name = tempfile.mkstemp(prefix="pof-bench-capacity-", suffix=".json", dir="/tmp")
        out = Path(name)
        with open(fd, "w") as f:
            json.dump(result, f)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result) + "\n")
    progress(f"result JSON: {out}")


def plot(result: dict[str, Any], path: Path) -> None:
    """Draw ``--plot``; a failure is an error after the result, not instead of it."""
    try:
        variants = {f"pof ({label})": row for label, row in result.get("pof_cost_variants", {}).items()}
        bench_capacity.draw({**result["setups"], **variants}, result["slo_s"], path)
    except (ImportError, OSError, ValueError, RuntimeError) as e:
        raise BenchError(f"--plot {path}: {type(e).__name__}: {e} (the result above is complete)") from e


def print_table(result: dict[str, Any]) -> None:
    t = result["trace"]
    table = Table(title=f"capacity: {t['requests']} requests, {t['sessions']} sessions, {result['cluster']['servers']} "
                        f"servers, SLO p90 TTFT <= {result['slo_s']:.3f} s", title_justify="left")
    for name in ("set-up", "goodput req/s (< failed at)", "mean TTFT s", "p90 TTFT s", "preemptions",
                 "recomputed tokens", "spread mean", "spread p90", "spread floor mean"):
        table.add_column(name, justify="left" if name == "set-up" else "right")
    for name, row in result["setups"].items():
        ref = row["at_reference_load"] or {}
        below = row.get("failed_at_rps")
        limit = f" (< {below:.3f})" if below is not None else f" (>=, {row['bound_reason']})" if row["at_bound"] else ""
        table.add_row(name, f"{row['goodput_rps']:.3f}" + limit,
                      str(ref.get("mean_ttft_s")), str(ref.get("p90_ttft_s")),
                      f"{ref.get('preemptions', 0):.0f}", str(ref.get("tokens_recomputed")),
                      str(ref.get("spread_mean")), str(ref.get("spread_p90")), str(ref.get("spread_floor_mean")))
    out = out_console()
    out.print(table)
    for pair, interval in result.get("intervals", {}).items():
        out.print(f"goodput {pair}: {interval['text']}")
    spread = result.get("static_namings")
    if spread:
        g = spread["goodput_rps"]
        out.print(f"static over {len(spread['namings'])} namings: goodput min {g['min']} / median {g['median']} / "
                  f"max {g['max']} req/s (the table's static row: {spread['median']})")
    out.print(f"ratio pof / static goodput [bold]{result['ratio']}[/bold]{_bound(result['ratio_bound'])} (range "
              f"{result['ratio_range']}), pof / best other ({result['best_other']}) {result['ratio_vs_best']}"
              f"{_bound(result['ratio_vs_best_bound'])} (range {result['ratio_vs_best_range']}); "
              f"spread pof / static {result['fragmentation']['pof_vs_static']} (pof's floor / static's spread "
              f"{result['fragmentation']['pof_floor_vs_static']}: no placement of pof's requests goes below it) "
              "(TTFT, preemptions, tokens and spread at the reference load, factor 1)")
    best = (result.get("headroom") or {}).get(result.get("best_other") or "")
    if best:
        out.print(f"headroom: {result['best_other']} recomputed {best['recomputed_share']:.1%} of its engines' tokens "
                  f"at x{best['factor']:g}, so saving all of them could lift its goodput about "
                  f"{best['ceiling']:g}x at most (engines bound by throughput)")
    for name, row in result["setups"].items():
        at = row.get("at_goodput") or {}
        if at.get("router_decision_mean_s") is not None:
            stages = ", ".join(f"{k} {v}" for k, v in (at.get("router_stage_mean_s") or {}).items())
            out.print(f"{name}: pof router's own time before sending, mean at goodput {at['router_decision_mean_s']} s"
                      + (f" ({stages})" if stages else ""))
    slowdown = result.get("host_sharing_slowdown")
    if slowdown is not None and slowdown >= SHARED_HOST_SLOWDOWN:
        out.print(f"[yellow]note[/yellow]: a prompt computed on every server at once took {slowdown}x as long as on "
                  "one alone: the servers share this host's cores, so spreading load over them adds no compute here, "
                  "and a set-up that keeps a server idle gains from it (separate hosts would not behave so)")
    for label, row in result.get("pof_cost_variants", {}).items():
        what = ("fixed shares of the region (tiers.cxl.trade: false)" if label == bench_capacity.FIXED_SHARES
                else f"cost {label}")
        out.print(f"pof with {what}: goodput {row['goodput_rps']} req/s, "
                  f"{row['vs_pof']}{_bound(row['vs_pof_bound'])} of pof with the defaults")
    for rate, row in result.get("audit", {}).items():
        out.print(f"pof with audit.sample_rate {rate}: goodput {row['goodput_rps']} req/s, "
                  f"{row['vs_no_audit']}{_bound(row['vs_no_audit_bound'])} of pof without it")


def _bound(kind: str | None) -> str:
    """How a ratio that is only a bound reads in the table ('' for a measured one)."""
    return {None: "", "lower": " (at least: a set-up at a bound)", "upper": " (at most: a set-up at a bound)",
            "unknown": " (both at a bound: unknown)"}[kind]


def add_capacity_parser(bsub: Any) -> None:
    p = bsub.add_parser("capacity", help="goodput within a TTFT SLO of KV-constrained servers, with and without "
                                         "the pool",
                        description="Replays a fragmenting multi-tenant trace (long multi-turn sessions, short "
                                    "requests of tenants sharing system prompts, open loop) on 2 or 3 real vLLM "
                                    "CPU servers whose KV memory is bounded, every set-up with the same total of "
                                    "tier memory (--tier-bytes): static (hash affinity, over several namings), "
                                    "round_robin, vllm-router cache_aware, vllm-router kv_aware (fed by pof "
                                    "relays), pof router with private tiers (pof_private) and pof router + "
                                    "shared pool (pof), each on freshly started servers; searches each set-up's "
                                    "goodput (highest load with p90 TTFT within the SLO and no failure, "
                                    "--trials-per-factor trials a factor; no factor ceiling, a time budget per "
                                    "set-up). Needs vLLM (and vllm-router for cache_aware / kv_aware, matplotlib "
                                    "for --plot): checked before anything starts.")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--trace", type=Path, metavar="FILE",
                   help='replay a JSONL trace: one {"at", "session", "tenant", "system_tokens", "turn_tokens", '
                        '"max_tokens"} per line (default: the seeded fragmenting mix)')
    p.add_argument("--plot", type=Path, metavar="FILE.png",
                   help="write p90 TTFT vs offered load (needs matplotlib, checked before anything starts; drawn "
                        "after the result is out)")
    p.add_argument("--out", type=Path, metavar="FILE.json",
                   help="also write the result JSON to FILE (before any table or plot; without it and --json, "
                        "the JSON goes to a file in /tmp, named on stderr)")
    p.add_argument("--quick", action="store_true",
                   help="a short trace, static and pof only, two factors each, one trial a factor, one naming "
                        "(what CI runs)")
    p.add_argument("--servers", type=int, default=2, choices=(2, 3), help="vLLM servers (default 2)")
    p.add_argument("--setups", type=_setups, default=None,
                   help=f"comma-separated, of {','.join(bench_capacity.SETUPS)} (default all; --quick: static,pof)")
    p.add_argument("--seed", type=int, default=1, help="seed of the default trace (default 1)")
    p.add_argument("--kv-tokens", type=int, default=None,
                   help="KV cache tokens per server (default: twice the trace's longest session context)")
    p.add_argument("--time-budget-s", type=float, default=None, metavar="S",
                   help=f"seconds of trials each set-up's goodput search gets (default "
                        f"{bench_capacity.TIME_BUDGET_S:g} x --trials-per-factor; --quick "
                        f"{bench_capacity.QUICK_TIME_BUDGET_S:g}); the "
                        "search has no factor ceiling: it doubles the load while the set-up meets the SLO until "
                        "this runs out (the set-up is then reported at_bound), and what set-ups that failed "
                        "earlier left unspent goes afterwards to those still passing, highest first")
    p.add_argument("--resolution", type=float, default=bench_capacity.RESOLUTION, metavar="R",
                   help="bisect until the lowest failing load is within this share above the highest passing one "
                        f"(default {bench_capacity.RESOLUTION:g})")
    p.add_argument("--max-trials", type=int, default=None,
                   help="at most this many load factors per set-up besides the time budget (default: no limit; "
                        "--quick 2)")
    p.add_argument("--trials-per-factor", type=int, default=None, metavar="N",
                   help=f"trials of each load factor (default {bench_capacity.TRIALS_PER_FACTOR}; --quick 1); the "
                        "factor passes by --pass-rule")
    p.add_argument("--pass-rule", choices=bench_capacity.PASS_RULES, default="majority",
                   help="majority (default): more than half of a factor's trials meet the SLO, decided as soon as "
                        "certain; all: every one does")
    p.add_argument("--static-namings", type=int, default=None, metavar="N",
                   help=f"run static under N namings (the hash salted; default {bench_capacity.STATIC_NAMINGS}, "
                        "--quick 1) and report their spread; the median one is static's row")
    p.add_argument("--tier-bytes", type=_size, default=None, metavar="SIZE",
                   help="tier memory the engines can read back, in all (e.g. 512MiB): one private DRAM tier of "
                        "SIZE / servers a server for the baselines and pof_private, one shared region of SIZE for "
                        f"pof (default {bench_capacity.TIER_KV_MULTIPLE}x the servers' KV caches)")
    p.add_argument("--model", metavar="DIR|PRESET",
                   help="model directory, or a local preset built on first use: tiny (the default; 4,096 "
                        "positions), tiny-long (the same weights, 32,768 positions: long-context traces), bench")
    p.add_argument("--audit-rates", type=_rates, default=[], metavar="R,R",
                   help="after the set-ups, pof again with each audit.sample_rate (e.g. 0.01,0.1): goodput with the "
                        "audit on, same trace and SLO")
    p.add_argument("--pof-cost", type=_cost, action="append", default=[], metavar="KEY=VALUE[,...]",
                   help="after the set-ups, pof again with these settings of its router's cost section (e.g. "
                        "displacement_weight=0; repeat for more variants): an A/B of a routing rule, same trace and "
                        "SLO, in pof_cost_variants with vs_pof")
    p.add_argument("--pof-fixed-shares", action="store_true",
                   help="after the set-ups, pof again with each server keeping its first share of the shared region "
                        "(tiers.cxl.trade: false): what trading slots buys, same trace and SLO, in pof_cost_variants "
                        "as 'fixed shares' with vs_pof")
    p.add_argument("--side-by-side", action="store_true",
                   help="start every set-up's fleet (and each --pof-cost / --audit-rates run) at once and advance "
                        "their searches one load factor at a time in turn, the order rotated each round: on a host "
                        "whose speed drifts over a run, every set-up sees the drift alike (default: one set-up after "
                        "another, where the last ones measured have met a slower host; needs memory for every fleet)")
    p.add_argument("--router-nice", type=int, default=bench_capacity.ROUTER_NICE, metavar="N",
                   help="niceness of the routers (pof router and vllm-router alike; default "
                        f"{bench_capacity.ROUTER_NICE}: in a deployment a router has a host of its own, here it "
                        "shares the engines' cores; lowering it needs root, else it stays at 0)")
    p.add_argument("--router-sched", choices=("auto", *SCHEDS), default="auto",
                   help="rr: the routers, the index server and the relays run in SCHED_RR, every set-up alike, "
                        "as promptly as on hosts of their own (needs root or CAP_SYS_NICE); nice: --router-nice "
                        "only; auto (default): rr where permitted, else nice (the JSON says which ran)")
    p.set_defaults(handler=cmd_bench_capacity)
