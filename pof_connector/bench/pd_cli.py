"""``pof bench pd``: its arguments and its table (registered by :mod:`pof_connector.bench.cli`)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from rich.table import Table

from pof_connector.bench import pd as bench_pd  # starts vLLM servers and routers; imports no vLLM
from pof_connector.cli_support import out_console, print_json, progress


def cmd_bench_pd(args: argparse.Namespace) -> int:
    names = [f.name for f in dataclasses.fields(bench_pd.Mix)]
    mix = bench_pd.Mix(**{k: getattr(args, k) for k in names if getattr(args, k, None) is not None})
    result = bench_pd.run(mix=mix, setups=args.setups, seed=args.seed, progress=progress)
    if args.json:
        print_json(result)
        return 0
    table = Table(title=f"P/D on a prefill-heavy mix ({result['requests']['chat']} chat, "
                        f"{result['requests']['long']} long requests), model {Path(result['model']).name}",
                  title_justify="left")
    for col in ("set-up", "TTFT p50 s", "TTFT p90 s", "ITL p50 s", "ITL p99 s", "goodput req/s", "failed"):
        table.add_column(col, justify="left" if col == "set-up" else "right")
    for name, row in result["setups"].items():
        if "skipped" in row:
            table.add_row(name, "", "", "", "", "", f"skipped: {row['skipped'][:80]}")
            continue
        table.add_row(name, *(str(row[k]) for k in ("ttft_p50_s", "ttft_p90_s", "itl_p50_s", "itl_p99_s",
                                                     "goodput_rps", "failed")))
    out = out_console()
    out.print(table)
    for name in ("pd_pool", "pd_split", "nixl"):
        r = result.get(f"{name}_vs_colocated")
        if r:
            out.print(f"{name} / colocated: ITL p99 [bold]{r['itl_p99_ratio']}[/bold], goodput {r['goodput_ratio']} "
                      f"(goal: <= 0.5 at >= 1: {'met' if r['goal_met'] else 'not met'})")
    return 0


def add_pd_parser(bsub: Any) -> None:
    """Register ``pof bench pd``."""
    pd = bsub.add_parser("pd", help="P/D through the pool vs the same servers co-located vs vLLM's NixlConnector P/D",
                         description="A prefill-heavy mix (long prompts arriving while chat answers stream) on two "
                                     "vLLM servers: 1P1D through the pool (pof router's P/D mode), the same two "
                                     "servers co-located behind pof router, and vLLM's own P/D (NixlConnector with "
                                     "a host buffer, behind vllm-router --vllm-pd-disaggregation) where NIXL is "
                                     "installed. TTFT p50/p90, inter-token latency p50/p99, goodput. Needs vLLM "
                                     "and vllm-router.")
    pd.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    pd.add_argument("--setups", type=lambda v: [w.strip() for w in v.split(",") if w.strip()],
                    default=list(bench_pd.SETUPS), help=f"some of {','.join(bench_pd.SETUPS)} (default all)")
    pd.add_argument("--model", metavar="DIR|PRESET", help="model (default: the local 'bench' preset)")
    pd.add_argument("--seconds", type=float, help="seconds of arrivals per set-up (default 150)")
    pd.add_argument("--chat-rate", type=float, help="chat requests per second (default 0.4)")
    pd.add_argument("--chat-prompt", type=int, help="chat prompt tokens (default 257)")
    pd.add_argument("--chat-tokens", type=int, help="chat answer tokens (default 96)")
    pd.add_argument("--long-rate", type=float, help="long-prompt requests per second (default 0.12)")
    pd.add_argument("--long-prompt", type=int, help="long prompt tokens (default 2049)")
    pd.add_argument("--long-tokens", type=int, help="long request answer tokens (default 8)")
    pd.add_argument("--ttft-slo-s", type=float, help="goodput's TTFT bound (default 10)")
    pd.add_argument("--tpot-slo-s", type=float, help="goodput's bound on mean time per output token (default 0.25)")
    pd.add_argument("--kv-tokens", type=int, help="KV cache tokens per server (default 16384)")
    pd.add_argument("--split-below", type=int, help="pd_split: prompts under this many tokens are computed on the "
                                                    "decode server (default 512)")
    pd.add_argument("--seed", type=int, default=43, help="workload seed (default 43)")
    pd.set_defaults(handler=cmd_bench_pd)
