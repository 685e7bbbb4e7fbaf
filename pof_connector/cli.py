"""The ``pof`` command: run and inspect the locality index, and benchmark this host.

Commands::

    pof index serve   run this host's embedded index server in the foreground
    pof index stop    stop it
    pof index stats   live nodes and index totals (also ``pof stats``)
    pof bench tiers   page put+get through the tiers vs. plain memcpy
    pof bench index   prefix-lookup latency and memory per location
    pof bench fabric  remote page fetch over NIXL through pof vs. a raw NIXL READ
    pof bench hbm     peer-GPU HBM and host-tier reads vs. raw torch copies
    pof router        OpenAI-compatible proxy routing by estimated time to first token
    pof relay         feed a KV-event router (vllm-router kv_aware) an engine's cache and its pool
    pof memd          a memory-only pool node: lends its DRAM/CXL to other nodes' spilled pages

Every command returns an exit code instead of raising: 0 on success, 1 when it could not do
its job (with one line on stderr saying why), 2 for a usage error. ``--json`` output goes to
stdout alone, so it can be piped; progress and errors go to stderr.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pof_connector.bench import BenchError
from pof_connector.bench import fabric as bench_fabric  # imports NIXL only when run
from pof_connector.bench import hbm as bench_hbm  # imports torch only when run
from pof_connector.bench import index as bench_index
from pof_connector.bench import router as bench_router  # starts vLLM servers and routers; imports no vLLM
from pof_connector.bench import tiers as bench_tiers
from pof_connector.bench import vllm as bench_vllm  # starts vLLM servers; imports no vLLM itself
from pof_connector.config import ConfigError, PofConfig, format_size, parse_size
from pof_connector.console import console
from pof_connector.index.base import IndexUnavailable, NodeInfo
from pof_connector.index.embedded import PIDFILE, embedded_alive, embedded_url, restarts, stop_embedded, supervise
from pof_connector.index.redis import RedisIndex
from pof_connector.index.server import ping
from pof_connector.router import serve as router_serve

Handler = Callable[[argparse.Namespace], int]
PIDFILE_GRACE_S = 2.0


class CommandError(RuntimeError):
    """A command cannot do its job; the message is shown as is and the exit code is 1."""


# ---- plumbing -------------------------------------------------------------------------------


def _out() -> Console:
    # Built per call, not at import: tests and pipes swap sys.stdout after this module loads.
    return console(sys.stdout, highlight=False)


def _err() -> Console:
    return console(sys.stderr, highlight=False)


def _progress(message: str) -> None:
    _err().print(message, style="dim", markup=False, soft_wrap=True)


def _print_json(obj: object) -> None:
    """Exactly one JSON object on stdout, without rich's wrapping or markup."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _size(text: str) -> int:
    """argparse ``type`` for sizes such as ``256MiB``: the config's parser, the config's words."""
    try:
        return parse_size(text, "size")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _setups(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    bad = [n for n in names if n not in bench_vllm.SETUPS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"setups are some of {', '.join(bench_vllm.SETUPS)}, got {text!r}")
    return names


def _sizes(text: str) -> list[int]:
    return [_size(part) for part in text.split(",") if part.strip()]


def _media(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _load_config(path: str | None) -> PofConfig:
    """The config file's settings, or the defaults (``index_url: embedded``) without one."""
    return PofConfig() if path is None else PofConfig.from_file(path)


def _runtime_dir(args: argparse.Namespace) -> Path:
    """``--runtime-dir``, else the config's ``runtime_dir``: where the embedded server lives."""
    if args.runtime_dir:
        return Path(args.runtime_dir)
    return Path(_load_config(args.config).runtime_dir)


# ---- pof index serve / stop -------------------------------------------------------------------


def cmd_index_serve(args: argparse.Namespace) -> int:
    """Run the embedded index supervisor in this process until ``pof index stop`` or Ctrl-C."""
    runtime_dir = _runtime_dir(args)
    runtime_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    url = embedded_url(runtime_dir)
    idle_s = math.inf if args.idle_s is None else args.idle_s
    # The lock is the one ensure_embedded() takes: holding it until our server answers keeps a
    # starting engine from launching a second server on the same socket meanwhile.
    with open(runtime_dir / "embedded.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if embedded_alive(runtime_dir) or ping(url):
            raise CommandError(f"an index server already answers at {url}; stop it with "
                               f"`pof index stop --runtime-dir {runtime_dir}`")
        up = threading.Event()
        announcer = threading.Thread(target=_announce, args=(url, runtime_dir, lock, up), daemon=True)
        announcer.start()
        if args.http_port:
            _start_api(url, args)
        try:
            return supervise(runtime_dir, idle_s)
        except (OSError, RuntimeError, TimeoutError, ValueError) as e:
            raise CommandError(f"the index server failed: {e}") from e
        finally:
            up.set()
            announcer.join()      # before the lock file closes under it


def _start_api(index_url: str, args: argparse.Namespace) -> threading.Thread:
    """Serve the locality API (pof_connector.router.api) on a thread of this process."""
    import uvicorn

    from pof_connector.router.api import load_tokenizer, make_app

    tokenizers = {}
    for item in args.tokenizer or []:
        model, _, path = item.partition("=")
        if not path:
            raise CommandError(f"--tokenizer expects MODEL=DIR, got {item!r}")
        tokenizers[model] = load_tokenizer(path, special_tokens=False)
    app = make_app(RedisIndex(index_url, None), token=args.token, tokenizers=tokenizers)
    server = uvicorn.Server(uvicorn.Config(app, host=args.http_host, port=args.http_port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="pof-api", daemon=True)
    thread.start()
    _err().print(f"locality API on http://{args.http_host}:{args.http_port} (docs at /docs)", style="dim")
    return thread


def cmd_index_api(args: argparse.Namespace) -> int:
    """Serve the locality API for an index this process does not run (e.g. a Redis cluster's)."""
    if not ping(args.url):
        raise CommandError(f"no index server answers at {args.url}")
    _start_api(args.url, args).join()
    return 0


def _add_api_args(p: argparse.ArgumentParser, port: int) -> None:
    p.add_argument("--http-host", default="127.0.0.1", help="address of the locality API (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, default=port, help=f"its port; 0 disables it (default {port})")
    p.add_argument("--token", help="require 'Authorization: Bearer TOKEN' on the API (not on /healthz)")
    p.add_argument("--tokenizer", action="append", metavar="MODEL=DIR",
                   help="accept text prompts for MODEL, tokenized with DIR/tokenizer.json (repeatable)")


def _announce(url: str, runtime_dir: Path, lock: Any, done: threading.Event) -> None:
    """Once the server answers: release the start lock and tell the user the URL clients use."""
    while not done.is_set():
        if ping(url) and (runtime_dir / PIDFILE).exists():   # stoppable from now on
            fcntl.flock(lock, fcntl.LOCK_UN)
            print(f"pof index server running; clients use index_url: {url}\n"
                  f"(index_url: embedded with runtime_dir: {runtime_dir} finds it too); "
                  f"stop with `pof index stop --runtime-dir {runtime_dir}` or Ctrl-C", flush=True)
            return
        done.wait(0.05)


def cmd_index_stop(args: argparse.Namespace) -> int:
    """Stop the embedded server by its supervisor's PID, but only when a server answers:
    a stale pidfile's PID may belong to an unrelated process by now."""
    runtime_dir = _runtime_dir(args)
    url = embedded_url(runtime_dir)
    pidfile = runtime_dir / PIDFILE
    answers = ping(url) or embedded_alive(runtime_dir)      # a frozen or busy server is stopped too
    if answers and not _wait_for(pidfile, PIDFILE_GRACE_S):
        raise CommandError(f"a server answers at {url} but {pidfile} is missing; it was not started by "
                           f"`pof index serve` or ensure_embedded, stop it yourself")
    if not pidfile.exists():
        raise CommandError(f"no embedded index server in {runtime_dir} (no {PIDFILE})")
    if not answers:
        raise CommandError(f"no index server answers at {url}; {pidfile} is stale (remove it), "
                           f"no process was signalled")
    stop_embedded(runtime_dir)
    _out().print(f"stopped the index server at {url}")
    return 0


def _wait_for(path: Path, timeout_s: float) -> bool:
    """The supervisor writes its pidfile just after its server answers: give it that moment."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# ---- pof index stats --------------------------------------------------------------------------


def cmd_index_stats(args: argparse.Namespace) -> int:
    """Live nodes and totals of a running index; never starts a server to answer."""
    url = _stats_url(args)
    index = RedisIndex(url, None)
    try:
        nodes, totals = index.nodes(), index.stats()
    finally:
        index.close()
    runtime_dir = _embedded_dir(args)
    if runtime_dir is not None:
        restarted = restarts(runtime_dir)
        totals["restarts"] = len(restarted)
        if restarted and not args.json:
            _out().print(f"the embedded index server was restarted {len(restarted)} time(s) after it died; "
                         f"last: {restarted[-1]}", style="yellow")
    if args.json:
        _print_json({"url": url, "nodes": [_node_json(n) for n in nodes], "totals": totals})
    else:
        _print_stats(url, nodes, totals)
    return 0


def _embedded_dir(args: argparse.Namespace) -> Path | None:
    """The runtime directory of the embedded server that ``pof stats`` asks; ``None`` for another index."""
    if args.url:
        return None
    config = _load_config(args.config)
    return Path(config.runtime_dir) if config.index_url == "embedded" else None


def _stats_url(args: argparse.Namespace) -> str:
    """The URL of a server that answers now; :class:`CommandError` when there is none."""
    if args.url:
        url = str(args.url)
    else:
        config = _load_config(args.config)
        if config.index_url == "local":
            raise CommandError("index_url is 'local': that index lives inside one engine process and has "
                               "no server to ask")
        url = embedded_url(config.runtime_dir) if config.index_url == "embedded" else config.index_url
    if not ping(url):
        runtime_dir = _embedded_dir(args)
        if runtime_dir is not None and embedded_alive(runtime_dir):
            raise CommandError(f"the index server at {url} runs but does not answer (a busy host, or stopped)")
        if args.url or config.index_url != "embedded":
            raise CommandError(f"no index server running at {url}")
        serve = "pof index serve" + (f" --config {args.config}" if args.config else "")
        raise CommandError(f"no index server running at {url}. Engines with index_url: embedded start it when "
                           f"they start; `{serve}` runs one in the foreground. The index of "
                           "examples/quickstart.sh and examples/core/two_nodes.py is private to their run "
                           "and stopped with it.")
    return url


def _lent(node: NodeInfo) -> dict[str, tuple[int, int]]:
    """Per medium: (slots lent to spilling writers, writers holding leases); empty when the node
    lends nothing (fabric.spill off)."""
    try:
        raw = json.loads(node.meta.get("fabric.lent", "{}"))
        return {str(m): (int(v[0]), int(v[1])) for m, v in raw.items()}
    except (ValueError, TypeError, IndexError, AttributeError):
        return {}


def _node_json(node: NodeInfo) -> dict[str, object]:
    lent = _lent(node)
    tiers = {medium: {"capacity_bytes": t.capacity_bytes, "free_bytes": t.free_bytes,
                      "used_bytes": t.capacity_bytes - t.free_bytes, "domain": t.domain,
                      **({"lent_slots": lent[medium][0], "lease_writers": lent[medium][1]} if medium in lent else {})}
             for medium, t in node.tiers.items()}
    return {"node_id": node.node_id, "role": node.meta.get("pof.role", "pool"), "tiers": tiers, "meta": node.meta}


def _print_stats(url: str, nodes: Sequence[NodeInfo], totals: dict[str, int]) -> None:
    table = Table(title=f"live nodes at {url}", title_justify="left")
    table.add_column("node", no_wrap=True)
    table.add_column("tier")
    for name in ("capacity", "used", "free"):
        table.add_column(name, justify="right")
    table.add_column("lent (slots / writers)", justify="right")
    table.add_column("domain", overflow="fold")
    for node in sorted(nodes, key=lambda n: n.node_id):
        label = node.node_id + (" (memory)" if node.meta.get("pof.role") == "memory" else "")
        lent = _lent(node)
        if not node.tiers:
            table.add_row(label, "-", "-", "-", "-", "-", "-")
        for i, (medium, t) in enumerate(sorted(node.tiers.items())):
            shown = f"{lent[medium][0]:,} / {lent[medium][1]}" if medium in lent else "-"
            table.add_row(label if i == 0 else "", medium, format_size(t.capacity_bytes),
                          format_size(t.capacity_bytes - t.free_bytes), format_size(t.free_bytes), shown, t.domain)
    out = _out()
    out.print(table)
    summary = Table(title="index totals", title_justify="left", show_header=False)
    summary.add_column("what")
    summary.add_column("value", justify="right")
    summary.add_row("locations", f"{totals.get('locations', 0):,}")
    summary.add_row("server memory", format_size(totals.get("memory_bytes", 0)))
    summary.add_row("live nodes", str(totals.get("nodes", len(nodes))))
    if "restarts" in totals:
        summary.add_row("server restarts", str(totals["restarts"]))
    out.print(summary)


# ---- pof bench --------------------------------------------------------------------------------


def cmd_bench_tiers(args: argparse.Namespace) -> int:
    result = bench_tiers.run(media=args.media, sizes=args.sizes, tier_size=args.tier_size, repeat=args.repeat,
                       progress=_progress)
    if args.json:
        _print_json(result)
        return 0
    table = Table(title=f"tier put+get vs. {result['baseline']}", title_justify="left")
    table.add_column("medium")
    for name in ("page", "slots", "pages put", "pages got", "ours GB/s", "memcpy GB/s", "ratio"):
        table.add_column(name, justify="right")
    for row in result["rows"]:
        table.add_row(row["medium"], row["page_size"], str(row["slots"]), str(row["pages_put"]),
                      str(row["pages_got"]), f"{row['ours_gbps']:.2f}", f"{row['memcpy_gbps']:.2f}",
                      f"{row['ratio']:.3f}")
    out = _out()
    out.print(table)
    out.print(f"ratio (geometric mean of rows) [bold]{result['ratio']:.3f}[/bold], "
              f"min_ratio {result['min_ratio']:.3f}  (1.0 = as fast as a bare memcpy)")
    return 0


def cmd_bench_index(args: argparse.Namespace) -> int:
    result = bench_index.run(pages=args.pages, nodes=args.nodes, iterations=args.iterations,
                       memory_pages=args.memory_pages, url=args.url, progress=_progress)
    if args.json:
        _print_json(result)
        return 0
    table = Table(title=f"index: {args.pages}-page prefix lookup over {args.nodes} nodes "
                        f"({result['server_version']})", title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    for label, key, fmt in (
        ("lookup p50 / p90 / p99", None, ""),
        ("round trip (PING) p50", "rtt_p50_ms", "{:.3f} ms"),
        ("ratio lookup p50 / round trip p50", "ratio", "{:.2f}"),
        ("round trips per lookup", "round_trips_per_lookup", "{}"),
        ("server memory per location", "bytes_per_location", "{:.1f} B"),
        ("  of which the location hash", "hash_bytes_per_location", "{:.1f} B"),
        ("publish throughput", "publish_pages_per_s", "{:,} pages/s"),
    ):
        if key is None:
            value = (f"{result['lookup_p50_ms']:.3f} / {result['lookup_p90_ms']:.3f} / "
                     f"{result['lookup_p99_ms']:.3f} ms")
        else:
            value = fmt.format(result[key])
        table.add_row(label, value)
    _out().print(table)
    return 0


def cmd_bench_fabric(args: argparse.Namespace) -> int:
    result = bench_fabric.run(layers=args.layers, segment_bytes=args.segment_bytes, pages=args.pages,
                              batch=args.batch, iterations=args.iterations, latency_samples=args.latency_samples,
                              tls=args.tls or None, ucx_devices=args.ucx_devices or None, progress=_progress)
    if args.json:
        _print_json(result)
        return 0
    table = Table(title=f"remote page fetch, {result['batch']} pages of {format_size(result['page_bytes'])} per "
                        f"batch (UCX tls={result['tls'] or 'auto'})", title_justify="left")
    for name in ("path", "GB/s", "pages/s", "batch p50 ms", "1-page p50 ms", "1-page p99 ms", "verified pages"):
        table.add_column(name, justify="right" if name != "path" else "left")
    for name, label in (("pof", "pof fetch"), ("pof_copy_out", "pof + copy out"), ("raw", "raw NIXL READ")):
        row = result[name]
        table.add_row(label, f"{row['gbps']:.3f}", f"{row['pages_per_s']:,.0f}", f"{row['batch_ms_p50']:.2f}",
                      f"{row['latency_ms_p50']:.3f}", f"{row['latency_ms_p99']:.3f}",
                      str(result["verified_pages"][name]))
    out = _out()
    out.print(table)
    out.print(f"ratio pof / raw [bold]{result['ratio']:.3f}[/bold] (with the copy out "
              f"{result['ratio_with_copy_out']:.3f}); byte-exact: {result['exact']} "
              f"(failed {result['failed_pages']}, wrong {result['wrong_pages']})")
    return 0 if result["exact"] else 1


def cmd_bench_hbm(args: argparse.Namespace) -> int:
    engine, peer = bench_hbm.devices(args.device, args.peer)
    _progress(f"hbm: engine {engine}, peer region on {peer}; {args.pages} pages of {args.layers} x "
              f"{format_size(args.segment_bytes)}")
    result = bench_hbm.run(engine=engine, peer=peer, layers=args.layers, segment_bytes=args.segment_bytes,
                           pages=args.pages, min_s=args.min_seconds)
    if args.json:
        _print_json(result)
        return 0
    table = Table(title=f"page moves, {result['pages']} pages of {format_size(result['page_bytes'])} "
                        f"(engine {engine}, peer {peer})", title_justify="left")
    for name in ("row", "pof GB/s", "raw", "raw GB/s", "ratio"):
        table.add_column(name, justify="left" if name in ("row", "raw") else "right")
    for name, row in result["rows"].items():
        table.add_row(name, f"{row['pof_gbps']:.3f}", row["raw"], f"{row['raw_gbps']:.3f}", f"{row['ratio']:.3f}")
    out = _out()
    out.print(table)
    out.print(f"ratio (peer read to the engine's device) [bold]{result['ratio']:.3f}[/bold]; peer HBM vs. host "
              f"tier {result['peer_vs_host_tier']:.3f}; checked-read bound "
              f"{result['peer_read_to_device_bound_gbps']:.3f} GB/s")
    return 0


def cmd_bench_vllm(args: argparse.Namespace) -> int:
    setups = tuple(args.setups) + (("fabric",) if args.fabric and "fabric" not in args.setups else ())
    result = bench_vllm.run(model=args.model, prompt_tokens=args.prompt_tokens, prompts=args.prompts,
                            dtype=args.dtype, block_size=args.block_size, progress=_progress, setups=setups)
    if args.json:
        _print_json(result)
        return 0
    table = Table(title=f"vLLM TTFT, {args.prompt_tokens}-token prompts ({result['model']}, {args.dtype})",
                  title_justify="left")
    for name in ("server", "median TTFT s", "runs s", "tokens from connector"):
        table.add_column(name, justify="right" if name != "server" else "left")
    tokens = {"pof": str(result.get("pool_tokens", "-")), "example": str(result.get("example_tokens", "-"))}
    if "fabric" in result:
        tokens["fabric"] = f"{result['fabric']['remote_tokens']} (over NIXL)"
    for name, ttft in result["ttft_s"].items():
        runs = result["ttft_runs_s"].get(name, [])
        table.add_row(name, f"{ttft:.3f}", " ".join(f"{x:.3f}" for x in runs), tokens.get(name, "-"))
    out = _out()
    out.print(table)
    if "pool_tokens" in result:
        line = f"ratio pof / recompute [bold]{result['ratio']:.4f}[/bold]"
        if result.get("pof_vs_example") is not None:
            line += f", pof / ExampleConnector {result['pof_vs_example']:.3f}"
        out.print(line)
    if "fabric" in result:
        out.print(f"fabric: B's TTFT from A's pool over NIXL / recompute [bold]{result['fabric']['ratio']:.4f}"
                  f"[/bold] ({result['fabric']['remote_pages_loaded']:.0f} remote pages loaded)")
    return 0


def cmd_bench_router(args: argparse.Namespace) -> int:
    result = bench_router.run(model=args.model, tenants=args.tenants, system_tokens=args.system_tokens,
                              requests=args.requests, clients=args.clients, rate=args.rate, hot_share=args.hot_share,
                              kv_tokens=args.kv_tokens, seed=args.seed, progress=_progress)
    if args.json:
        _print_json(result)
        return 0
    w = result["workload"]
    how = f"{w['rate']:g} requests/s" if w["rate"] > 0 else f"{w['clients']} clients"
    table = Table(title=f"routers, {w['requests']} requests of {w['tenants']} tenants (hot share {w['hot_share']}), "
                        f"{how}", title_justify="left")
    for name in ("router", "mean TTFT s", "p90 TTFT s", "hit rate", "of first-touch bound", "pool tokens"):
        table.add_column(name, justify="right" if name != "router" else "left")
    for name, row in result["policies"].items():
        table.add_row(name, f"{row['mean_ttft_s']:.3f}", f"{row['p90_ttft_s']:.3f}", f"{row['hit_rate']:.3f}",
                      str(row["hit_vs_first_touch_bound"]), str(row["pool_hit_tokens"]))
    out = _out()
    out.print(table)
    out.print(f"ratio pof / vllm-router cache_aware [bold]{result['ratio']:.3f}[/bold], pof / round_robin "
              f"{result['pof_vs_round_robin']:.3f}; first-touch bound hit rate {result['first_touch_bound_hit_rate']}")
    return 0


# ---- the parser -------------------------------------------------------------------------------


def _add_stats_args(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--config", metavar="FILE", help="pof YAML/JSON config (default: index_url embedded)")
    where.add_argument("--url", help="index server URL, e.g. redis://host:6379/0 or unix:///path.sock")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(handler=cmd_index_stats)


def _add_index(sub: Any) -> None:
    index = sub.add_parser("index", help="run, stop and inspect the locality index",
                           description="Run, stop and inspect the locality index.")
    index.set_defaults(handler=_usage(index))
    isub = index.add_subparsers(title="commands", metavar="COMMAND")
    serve = isub.add_parser("serve", help="run this host's embedded index server in the foreground",
                            description="Run the embedded index server (index_url: embedded) in the "
                                        "foreground and print the URL clients use.")
    serve.add_argument("--config", metavar="FILE", help="take runtime_dir from this pof config")
    serve.add_argument("--runtime-dir", metavar="DIR", help="where the socket and pidfile live "
                                                            "(default: the config's runtime_dir)")
    serve.add_argument("--idle-s", type=float, metavar="N", default=None,
                       help="stop after N seconds without clients (default: run until stopped)")
    _add_api_args(serve, 8470)
    serve.set_defaults(handler=cmd_index_serve)
    api = isub.add_parser("api", help="serve the locality API for a running index (e.g. redis://...)",
                          description="Serve POST /v1/locality, GET /v1/nodes, /metrics and /healthz for the "
                                      "index at --url.")
    api.add_argument("--url", required=True, help="index server URL")
    _add_api_args(api, 8470)
    api.set_defaults(handler=cmd_index_api)
    stop = isub.add_parser("stop", help="stop this host's embedded index server",
                           description="Stop the embedded index server of a runtime directory.")
    stop.add_argument("--config", metavar="FILE", help="take runtime_dir from this pof config")
    stop.add_argument("--runtime-dir", metavar="DIR", help="default: the config's runtime_dir")
    stop.set_defaults(handler=cmd_index_stop)
    _add_stats_args(isub.add_parser("stats", help="live nodes and index totals",
                                    description="Show live nodes (tier capacity, use, domain) and index "
                                                "totals of a running index server."))


def _add_bench(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmark the tiers and the index on this host",
                           description="Benchmarks whose ratio compares pof with a bare baseline "
                                       "measured in the same run.")
    bench.set_defaults(handler=_usage(bench))
    bsub = bench.add_subparsers(title="benchmarks", metavar="BENCH")
    tiers = bsub.add_parser("tiers", help="page put+get through each tier vs. numpy memcpy",
                            description="Put 2x a tier's slot count of pages (so slots are evicted and "
                                        "reused), get every page still stored; compare with numpy.copyto "
                                        "of the same bytes into the same slots.")
    tiers.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    tiers.add_argument("--sizes", type=_sizes, default=_sizes("64KiB,256KiB,1MiB,2MiB"),
                       help="page payload sizes, comma-separated (default: 64KiB,256KiB,1MiB,2MiB)")
    tiers.add_argument("--tier-size", type=_size, default=256 << 20, help="capacity of each tier (default 256MiB)")
    tiers.add_argument("--media", type=_media, default=["cpu_dram", "cxl"],
                       help="comma-separated media (default: cpu_dram,cxl; cxl is a file under /dev/shm)")
    tiers.add_argument("--repeat", type=int, default=3, help="passes of each; the best is kept (default 3)")
    tiers.set_defaults(handler=cmd_bench_tiers)
    index = bsub.add_parser("index", help="prefix-lookup latency vs. one round trip, memory per location",
                            description="Measure longest_prefix latency against one Redis round trip, "
                                        "and server memory per published location.")
    index.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    index.add_argument("--pages", type=int, default=2000, help="pages in the looked-up chain (default 2000)")
    index.add_argument("--nodes", type=int, default=4, help="nodes holding leading runs of it (default 4)")
    index.add_argument("--iterations", type=int, default=300, help="timed lookups (default 300)")
    index.add_argument("--memory-pages", type=int, default=100_000,
                       help="locations published for the memory figure (default 100000)")
    index.add_argument("--url", help="use this server instead of starting a private one (its data is "
                                     "left as found)")
    index.set_defaults(handler=cmd_bench_index)
    fabric = bsub.add_parser("fabric", help="remote page fetch through pof vs. a raw NIXL READ",
                             description="Start an owner pool node in a second process; fetch its pages over "
                                         "NIXL through pof (Pool.open_read: READ, validation, copy out) and with "
                                         "a bare NIXL READ of the same slots, interleaved. Needs NIXL.")
    fabric.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    fabric.add_argument("--layers", type=int, default=8, help="layer segments per page (default 8)")
    fabric.add_argument("--segment-bytes", type=_size, default=256 << 10,
                        help="bytes per layer segment (default 256KiB: the 2 MiB pages of `pof bench vllm`'s model)")
    fabric.add_argument("--pages", type=int, default=32, help="pages the owner stores (default 32)")
    fabric.add_argument("--batch", type=int, default=16, help="pages per fetch (default 16)")
    fabric.add_argument("--iterations", type=int, default=50, help="timed batches per path (default 50)")
    fabric.add_argument("--latency-samples", type=int, default=100,
                        help="timed single-page fetches per path (default 100)")
    fabric.add_argument("--tls", default="tcp", help="UCX transports, '' for UCX's choice (default tcp)")
    fabric.add_argument("--ucx-devices", default="lo", help="UCX NET_DEVICES, '' for UCX's choice (default lo)")
    fabric.set_defaults(handler=cmd_bench_fabric)
    hbm = bsub.add_parser("hbm", help="peer-GPU HBM and host-tier reads vs. raw torch copies",
                          description="Move the same pages through pof's peer_hbm and cpu_dram tiers (checked "
                                      "reads and writes) and with plain torch copies between the same memories, "
                                      "in the same run. Needs PyTorch; without CUDA it runs on CPU tensors.")
    hbm.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    hbm.add_argument("--device", help="the engine's device (default cuda:0, or cpu without CUDA)")
    hbm.add_argument("--peer", help="device of the peer_hbm region (default the last GPU, or cpu without CUDA)")
    hbm.add_argument("--layers", type=int, default=32, help="layer segments per page (default 32)")
    hbm.add_argument("--segment-bytes", type=_size, default=256 << 10, help="bytes per layer segment (default 256KiB)")
    hbm.add_argument("--pages", type=int, default=32, help="pages moved per pass (default 32)")
    hbm.add_argument("--min-seconds", type=float, default=0.3, help="measuring time per row (default 0.3)")
    hbm.set_defaults(handler=cmd_bench_hbm)
    vllm = bsub.add_parser("vllm", help="TTFT from the pool vs. recompute vs. vLLM's ExampleConnector",
                           description="Start three vLLM servers in turn (no connector, PoFConnector, "
                                       "ExampleConnector) and time long prompts served by each; with --fabric "
                                       "also two PoFConnector servers side by side, B served from A's pool over "
                                       "NIXL. Needs vLLM (and NIXL for --fabric).")
    vllm.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    vllm.add_argument("--model", metavar="DIR", help="model directory (default: build the local 'bench' model)")
    vllm.add_argument("--prompt-tokens", type=int, default=6000, help="tokens per prompt (default 6000)")
    vllm.add_argument("--prompts", type=int, default=3, help="distinct prompts timed per server (default 3)")
    vllm.add_argument("--dtype", default="float32",
                      help="model dtype (default float32: bf16 is emulated, and slow, on CPUs without AVX512-BF16)")
    vllm.add_argument("--block-size", type=int, default=128, help="vLLM block size = page size (default 128)")
    vllm.add_argument("--setups", type=_setups, default=["recompute", "pof", "example"],
                      help="comma-separated, of recompute,pof,example,fabric (default recompute,pof,example)")
    vllm.add_argument("--fabric", action="store_true",
                      help="also run the fabric pair: server B served from server A's pool over NIXL (needs NIXL)")
    vllm.set_defaults(handler=cmd_bench_vllm)
    router = bsub.add_parser("router", help="pof router + pool vs vllm-router round_robin / cache_aware",
                             description="A multi-tenant workload (one hot tenant, concurrent clients, KV-limited "
                                         "servers) through vllm-router round_robin and cache_aware (plain vLLM "
                                         "servers) and pof router (servers sharing a pool). Needs vLLM and "
                                         "vllm-router.")
    router.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    router.add_argument("--model", metavar="DIR", help="model directory (default: build the local 'tiny' model)")
    router.add_argument("--tenants", type=int, default=12, help="tenants, each with its system prompt (default 12)")
    router.add_argument("--system-tokens", type=int, default=2900, help="system prompt tokens (default 2900)")
    router.add_argument("--requests", type=int, default=160, help="requests per router (default 160)")
    router.add_argument("--rate", type=float, default=3.0,
                        help="open-loop Poisson arrivals per second; 0: closed loop with --clients (default 3)")
    router.add_argument("--clients", type=int, default=4, help="closed-loop clients when --rate is 0 (default 4)")
    router.add_argument("--hot-share", type=float, default=0.7, help="the hot tenant's share (default 0.7)")
    router.add_argument("--kv-tokens", type=int, default=12288, help="KV cache tokens per server (default 12288)")
    router.add_argument("--seed", type=int, default=7, help="workload seed (default 7)")
    router.set_defaults(handler=cmd_bench_router)


# ---- pof relay --------------------------------------------------------------------------------


def cmd_relay(args: argparse.Namespace) -> int:
    """Run a :class:`~pof_connector.router.relay.Relay` until SIGTERM or Ctrl-C."""
    import logging
    import signal

    import zmq

    from pof_connector.router.relay import Relay

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    config = PofConfig.from_file(args.config)
    try:
        relay = Relay(config, args.engine_events, args.bind, replay_bind=args.replay_bind,
                      engine_topic=args.engine_topic, advertise_engine_events=args.advertise_engine_events,
                      pool_residency=not args.no_pool_residency, poll_s=args.poll_s, refresh_s=args.refresh_s,
                      engine_url=args.engine_url)
    except zmq.ZMQError as e:            # e.g. the bind address is taken
        raise CommandError(f"relay: {e}") from e
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    relay.run(stop)
    return 0


def _add_relay(sub: Any) -> None:
    p = sub.add_parser("relay", help="feed a KV-event router an engine's prefix cache and its pool",
                       description="Subscribe to a vLLM server's KV events; publish its prefix cache into the "
                                   "index (node <node_id>:engine) and re-publish its events plus the pages its "
                                   "pool can load (medium CPU) for vllm-router --policy kv_aware "
                                   "(--kv-event-source WORKER_URL=BIND).")
    p.add_argument("--config", required=True, metavar="FILE",
                   help="the engine's pof config (its node_id, index_url), JSON or YAML")
    p.add_argument("--engine-events", required=True, metavar="ENDPOINT",
                   help="the engine's KV event publisher, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--bind", required=True, metavar="ENDPOINT", help="where routers connect, e.g. tcp://*:5657")
    p.add_argument("--replay-bind", metavar="ENDPOINT",
                   help="serve vLLM's replay protocol here (for --kv-event-replay-source)")
    p.add_argument("--engine-topic", default="", help="the engine's KV event topic (default: empty)")
    p.add_argument("--advertise-engine-events", metavar="ENDPOINT",
                   help="the engine endpoint as other hosts' relays reach it (default --engine-events)")
    p.add_argument("--no-pool-residency", action="store_true", help="forward the engine's events only")
    p.add_argument("--engine-url", metavar="URL",
                   help="the engine's HTTP base URL: its /metrics give the node load the locality API reports")
    p.add_argument("--poll-s", type=float, default=0.5, help="how often the pool view is refreshed (default 0.5)")
    p.add_argument("--refresh-s", type=float, default=30.0,
                   help="how often the whole pool view is re-sent, for routers that joined late (default 30)")
    p.set_defaults(handler=cmd_relay)


# ---- pof memd ---------------------------------------------------------------------------------


def cmd_memd(args: argparse.Namespace) -> int:
    """Run a :class:`~pof_connector.fabric.memory_node.MemoryNode` until SIGTERM or Ctrl-C."""
    import logging
    import signal

    from pof_connector.fabric import FabricError
    from pof_connector.memd import MemoryNode

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    config = PofConfig.from_file(args.config)
    try:
        node = MemoryNode(config, args.slot_size)
    except FabricError as e:             # e.g. the UCX backend did not start on these devices
        raise CommandError(f"memd: {e}") from e
    signal.signal(signal.SIGTERM, lambda *_: node.stop())
    signal.signal(signal.SIGINT, lambda *_: node.stop())
    try:
        node.run(args.report_s)
    finally:
        node.close()
    return 0


def _add_memd(sub: Any) -> None:
    p = sub.add_parser("memd", help="a memory-only pool node: lends its DRAM/CXL to other nodes' spilled pages",
                       description="Run a pool node without an engine: its tiers (config `tiers`) are registered "
                                   "over NIXL (config `fabric`, enabled: true) and lent, with leases, to nodes "
                                   "whose own tiers are full (fabric.spill). Stops cleanly on SIGTERM.")
    p.add_argument("--config", required=True, metavar="FILE", help="pof config (node_id, index_url, tiers, fabric)")
    p.add_argument("--slot-size", type=_size, required=True, metavar="SIZE",
                   help="bytes per slot: at least the page size of the writers it serves (their pool's "
                        "page_bytes, e.g. as `pof stats --json` shows in their meta)")
    p.add_argument("--report-s", type=float, default=10.0, metavar="N",
                   help="log the occupancy every N seconds when it changed (default 10)")
    p.set_defaults(handler=cmd_memd)


def _usage(parser: argparse.ArgumentParser) -> Handler:
    """The handler of a command group given no command: its help, and the usage-error code."""
    def show(_: argparse.Namespace) -> int:
        parser.print_help(sys.stderr)
        return 2
    return show


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pof", description="pof-connector: a cluster-wide KV-cache pool "
                                                             "for vLLM and SGLang.")
    parser.set_defaults(handler=_usage(parser))
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_index(sub)
    _add_stats_args(sub.add_parser("stats", help="same as `pof index stats`",
                                   description="Show live nodes and index totals (same as `pof index stats`)."))
    _add_bench(sub)
    router_serve.add_parser(sub)
    _add_relay(sub)
    _add_memd(sub)
    return parser


def _exit_code(code: object) -> int:
    """argparse exits with None, an int or a message; ``main`` returns an int instead."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pof`` console script; returns the exit code rather than exiting."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:            # --help, or a usage error argparse already printed
        return _exit_code(e.code)
    handler: Handler = args.handler
    try:
        return handler(args)
    except (CommandError, ConfigError, BenchError, IndexUnavailable, FileNotFoundError) as e:
        _err().print(f"pof: {e}", markup=False, soft_wrap=True)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
