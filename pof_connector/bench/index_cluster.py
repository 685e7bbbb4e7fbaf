"""``pof bench index --cluster``: the locality index on a Redis Cluster against one server, same run.

Both are started here from the same server binary, on loopback TCP: one private server, and a cluster of
``masters`` masters with ``replicas`` replicas each on loopback. The same chain is published on
both by the same nodes; lookups alternate between them (so both see the same host load), and
``cluster_ratio`` = cluster lookup p50 / single-server lookup p50. Saturation: ``clients``
processes look up as fast as they can for ``saturate_s`` seconds against each (lookups/s in all).
Memory: the masters' ``used_memory`` growth per location at ``memory_pages / 2`` and
``memory_pages`` locations (measured); the figure at 10M locations (and at 1M when
``memory_pages`` is smaller) is extrapolated from the growth between those two points, and says so.
"""

from __future__ import annotations

import multiprocessing
import secrets
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

from pof_connector.bench import BenchError, Progress, quiet
from pof_connector.bench.index import WARMUP, _namespace, _pct, _publish, _publish_chain, _server_version, _verify
from pof_connector.bench.vllm_server import free_port
from pof_connector.index import redis_index
from pof_connector.index.base import NodeInfo
from pof_connector.index.client import redis_client
from pof_connector.index.cluster_servers import ClusterServers
from pof_connector.index.redis import RedisIndex, loc_key
from pof_connector.index.redis_cluster import BUCKETS, bucket_key
from pof_connector.index.server import RedisServer
from pof_connector.pages.keys import DIGEST_BYTES, PageKey

NOTE = ("single and cluster are started by the bench from the same binary on this host, all on loopback TCP; "
        "lookups alternate "
        "between them; cluster_ratio = cluster lookup p50 / single-server lookup p50 (goal <= 1.5); lookups/s: "
        "`clients` processes looking up the same chain as fast as they can; memory: sum of the masters' "
        "used_memory growth (replicas hold as much again each), hash_bytes: MEMORY USAGE of the record hashes "
        "alone; client_cpu: the looking-up thread's CPU time "
        "per lookup (the rest of a lookup's time is the servers and the host's scheduling)")


def run(pages: int = 2000, nodes: int = 4, iterations: int = 300, memory_pages: int = 1_000_000,
        masters: int = 3, replicas: int = 1, clients: int = 4, saturate_s: float = 3.0,
        progress: Progress = quiet) -> dict[str, Any]:
    if masters < 1 or clients < 1 or memory_pages < 2 or iterations < 1 or pages < nodes or nodes < 1:
        raise BenchError("need masters, clients, iterations, nodes >= 1, pages >= nodes and memory_pages >= 2")
    with tempfile.TemporaryDirectory(prefix="pof-bench-", dir="/tmp") as tmp:
        single = RedisServer(tmp, port=free_port()).start()     # TCP on loopback, as the cluster's nodes
        cluster = None
        try:
            cluster = ClusterServers(masters, replicas).start()
            progress(f"index: single server pid {single.pid}; cluster of {masters} masters + "
                     f"{masters * replicas} replicas at {cluster.url}")
            return _measure_both(single, cluster, pages, nodes, iterations, memory_pages, clients, saturate_s,
                                 progress)
        finally:
            if cluster is not None:
                cluster.stop()
            single.stop()


def _measure_both(single: RedisServer, cluster: ClusterServers, pages: int, nodes: int, iterations: int,
                  memory_pages: int, clients: int, saturate_s: float, progress: Progress) -> dict[str, Any]:
    run_id = secrets.token_hex(4)
    opened: list[RedisIndex] = []
    try:
        out: dict[str, Any] = {"bench": "index_cluster"}
        holders = {}
        for name, url in (("single", single.url), ("cluster", cluster.url)):
            holders[name] = [redis_index(url, f"bench-{run_id}-{k}") for k in range(nodes)]
            opened.extend(holders[name])
            for c in holders[name]:
                assert c.node_id is not None
                c.heartbeat(NodeInfo(c.node_id), ttl_s=600)
        chains = {name: _publish_chain(holders[name], pages, run_id, []) for name in holders}
        keys, expected = chains["single"]
        readers = {name: redis_index(url, None) for name, url in (("single", single.url), ("cluster", cluster.url))}
        opened.extend(readers.values())
        progress(f"index: {WARMUP} warm-ups + {iterations} lookups of {pages} pages on each, alternating")
        lat = _alternate(readers, keys, expected, iterations)
        for name in ("single", "cluster"):
            out[f"{name}_lookup_p50_ms"] = _pct(lat[name], 50)
            out[f"{name}_lookup_p99_ms"] = _pct(lat[name], 99)
            out[f"{name}_client_cpu_p50_ms"] = _pct(lat[name + "_cpu"], 50)
        out["cluster_ratio"] = round(float(np.percentile(lat["cluster"], 50) / np.percentile(lat["single"], 50)), 3)
        for name, url in (("single", single.url), ("cluster", cluster.url)):
            progress(f"index: {clients} client processes look up for {saturate_s:.0f} s on the {name}")
            out[f"{name}_lookups_per_s"] = _saturate(url, keys, expected, clients, saturate_s)
        progress(f"index: publishing {memory_pages:,} locations on each")
        for name, url in (("single", single.url), ("cluster", cluster.url)):
            out.update({f"{name}_{k}": v for k, v in _memory(holders[name][0], url, cluster if name == "cluster"
                                                               else None, memory_pages, run_id).items()})
        out.update({"pages": pages, "nodes": nodes, "iterations": iterations, "memory_pages": memory_pages,
                    "masters": cluster.masters, "replicas_per_master": cluster.replicas, "clients": clients,
                    "saturate_s": saturate_s, "server_version": _server_version(single.url, None), "note": NOTE})
        return out
    finally:
        for c in opened:
            c.close()


