"""Two stock vLLM servers share one KV pool (a CXL region, here a file under /dev/shm, and the
embedded index). A shared-prefix workload — two tenants' long system prompts, a few user turns
each — goes first to server A, then to server B. B never computed those prefixes: it loads them
from the pool. Prints, per request: prompt tokens, tokens from the engine's own prefix cache,
tokens from the pool and from which tier, tokens computed, and time to first token; then one
line comparing B's first turns (prefix from the pool) with A's (prefix computed).

The model is built locally (no hub): the ``bench`` preset by default, an 8-layer Llama whose
1,500-token prefix takes seconds to compute on a CPU core, so what the pool saves shows; ``tiny``
builds in seconds but computes a prefix in milliseconds. Each server computes on its own half of
the cores, as two hosts would.

    python examples/vllm/quickstart.py [--model DIR | --preset tiny] [--system-tokens 1500]

(``bash examples/quickstart.sh`` installs what it needs and runs this.)
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.table import Table

from pof_connector.bench.router import _own_cores as own_cores
from pof_connector.bench.vllm_server import VllmServer, build_model, connector_config
from pof_connector.console import console
from pof_connector.index.embedded import stop_embedded


def workload_table() -> Table:
    """The table of requests, one row each (see the module's doc), with its headers and no rows."""
    table = Table(title="shared-prefix workload: A computes, B loads from the pool")
    for col in ("server", "tenant", "turn", "prompt tokens", "engine cache", "pool", "pool tier", "computed",
                "TTFT ms"):
        table.add_column(col, justify="left" if col in ("server", "tenant", "pool tier") else "right")
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: build the --preset model locally, no hub needed)")
    ap.add_argument("--preset", choices=("bench", "tiny"), default="bench",
                    help="the model built without --model (default bench; see above)")
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--turns", type=int, default=2)
    args = ap.parse_args()
    out = console()
    model = Path(args.model) if args.model else build_model(args.preset)
    work = Path(tempfile.mkdtemp(prefix="pof-quickstart-", dir="/tmp"))
    region_dir = Path(tempfile.mkdtemp(prefix="pof-quickstart-", dir="/dev/shm"))
    tiers = {"cxl": {"path": str(region_dir / "cxl.region"), "size": "1GiB"}, "cpu_dram": {"size": "512MiB"}}
    servers = {
        name: VllmServer(model, work / name, kv_transfer=connector_config(
            {"node_id": name, "index_url": "embedded", "runtime_dir": str(work / "index"), "tiers": tiers}),
            extra_args=["--dtype", "float32"], env=own_cores(i))
        for i, name in enumerate(("A", "B"))
    }
    out.print(f"[bold]pof quickstart[/]: starting two vLLM servers with the pool (model {model}); this takes "
              "a minute or two on a CPU ...")
    rnd = random.Random(7)
    system = {t: [rnd.randrange(3, 1900) for _ in range(args.system_tokens)] for t in ("tenant-1", "tenant-2")}
    table = workload_table()
    first: dict[str, list[tuple[float, float]]] = {"A": [], "B": []}     # per server: (TTFT s, pool tokens)
    try:
        with ThreadPoolExecutor(2) as ex:       # in the try: one failed start stops the other server too
            list(ex.map(lambda s: s.start(), servers.values()))
        for server_name in ("A", "B"):
            server = servers[server_name]
            for tenant, prefix in system.items():
                for turn in range(args.turns):
                    prompt = prefix + [rnd.randrange(3, 1900) for _ in range(40)]
                    before = server.metrics()
                    ttft, _ = server.stream(prompt, max_tokens=16)
                    after = server.metrics()
                    local = after.get("vllm:prefix_cache_hits_total", 0) - before.get("vllm:prefix_cache_hits_total", 0)
                    pool = after.get("vllm:external_prefix_cache_hits_total", 0) - before.get(
                        "vllm:external_prefix_cache_hits_total", 0)
                    tiers_used = sorted(
                        key.split('tier="')[1].split('"')[0] for key, v in after.items()
                        if key.startswith("vllm:pof_loaded_pages_total{") and v > before.get(key, 0))
                    table.add_row(server_name, tenant, str(turn + 1), f"{len(prompt):,}", f"{local:,.0f}",
                                  f"{pool:,.0f}", ",".join(tiers_used) or "-", f"{len(prompt) - local - pool:,.0f}",
                                  f"{ttft * 1e3:,.0f}")
                    if turn == 0:
                        first[server_name].append((ttft, pool))
            if server_name == "A":
                time.sleep(1.0)        # A's last pages reach the pool
    finally:
        for s in servers.values():
            s.stop()
        stop_embedded(work / "index")
        shutil.rmtree(region_dir, ignore_errors=True)
    out.print(table)
    out.print("B's first turn of each tenant came from the pool (written by A); later turns hit the server's own "
              "prefix cache. Server logs: " + str(work), soft_wrap=True)
    out.print(summary(first["A"], first["B"]), soft_wrap=True)
    pof = Path(sys.executable).parent / "pof"
    out.print(f"The pof command lives in this venv: {pof} (not on your PATH). This run's index was private "
              f"and is gone; to look at a pool of your own: `{pof} index serve` in one shell, engines with "
              f"index_url: embedded, then `{pof} stats`.", soft_wrap=True)


def summary(a_first: list[tuple[float, float]], b_first: list[tuple[float, float]]) -> str:
    """One line: B's first turns (prefixes from the pool) against A's (computed); each list holds
    (TTFT seconds, tokens from the pool) per tenant."""
    a_ttft = sum(t for t, _ in a_first) / len(a_first)
    b_ttft = sum(t for t, _ in b_first) / len(b_first)
    pooled = min(p for _, p in b_first)
    if pooled <= 0:
        return (f"[bold red]B loaded nothing from the pool[/]: its first turns recomputed "
                f"(TTFT {b_ttft:.2f} s vs A's {a_ttft:.2f} s); see the server logs")
    return (f"[bold]B served {len(b_first)} tenants' {pooled:,.0f}-token prefixes from A's pool: TTFT "
            f"{b_ttft:.2f} s vs {a_ttft:.2f} s recomputed on A, ratio {b_ttft / a_ttft:.3f}[/] (means of the "
            f"tenants' first turns)")


if __name__ == "__main__":
    main()
