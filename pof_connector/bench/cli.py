"""``pof bench tiers | index | fabric | hbm | vllm | router | pd | router-overhead | lmcache | ...``: run a
benchmark, print its table or JSON."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from rich.table import Table

from pof_connector.bench import fabric as bench_fabric  # imports NIXL only when run
from pof_connector.bench import hbm as bench_hbm  # imports torch only when run
from pof_connector.bench import index as bench_index
from pof_connector.bench import index_cluster as bench_index_cluster
from pof_connector.bench import lmcache as bench_lmcache  # starts LMCache engines in its venv; imports no LMCache
from pof_connector.bench import router as bench_router  # starts vLLM servers and routers; imports no vLLM
from pof_connector.bench import tiers as bench_tiers
from pof_connector.bench import vllm as bench_vllm  # starts vLLM servers; imports no vLLM itself
from pof_connector.bench.audit import add_audit_parser
from pof_connector.bench.capacity_cli import add_capacity_parser
from pof_connector.bench.chaos_cli import add_chaos_parser
from pof_connector.bench.pd_cli import add_pd_parser
from pof_connector.bench.router_overhead_cli import add_router_overhead_parser
from pof_connector.cli_support import out_console, print_json, progress, size_arg, usage
from pof_connector.config import ConfigError, PofConfig, format_size, redact_url


def _rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        rates = []
    if not rates or any(not 0 < r <= 1 for r in rates):
        raise argparse.ArgumentTypeError(f"audit rates are numbers in (0, 1], comma-separated, got {text!r}")
    return rates


def _setups(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    bad = [n for n in names if n not in bench_vllm.SETUPS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"setups are some of {', '.join(bench_vllm.SETUPS)}, got {text!r}")
    return names


def _sizes(text: str) -> list[int]:
    return [size_arg(part) for part in text.split(",") if part.strip()]


def _media(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def cmd_bench_tiers(args: argparse.Namespace) -> int:
    result = bench_tiers.run(media=args.media, sizes=args.sizes, tier_size=args.tier_size, repeat=args.repeat,
                       progress=progress)
    if args.json:
        print_json(result)
        return 0
    table = Table(title=f"tier put+get vs. {result['baseline']}", title_justify="left")
    table.add_column("medium")
    for name in ("page", "slots", "pages put", "pages got", "ours GB/s", "memcpy GB/s", "ratio"):
        table.add_column(name, justify="right")
    for row in result["rows"]:
        table.add_row(row["medium"], row["page_size"], str(row["slots"]), str(row["pages_put"]),
                      str(row["pages_got"]), f"{row['ours_gbps']:.2f}", f"{row['memcpy_gbps']:.2f}",
                      f"{row['ratio']:.3f}")
    out = out_console()
    out.print(table)
    out.print(f"ratio (geometric mean of rows) [bold]{result['ratio']:.3f}[/bold], "
              f"min_ratio {result['min_ratio']:.3f}  (1.0 = as fast as a bare memcpy)")
    return 0


def cmd_bench_index(args: argparse.Namespace) -> int:
    if args.cluster:
        return _bench_index_cluster(args)
    url, auth = args.url, None
    if args.config:
        config = PofConfig.from_file(args.config)
        if not config.index_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"{args.config}: index_url: the bench needs a server URL (redis://, rediss:// or "
                             f"unix://; --cluster compares a cluster it starts with one server), got "
                             f"{redact_url(config.index_url)!r}")
        url, auth = config.index_url, config.index_auth
    result = bench_index.run(pages=args.pages, nodes=args.nodes, iterations=args.iterations,
                             memory_pages=args.memory_pages or 100_000, url=url, progress=progress, auth=auth)
    if args.json:
        print_json(result)
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
    if result["ratio_floor"] is not None:
        table.add_row("server time in the lookup's HMGET", f"{result['server_hmget_ms']:.3f} ms")
        table.add_row("ratio floor (a client taking no time)", f"{result['ratio_floor']:.2f}")
    out_console().print(table)
    return 0


def _bench_index_cluster(args: argparse.Namespace) -> int:
    if args.url or args.config:
        raise ConfigError("--cluster starts its own server and cluster; it takes no --url or --config")
    result = bench_index_cluster.run(pages=args.pages, nodes=args.nodes, iterations=args.iterations,
                                     memory_pages=args.memory_pages or 1_000_000, masters=args.masters,
                                     replicas=args.replicas, clients=args.clients, progress=progress)
    if args.json:
        print_json(result)
        return 0
    table = Table(title=f"index: one server vs a cluster of {args.masters} masters ({result['server_version']})",
                  title_justify="left")
    for col in ("what", "single", "cluster"):
        table.add_column(col, justify="left" if col == "what" else "right")
    for label, key in (("lookup p50 (ms)", "lookup_p50_ms"), ("lookup p99 (ms)", "lookup_p99_ms"),
                       ("lookups/s at saturation", "lookups_per_s"), ("publish pages/s", "publish_pages_per_s"),
                       ("bytes/location at 1M", "bytes_per_location_1m"),
                       ("bytes/location at 10M", "bytes_per_location_10m")):
        table.add_row(label, f"{result['single_' + key]:,}", f"{result['cluster_' + key]:,}")
    table.add_row("cluster_ratio (p50)", "", f"{result['cluster_ratio']:.3f}")
    out_console().print(table)
    return 0


def cmd_bench_fabric(args: argparse.Namespace) -> int:
    result = bench_fabric.run(layers=args.layers, segment_bytes=args.segment_bytes, pages=args.pages,
                              batch=args.batch, iterations=args.iterations, latency_samples=args.latency_samples,
                              tls=args.tls or None, ucx_devices=args.ucx_devices or None, progress=progress)
    if args.json:
        print_json(result)
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
    out = out_console()
    out.print(table)
    out.print(f"ratio pof / raw [bold]{result['ratio']:.3f}[/bold] (with the copy out "
              f"{result['ratio_with_copy_out']:.3f}); byte-exact: {result['exact']} "
              f"(failed {result['failed_pages']}, wrong {result['wrong_pages']})")
    return 0 if result["exact"] else 1


def cmd_bench_hbm(args: argparse.Namespace) -> int:
    engine, peer = bench_hbm.devices(args.device, args.peer)
    progress(f"hbm: engine {engine}, peer region on {peer}; {args.pages} pages of {args.layers} x "
              f"{format_size(args.segment_bytes)}")
    result = bench_hbm.run(engine=engine, peer=peer, layers=args.layers, segment_bytes=args.segment_bytes,
                           pages=args.pages, min_s=args.min_seconds)
    if args.json:
        print_json(result)
        return 0
    table = Table(title=f"page moves, {result['pages']} pages of {format_size(result['page_bytes'])} "
                        f"(engine {engine}, peer {peer})", title_justify="left")
    for name in ("row", "pof GB/s", "raw", "raw GB/s", "ratio"):
        table.add_column(name, justify="left" if name in ("row", "raw") else "right")
    for name, row in result["rows"].items():
        table.add_row(name, f"{row['pof_gbps']:.3f}", row["raw"], f"{row['raw_gbps']:.3f}", f"{row['ratio']:.3f}")
    out = out_console()
    out.print(table)
    out.print(f"ratio (peer read to the engine's device) [bold]{result['ratio']:.3f}[/bold]; peer HBM vs. host "
              f"tier {result['peer_vs_host_tier']:.3f}; checked-read bound "
              f"{result['peer_read_to_device_bound_gbps']:.3f} GB/s")
    return 0


def cmd_bench_lmcache(args: argparse.Namespace) -> int:
    result = bench_lmcache.run(python=args.python, chunks=args.chunks, rounds=args.rounds, layers=args.layers,
                               heads=args.heads, head_dim=args.head_dim, chunk_tokens=args.chunk_tokens,
                               progress=progress)
    if args.json:
        print_json(result)
        return 0
    table = Table(title=f"LMCache put+get, {result['rounds']} x {result['chunks']} chunks of "
                        f"{format_size(result['chunk_bytes'])} (medians)", title_justify="left")
    for name in ("setup", "put s", "put GB/s", "get s", "get GB/s", "retrieved tokens", "bytes equal"):
        table.add_column(name, justify="left" if name == "setup" else "right")
    med = statistics.median
    for name, row in (("local_cpu alone", result["local_cpu"]), ("LMCache + pof", result["pof"])):
        table.add_row(name, f"{med(row['put_s']):.4f}", f"{row['put_gbps']:.2f}", f"{med(row['get_s']):.4f}",
                      f"{row['get_gbps']:.2f}", str(row["retrieved_tokens"]), str(row["bytes_equal"]))
    out = out_console()
    out.print(table)
    out.print(f"ratio put [bold]{result['ratio_put']:.3f}[/bold] (until in pof {result['ratio_in_pof']:.3f}), "
              f"ratio get [bold]{result['ratio_get']:.3f}[/bold] (pof get from another process's pages vs. "
              "local_cpu get from the engine's own memory; 1.0 = as fast)")
    return 0


def cmd_bench_vllm(args: argparse.Namespace) -> int:
    setups = tuple(args.setups) + (("fabric",) if args.fabric and "fabric" not in args.setups else ())
    result = bench_vllm.run(model=args.model, prompt_tokens=args.prompt_tokens, prompts=args.prompts,
                            dtype=args.dtype, block_size=args.block_size, progress=progress, setups=setups,
                            repeats=args.repeats, audit_rates=tuple(args.audit_rates))
    if args.json:
        print_json(result)
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
    out = out_console()
    out.print(table)
    if "pool_tokens" in result:
        line = f"ratio pof / recompute [bold]{result['ratio']:.4f}[/bold]"
        if result.get("pof_vs_example") is not None:
            line += f", pof / ExampleConnector {result['pof_vs_example']:.3f}"
        out.print(line)
        if result.get("overhead_ratio") is not None:
            out.print(f"above vLLM's own prefix-cache hit ({result['floor_s']:.3f} s): pof +"
                      f"{result['pof_s'] - result['floor_s']:.3f} s for {result['loaded_bytes'] / 1e6:.1f} MB = "
                      f"[bold]{result['overhead_ratio']:.2f}[/bold] x a memcpy of them ({result['memcpy_s']:.4f} s), "
                      f"{result['overhead_ratio_vs_memcpy_threads']:.2f} x one on {bench_vllm.ENGINE_THREADS} threads "
                      f"({result['memcpy_threads_s']:.4f} s)")
            out.print(f"the forward's time in pof per load (vllm:pof_load_wait_seconds): {result['load_wait_s']:.4f} s "
                      f"= [bold]{result['load_wait_ratio']:.2f}[/bold] x the memcpy")
            if result.get("pof_vs_example_above_floor") is not None:
                out.print(f"ExampleConnector +{result['load_overhead_s']['example']:.3f} s above its own server's hit "
                          f"({result['example_floor_s']:.3f} s): pof / ExampleConnector above the floor "
                          f"[bold]{result['pof_vs_example_above_floor']:.2f}[/bold]")
    if "fabric" in result:
        out.print(f"fabric: B's TTFT from A's pool over NIXL / recompute [bold]{result['fabric']['ratio']:.4f}"
                  f"[/bold] ({result['fabric']['remote_pages_loaded']:.0f} remote pages loaded)")
    return 0


def cmd_bench_router(args: argparse.Namespace) -> int:
    names = ("model", "tenants", "system_tokens", "requests", "rate", "clients", "hot_share", "kv_tokens", "api")
    overrides = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    result = bench_router.run(workloads=args.workload, overrides=overrides, seed=args.seed, progress=progress,
                              rounds=args.rounds)
    if args.json:
        print_json(result)
        return 0
    out = out_console()
    for wname, res in result["workloads"].items():
        w = res["workload"]
        how = f"{w['rate']:g} requests/s" if w["rate"] > 0 else f"{w['clients']} clients"
        table = Table(title=f"{wname}: {w['requests']} requests of {w['tenants']} tenants (hot share "
                            f"{w['hot_share']}), {how}, model {Path(w['model']).name}", title_justify="left")
        for col in ("router", "mean TTFT s", "p90 TTFT s", "hit rate", "of first-touch bound", "pool tokens",
                    "own time p50/p99 ms"):
            table.add_column(col, justify="right" if col != "router" else "left")
        for name, row in res["policies"].items():
            own = row.get("routing")
            table.add_row(name, f"{row['mean_ttft_s']:.3f}", f"{row['p90_ttft_s']:.3f}", f"{row['hit_rate']:.3f}",
                          str(row["hit_vs_first_touch_bound"]), str(row["pool_hit_tokens"]),
                          f"{own['overhead_p50_ms']:.2f} / {own['overhead_p99_ms']:.2f}" if own else "")
        out.print(table)
        spread = (f" (rounds: {', '.join(f'{x:.2f}' for x in res['ratio_vs_best_by_round'])})"
                  if "ratio_vs_best_by_round" in res else "")
        lo, hi = res["ratio_vs_best_ci95"]
        out.print(f"{wname}: pof / best stock ({res['best_stock']}) [bold]{res['ratio_vs_best']:.3f}[/bold] "
                  f"(95 % interval over requests {lo:.2f}-{hi:.2f}){spread}; goal <= {res['goal']:g}: "
                  f"{res['goal_verdict']}; first-touch bound hit rate {res['first_touch_bound_hit_rate']}")
    return 0


def add_parser(sub: Any) -> None:
    """Register ``pof bench`` and its benchmarks."""
    bench = sub.add_parser("bench", help="benchmark the tiers and the index on this host",
                           description="Benchmarks whose ratio compares pof with a bare baseline "
                                       "measured in the same run.")
    bench.set_defaults(handler=usage(bench))
    bsub = bench.add_subparsers(title="benchmarks", metavar="BENCH")
    tiers = bsub.add_parser("tiers", help="page put+get through each tier vs. numpy memcpy",
                            description="Put 2x a tier's slot count of pages (so slots are evicted and "
                                        "reused), get every page still stored; compare with numpy.copyto "
                                        "of the same bytes into the same slots.")
    tiers.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    tiers.add_argument("--sizes", type=_sizes, default=_sizes("64KiB,256KiB,1MiB,2MiB"),
                       help="page payload sizes, comma-separated (default: 64KiB,256KiB,1MiB,2MiB)")
    tiers.add_argument("--tier-size", type=size_arg, default=256 << 20, help="capacity of each tier (default 256MiB)")
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
    index.add_argument("--memory-pages", type=int, default=None,
                       help="locations published for the memory figure (default 100000; 1000000 with --cluster)")
    index.add_argument("--cluster", action="store_true",
                       help="compare one server with a Redis Cluster that the bench starts on loopback")
    index.add_argument("--masters", type=int, default=3, help="--cluster: masters (default 3)")
    index.add_argument("--replicas", type=int, default=1, help="--cluster: replicas per master (default 1)")
    index.add_argument("--clients", type=int, default=4,
                       help="--cluster: client processes for the saturation figure (default 4)")
    where = index.add_mutually_exclusive_group()
    where.add_argument("--url", help="use this server instead of starting a private one (its data is "
                                     "left as found)")
    where.add_argument("--config", metavar="FILE", help="use the server of this pof config's index_url, with its "
                                                        "index_* credentials")
    index.set_defaults(handler=cmd_bench_index)
    fabric = bsub.add_parser("fabric", help="remote page fetch through pof vs. a raw NIXL READ",
                             description="Start an owner pool node in a second process; fetch its pages over "
                                         "NIXL through pof (Pool.open_read: READ, validation, copy out) and with "
                                         "a bare NIXL READ of the same slots, interleaved. Needs NIXL.")
    fabric.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    fabric.add_argument("--layers", type=int, default=8, help="layer segments per page (default 8)")
    fabric.add_argument("--segment-bytes", type=size_arg, default=256 << 10,
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
    hbm.add_argument("--segment-bytes", type=size_arg, default=256 << 10,
                     help="bytes per layer segment (default 256KiB)")
    hbm.add_argument("--pages", type=int, default=32, help="pages moved per pass (default 32)")
    hbm.add_argument("--min-seconds", type=float, default=0.3, help="measuring time per row (default 0.3)")
    hbm.set_defaults(handler=cmd_bench_hbm)
    lmc = bsub.add_parser("lmcache", help="LMCache local_cpu alone vs. LMCache + pof's storage plugin",
                          description="Store and retrieve the same chunks through LMCache's engine with its "
                                      "local_cpu backend alone, then with pof as its storage plugin (stored by one "
                                      "process, retrieved by another through the index and a shared CXL region), "
                                      "in the same run. Needs the LMCache venv (ci/lmcache_venv.sh).")
    lmc.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    lmc.add_argument("--python", default=sys.executable,
                     help="the LMCache venv's interpreter (default: this one)")
    lmc.add_argument("--chunks", type=int, default=8, help="chunks per prompt (default 8)")
    lmc.add_argument("--rounds", type=int, default=3, help="prompts, each timed (default 3)")
    lmc.add_argument("--layers", type=int, default=16, help="model layers (default 16)")
    lmc.add_argument("--heads", type=int, default=4, help="KV heads (default 4)")
    lmc.add_argument("--head-dim", type=int, default=128, help="head size (default 128)")
    lmc.add_argument("--chunk-tokens", type=int, default=256, help="LMCache chunk_size (default 256)")
    lmc.set_defaults(handler=cmd_bench_lmcache)
    vllm = bsub.add_parser("vllm", help="TTFT from the pool vs. recompute vs. vLLM's ExampleConnector",
                           description="Start three vLLM servers in turn (no connector, PoFConnector, "
                                       "ExampleConnector) and time long prompts served by each; with --fabric "
                                       "also two PoFConnector servers side by side, B served from A's pool over "
                                       "NIXL. Needs vLLM (and NIXL for --fabric).")
    vllm.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    vllm.add_argument("--model", metavar="DIR", help="model directory (default: build the local 'bench' model)")
    vllm.add_argument("--prompt-tokens", type=int, default=6000, help="tokens per prompt (default 6000)")
    vllm.add_argument("--prompts", type=int, default=3, help="distinct prompts timed per server (default 3)")
    # A TTFT here varies by +-10 ms from request to request, as much as a load adds: the medians
    # need tens of pairs, which cost ~1 s each (the recomputes dominate the bench's time).
    vllm.add_argument("--repeats", type=int, default=10,
                      help="timed loads per prompt on the connector servers, each followed by the same prompt as a "
                           "hit in vLLM's own prefix cache (the floor), alternating (default 10)")
    vllm.add_argument("--dtype", default="float32",
                      help="model dtype (default float32: bf16 is emulated, and slow, on CPUs without AVX512-BF16)")
    vllm.add_argument("--block-size", type=int, default=128, help="vLLM block size = page size (default 128)")
    vllm.add_argument("--setups", type=_setups, default=["recompute", "pof", "example"],
                      help="comma-separated, of recompute,pof,example,fabric (default recompute,pof,example)")
    vllm.add_argument("--fabric", action="store_true",
                      help="also run the fabric pair: server B served from server A's pool over NIXL (needs NIXL)")
    vllm.add_argument("--audit-rates", type=_rates, default=[], metavar="R,R",
                      help="also the pof server with each audit.sample_rate (e.g. 0.01,0.1): TTFT with the audit on")
    vllm.set_defaults(handler=cmd_bench_vllm)
    router = bsub.add_parser("router", help="pof router + pool vs vllm-router round_robin / power_of_two / "
                                            "cache_aware, cheap and dear prefill",
                             description="A multi-tenant workload (one hot tenant, open-loop arrivals, KV-limited "
                                         "servers) through vllm-router round_robin, power_of_two and cache_aware "
                                         "(servers with a store-only connector) and pof router (servers sharing a "
                                         "pool), on the tiny model (cheap prefill) and the bench model (dear). "
                                         "Needs vLLM and vllm-router.")
    router.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    router.add_argument("--workload", type=lambda v: [w for w in v.split(",") if w], default=["cheap", "dear"],
                        metavar="W,W", help="workloads to run, of cheap (tiny model), dear (bench model) "
                                            "(default cheap,dear)")
    router.add_argument("--model", metavar="DIR|PRESET", help="model (default: each workload's: tiny, bench)")
    router.add_argument("--tenants", type=int, help="tenants, each with its system prompt (default 12 / 8)")
    router.add_argument("--system-tokens", type=int, help="system prompt tokens (default 2900 / 1024)")
    router.add_argument("--requests", type=int, help="requests per router (default 160 / 60)")
    router.add_argument("--rate", type=float,
                        help="open-loop Poisson arrivals per second; 0: closed loop with --clients (default 3 / 0.8)")
    router.add_argument("--clients", type=int, help="closed-loop clients when --rate is 0 (default 4)")
    router.add_argument("--hot-share", type=float, help="the hot tenant's share (default 0.7)")
    router.add_argument("--kv-tokens", type=int, help="KV cache tokens per server (default 12288 / 6144)")
    router.add_argument("--api", choices=("completions", "chat"),
                        help="send text prompts to /v1/completions, or the same words as a system and a user "
                             "message to /v1/chat/completions (default completions)")
    router.add_argument("--seed", type=int, default=7, help="workload seed (default 7)")
    router.add_argument("--rounds", type=int, default=1,
                        help="passes of every router over the same requests, each on fresh servers, the stock "
                             "routers and pof first by turns; the JSON gives each round's ratio (default 1)")
    router.set_defaults(handler=cmd_bench_router)
    add_pd_parser(bsub)
    add_chaos_parser(bsub)
    add_capacity_parser(bsub)
    add_audit_parser(bsub)
    add_router_overhead_parser(bsub)