def _alternate(readers: dict[str, RedisIndex], keys: list[PageKey], expected: dict[str, int],
               iterations: int) -> dict[str, list[float]]:
    """Per reader, the lookup times (ms) of ``iterations`` lookups taken in turn, and (``<name>_cpu``)
    the client's CPU time of each (how much is this process, not the servers); every answer is checked."""
    for _ in range(WARMUP):
        for r in readers.values():
            _verify(r.longest_prefix(keys), expected)
    out: dict[str, list[float]] = {n: [] for name in readers for n in (name, name + "_cpu")}
    for _ in range(iterations):
        for name, r in readers.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            got = r.longest_prefix(keys)
            out[name].append((time.perf_counter() - t0) * 1000)
            out[name + "_cpu"].append((time.thread_time() - c0) * 1000)
            _verify(got, expected, slots=False)
    return out


def _saturate(url: str, keys: list[PageKey], expected: dict[str, int], clients: int, seconds: float) -> float:
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(clients, mp_context=ctx) as ex:
        rates = list(ex.map(_lookup_loop, [url] * clients, [keys] * clients, [expected] * clients,
                            [seconds] * clients))
    return round(sum(rates))


def _lookup_loop(url: str, keys: list[PageKey], expected: dict[str, int], seconds: float) -> float:
    """Lookups per second of one client process (after warm-ups; every 50th answer is checked)."""
    index = redis_index(url, None)
    try:
        for _ in range(WARMUP):
            _verify(index.longest_prefix(keys), expected)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            got = index.longest_prefix(keys)
            if n % 50 == 0:
                _verify(got, expected, slots=False)
            n += 1
        return n / (time.perf_counter() - t0)
    finally:
        index.close()


def _used(url: str, cluster: ClusterServers | None) -> int:
    if cluster is not None:
        return sum(int(p.client().info("memory")["used_memory"]) for p in cluster.primaries())
    r = redis_client(url, None, timeout_s=None)
    try:
        return int(r.info("memory")["used_memory"])
    finally:
        r.close()


def _hash_bytes(client: RedisIndex, ns: bytes, url: str, cluster: ClusterServers | None) -> int:
    """``MEMORY USAGE`` of the hashes holding ``ns``'s records: the data alone, without the
    servers' buffers (replication, scripts) that ``used_memory`` also counts."""
    if cluster is None:
        r = redis_client(url, None, timeout_s=None)
        try:
            return int(r.memory_usage(loc_key(ns), samples=0) or 0)
        finally:
            r.close()
    keys = [bucket_key(ns, b) for b in range(BUCKETS)]
    return sum(int(client._r.memory_usage(k, samples=0) or 0) for k in keys)


def _memory(client: RedisIndex, url: str, cluster: ClusterServers | None, count: int,
            run_id: str) -> dict[str, Any]:
    """Memory growth at ``count // 2`` and ``count`` locations, and the publish rate."""
    ns = _namespace(run_id, "memory")
    digests = np.random.default_rng(2).bytes(count * DIGEST_BYTES)
    keys = [PageKey(ns, digests[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES]) for i in range(count)]
    half = count // 2
    base = _used(url, cluster)
    t0 = time.perf_counter()
    _publish(client, keys[:half])
    elapsed = time.perf_counter() - t0
    mid = _used(url, cluster)
    t0 = time.perf_counter()
    _publish(client, keys[half:])
    elapsed += time.perf_counter() - t0
    end = _used(url, cluster)
    slope = (end - mid) / (count - half)
    return {
        "publish_pages_per_s": round(count / elapsed),
        "bytes_per_location_measured": round((end - base) / count, 1),
        "hash_bytes_per_location": round(_hash_bytes(client, ns, url, cluster) / count, 1),
        **_at(1_000_000, count, end - base, slope),
        **_at(10_000_000, count, end - base, slope),
    }


def _at(n: int, measured: int, grown: int, slope: float) -> dict[str, Any]:
    """Bytes per location at ``n`` locations: measured when ``n`` locations were published,
    else extrapolated along the growth per location between the two measured points."""
    label = f"{n // 1_000_000}m"
    if n == measured:
        return {f"bytes_per_location_{label}": round(grown / n, 1), f"bytes_per_location_{label}_is": "measured"}
    total = grown + (n - measured) * slope
    return {f"bytes_per_location_{label}": round(total / n, 1),
            f"bytes_per_location_{label}_is": f"extrapolated from {measured:,}"}
