"""``pof bench chaos``: its arguments and its table (registered by :mod:`pof_connector.bench.cli`)."""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from pof_connector.bench import chaos as bench_chaos  # starts vLLM servers, memd, a router; imports no vLLM
from pof_connector.bench.chaos_faults import KINDS as CHAOS_KINDS
from pof_connector.cli_support import out_console, print_json, progress


def cmd_bench_chaos(args: argparse.Namespace) -> int:
    minutes, rounds = (3.0, 1) if args.quick else (args.minutes, args.rounds)
    result = bench_chaos.run(minutes=minutes, seed=args.seed, rounds=rounds, model=args.model,
                             max_requests=args.max_requests, progress=progress, kinds=tuple(args.faults))
    if args.json:
        print_json(result)
    else:
        table = Table(title=f"chaos: {minutes:g} minutes, seed {args.seed}", title_justify="left")
        for name in ("fault", "at s", "lasted s", "hit before", "during", "after", "full hits again s", "detail"):
            table.add_column(name, justify="left" if name in ("fault", "detail") else "right")
        for row in result["fault_log"]:
            if "skipped" in row:
                table.add_row(row["kind"], f"{row['at_s']:.0f}", "", "", "", "", "", f"skipped: {row['skipped']}")
                continue
            table.add_row(row["kind"], f"{row['at_s']:.0f}", f"{row['lasted_s']:.0f}", f"{row['hit_rate_before']:.3f}",
                          f"{row['hit_rate_during']:.3f}", f"{row['hit_rate_after']:.3f}",
                          str(row["recover_full_hits_s"]), row["detail"])
        out = out_console()
        out.print(table)
        req = result["requests"]
        out.print(f"requests sent {req['sent']}, answered {req['answered']}, failed {req['failed']}; "
                  f"[bold]wrong answers {result['wrong_answers']}[/bold], audit mismatches "
                  f"{result['audit_mismatches']} of {result['audited_pages']} audited pages, unplanned crashes "
                  f"{result['unplanned_crashes']}; hit rate {result['hit_rate']:.3f}")
    return 1 if result["wrong_answers"] or result["unplanned_crashes"] else 0


def add_chaos_parser(bsub: Any) -> None:
    """Register ``pof bench chaos``."""
    chaos = bsub.add_parser("chaos", help="traffic with random faults; every answer checked against a reference",
                            description="Two pooled vLLM servers (shared CXL region + fabric), a pof memd node, a "
                                        "Redis-protocol index and pof router, with faults from a seeded schedule "
                                        "(memd killed, index restarted, flipped bytes, tier file removed, peer "
                                        "stopped, link cut, eviction storm, vLLM killed); each answer is "
                                        "compared with a server without the connector. Exits 1 on any wrong "
                                        "answer or unplanned crash. Needs vLLM and NIXL.")
    chaos.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    chaos.add_argument("--minutes", type=float, default=20.0, help="minutes of traffic (default 20)")
    chaos.add_argument("--rounds", type=int, default=3, help="times each fault kind is injected (default 3)")
    chaos.add_argument("--seed", type=int, default=1, help="seed of the traffic and the fault schedule (default 1)")
    chaos.add_argument("--quick", action="store_true", help="3 minutes, each fault once (what CI runs)")
    chaos.add_argument("--faults", type=lambda s: [k.strip() for k in s.split(",") if k.strip()],
                       default=list(CHAOS_KINDS), metavar="KIND,...",
                       help=f"fault kinds to inject (default all: {', '.join(CHAOS_KINDS)})")
    chaos.add_argument("--max-requests", type=int, default=1_000_000, help="stop the traffic after this many")
    chaos.add_argument("--model", metavar="DIR", help="model directory (default: build the local 'tiny' model)")
    chaos.set_defaults(handler=cmd_bench_chaos)
