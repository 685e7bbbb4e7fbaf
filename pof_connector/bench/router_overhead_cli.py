"""``pof bench router-overhead``: its arguments and its table (registered by :mod:`pof_connector.bench.cli`)."""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from pof_connector.bench import router_overhead as bench_overhead
from pof_connector.cli_support import out_console, print_json, progress


def _ms(q: dict[str, float], key: str) -> str:
    return f"{q[key] * 1e3:.3f}" if key in q else "-"


def cmd_bench_router_overhead(args: argparse.Namespace) -> int:
    result = bench_overhead.run(requests=args.requests, backends=args.backends, concurrency=args.concurrency,
                                prompt_tokens=args.prompt_tokens, model=args.model, seed=args.seed,
                                paced_requests=args.paced_requests, paced_rate=args.paced_rate, progress=progress)
    if args.json:
        print_json(result)
        return 0
    s = result["setup"]
    table = Table(title=f"pof router's own time, ms: {s['requests']} requests of ~{s['prompt_tokens_mean']:.0f} "
                        f"tokens, {s['backends']} stand-in engines", title_justify="left")
    table.add_column("run")
    for name in ("total", *bench_overhead.STAGES, "client TTFB"):
        table.add_column(f"{name} p50 / p99", justify="right")
    for name, run in result["runs"].items():
        stages: dict[str, Any] = run["stages_s"]
        cells = [run["overhead_s"], *(stages.get(st, {}) for st in bench_overhead.STAGES), run["ttfb_s"]]
        table.add_row(name, *(f"{_ms(q, 'p50')} / {_ms(q, 'p99')}" for q in cells))
    out = out_console()
    out.print(table)
    ping = result["index_ping_s"]
    out.print(f"proxy hop (client TTFB p50 through the router - straight to a stand-in): "
              f"{result['proxy_hop_p50_s'] * 1e3:.3f} ms; index round trip (PING) p50 {ping['p50'] * 1e3:.3f} ms, "
              f"p99 {ping['p99'] * 1e3:.3f} ms")
    return 0


def add_router_overhead_parser(bsub: Any) -> None:
    p = bsub.add_parser("router-overhead", help="pof router's own time per request, by stage, with stand-in engines",
                        description="The router's time per request (parse, tokenize, index lookup, choice, proxy) "
                                    "on loopback: a real Redis-protocol index, pool nodes holding prefixes, "
                                    "stand-ins for vLLM servers that answer at once, and pof router as a "
                                    "subprocess. Needs no engine.")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--requests", type=int, default=2000, help="requests per run (default 2000)")
    p.add_argument("--backends", type=int, default=4, help="stand-in engines, each with a pool node (default 4)")
    p.add_argument("--concurrency", type=int, default=8, help="clients of the concurrent run (default 8)")
    p.add_argument("--prompt-tokens", type=int, default=2900, help="tokens per text prompt (default 2900)")
    p.add_argument("--model", metavar="DIR", help="model directory of the tokenizer (default: the local 'tiny')")
    p.add_argument("--seed", type=int, default=7, help="prompt seed (default 7)")
    p.add_argument("--paced-requests", type=int, default=150,
                   help="text prompts of the last run, sent one at a time at --paced-rate (0: no such run; "
                        "default 150)")
    p.add_argument("--paced-rate", type=float, default=3.0,
                   help="requests per second of the paced run, as `pof bench router`'s cheap workload (default 3)")
    p.set_defaults(handler=cmd_bench_router_overhead)
