"""``pof sim [--json] [--plot FILE.png] --mix NAME | --trace FILE --nodes N --profile FILE|NAME``:
goodput per policy on a simulated cluster (see :mod:`pof_connector.sim`); ``pof sim sweep``,
``pof sim calibrate`` and ``pof sim validate`` (:mod:`.sim_tools_cli`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.table import Table

from pof_connector.cli_support import out_console, print_json, progress
from pof_connector.config import ConfigError
from pof_connector.sim import sim_tools_cli
from pof_connector.sim.mixes import MIXES, make_mix
from pof_connector.sim.policies import POLICIES
from pof_connector.sim.profile import builtin_profiles, load_profile
from pof_connector.sim.sim_plot import draw_load, require_matplotlib
from pof_connector.sim.sim_run import SimReport, run_sim
from pof_connector.sim.workload import load_trace


def _policies(text: str) -> tuple[str, ...]:
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [n for n in names if n not in POLICIES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"policies are some of {', '.join(POLICIES)}, got {text!r}")
    return names


def add_parser(sub: Any) -> None:
    p = sub.add_parser("sim", help="simulate a cluster: goodput per placement policy, with and without the pool",
                       description="A discrete-event simulation of N engine nodes with KV memory: the goodput "
                                   "(highest load within the TTFT SLO, no failures) of static, round_robin, "
                                   "cache_aware and pof (the real pof router, with the pool), and the capacity "
                                   "ratio pof / static.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--mix", choices=sorted(MIXES), help="a built-in workload")
    src.add_argument("--trace", type=Path, metavar="FILE", help="a JSONL trace (pof bench capacity --trace format)")
    p.add_argument("--nodes", type=int, default=8, help="engine nodes (default 8)")
    p.add_argument("--profile", default="h200",
                   help=f"profile YAML, or a shipped one: {', '.join(builtin_profiles())} (default h200)")
    p.add_argument("--requests", type=int, default=2000, help="requests a built-in mix makes (default 2000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", type=_policies, default=POLICIES, metavar="P,...",
                   help=f"some of {', '.join(POLICIES)} (default all)")
    p.add_argument("--factor", type=float, metavar="F",
                   help="one run per policy at this rate factor instead of the goodput search (speed checks)")
    p.add_argument("--json", action="store_true", help="print JSON on stdout")
    p.add_argument("--plot", type=Path, metavar="FILE.png", help="draw p90 TTFT against offered load per policy")
    p.set_defaults(handler=run)
    sim_tools_cli.add_parsers(p.add_subparsers(dest="sim_command", metavar="{sweep,calibrate,validate}"))


def run(args: argparse.Namespace) -> int:
    if args.mix is None and args.trace is None:
        raise ConfigError("pof sim: one of --mix NAME or --trace FILE is required (or a command: sweep, calibrate, "
                          "validate)")
    if args.nodes < 1:
        raise ConfigError(f"--nodes: must be >= 1, got {args.nodes}")
    if args.requests < 1:
        raise ConfigError(f"--requests: must be >= 1, got {args.requests}")
    if args.plot is not None:
        require_matplotlib()
    profile = load_profile(args.profile)
    if args.trace is not None:
        requests = load_trace(args.trace)
    else:
        requests = make_mix(args.mix, nodes=args.nodes, requests=args.requests, seed=args.seed,
                            kv_tokens=profile.kv_tokens)
    if args.factor is not None and not args.factor > 0:
        raise ConfigError(f"--factor: must be > 0, got {args.factor}")
    report = run_sim(profile, requests, nodes=args.nodes, policies=args.policies, factor=args.factor,
                     progress=progress)
    if args.plot is not None:
        draw_load(report, args.plot)
    if args.json:
        print_json({"workload": args.mix or str(args.trace), "seed": args.seed, **report.to_json(),
                    **({"plot": str(args.plot)} if args.plot else {})})
    else:
        show(report, args.mix or str(args.trace))
    return 0


def show(report: SimReport, workload: str) -> None:
    t = Table(title=f"pof sim: {workload} on {report.nodes} x {report.profile}, {report.requests} requests, "
                    f"SLO p90 TTFT {report.slo_s:.3g} s")
    for col in ("policy", "goodput req/s", "p90 TTFT s", "preempt", "recomputed tok", "spread mean/p90",
                "idle busiest/idlest", "loaded GB per tier"):
        t.add_column(col)
    for name, g in report.goodput.items():
        b = g.best
        if b is None:
            t.add_row(name, "0 (fails at the lowest rate)", "", "", "", "", "", "")
            continue
        tiers = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in b.loaded_bytes.items()) or "-"
        t.add_row(name, f"{g.factor * report.base_rps:.3g}", f"{b.p90_ttft_s:.3g}", str(b.counters.preemptions),
                  f"{b.counters.recomputed_tokens:,}", f"{b.spread_mean:.2f} / {b.spread_p90:.2f}",
                  f"{b.idle_busiest:.2f} / {b.idle_idlest:.2f}", tiers)
    con = out_console()
    con.print(t)
    ratio, best = report.ratio(), report.ratio_vs_best()
    con.print(f"capacity ratio pof / static: {ratio:.2f}" if ratio is not None else "capacity ratio: n/a",
              f"  pof / best other: {best:.2f}" if best is not None else "")
    speed = report.simulated / report.wall_s if report.wall_s > 0 else 0.0
    cpu = report.simulated / report.cpu_s if report.cpu_s > 0 else 0.0
    con.print(f"simulated {report.simulated:,} requests in {report.wall_s:.1f} s: {speed:,.0f} requests/s "
              f"({cpu:,.0f} per CPU second)")
