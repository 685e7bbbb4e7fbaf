"""``pof bench index``: prefix-lookup latency and memory cost of the Redis locality index.

A lookup is meant to cost one pipelined round trip whatever the prompt length, so its latency
is reported against one bare round trip (``PING``) to the same server, measured interleaved
with the lookups: the ratio says how much the encoding, the server's ``HMGET`` of every page
and the decoding add on top of the network, and does not depend on how fast this host is.
Memory is the server's own ``used_memory`` growth per published location.
"""

from __future__ import annotations

import secrets
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from pof_connector.bench import BenchError, Progress, quiet
from pof_connector.config import redact_url
from pof_connector.config.credentials import IndexAuth
from pof_connector.index import segments
from pof_connector.index.base import MEDIA, IndexUnavailable, Location, NodeInfo, PrefixMatch
from pof_connector.index.client import redis_client
from pof_connector.index.redis import RedisIndex, flat_key, loc_key, records_key, segment_key
from pof_connector.index.segments import SegmentQuery
from pof_connector.index.server import RedisServer
from pof_connector.pages.keys import Namespace, PageKey, page_keys
from pof_connector.pages.layout import PageSpec

PAGE_TOKENS = 64
SPEC = PageSpec(num_layers=32, segment_bytes=PAGE_TOKENS * 2 * 8 * 128 * 2, page_tokens=PAGE_TOKENS)
"""The page geometry the keys name (a 32-layer model, 8 KV heads of 128, bf16); no page is written."""
WARMUP = 10
BATCH = 5000
MEDIUM = "cpu_dram"
NOTE = ("round_trips_per_lookup is 1 by construction: RedisIndex.longest_prefix sends TIME, the GET of the "
        "leases, the GET of the namespace's placeless flag and one HMGET of every segment's summary (SEGMENT_PAGES "
        "pages each: segments_per_lookup; which holder holds which page, no slots) as a single pipelined buffer, "
        "and this chain has no marked offset and no placeless page, so no second round runs; resolve_p50_ms = the "
        "loader's read "
        "of one holder's slot records for all its pages (one HMGET, the holder of the longest run; not part of a "
        "lookup); ratio = lookup p50 / PING p50, measured "
        "interleaved on the same connection pool; server_hmget_ms = the server's own mean time in that HMGET "
        "(INFO commandstats, private server only), ratio_floor = (PING p50 + server_hmget_ms) / PING p50: the "
        "ratio of a client that took no time at all; decode_ms = the client's decoding of the reply per decoder "
        "(median), decoder = the one the lookups used")


@dataclass(frozen=True)
class Latencies:
    """Per-iteration times in milliseconds."""

    lookup_ms: list[float]
    rtt_ms: list[float]
    resolve_ms: list[float]


def run(
    pages: int = 2000,
    nodes: int = 4,
    iterations: int = 300,
    memory_pages: int = 100_000,
    url: str | None = None,
    progress: Progress = quiet,
    auth: IndexAuth | None = None,
) -> dict[str, Any]:
    """Lookup latency, round-trip latency and memory per location, as ``--json`` prints them.
    ``auth``: how to authenticate to the server at ``url`` (``None``: as the URL says)."""
    _check_args(pages, nodes, iterations, memory_pages)
    with _server(url, progress) as server_url:
        run_id = secrets.token_hex(4)     # fresh node ids and namespaces: safe on a shared --url server
        clients = [RedisIndex(server_url, f"bench-{run_id}-{k}", auth=auth) for k in range(nodes)]
        reader = RedisIndex(server_url, None, auth=auth)
        namespaces: list[bytes] = []
        try:
            for client in clients:
                assert client.node_id is not None
                client.heartbeat(NodeInfo(client.node_id), ttl_s=60)
            keys, expected = _publish_chain(clients, pages, run_id, namespaces)
            progress(f"index: {nodes} nodes hold leading runs of a {pages}-page chain; "
                     f"{WARMUP} warm-ups + {iterations} lookups")
            before = _hmget_stats(server_url, auth)
            lat = _measure(reader, keys, expected, iterations)
            server_ms = _server_ms(before, _hmget_stats(server_url, auth)) if url is None else None
            decode = _decode_ms(server_url, auth, keys, clients, iterations)
            progress(f"index: publishing {memory_pages} locations for the memory figure")
            memory = _memory(clients[0], server_url, auth, memory_pages, run_id, namespaces)
            version = _server_version(server_url, auth)
        finally:
            _cleanup(server_url, auth, reader, clients, namespaces, progress)
    return _result(lat, memory, pages, nodes, iterations, memory_pages, url, version, server_ms) | decode


def _check_args(pages: int, nodes: int, iterations: int, memory_pages: int) -> None:
    if nodes < 1 or pages < nodes:
        raise BenchError(f"need --nodes >= 1 and --pages >= --nodes (every node holds a page), got "
                         f"pages={pages} nodes={nodes}")
    if iterations < 1 or memory_pages < 1:
        raise BenchError(f"--iterations and --memory-pages must be positive, got {iterations} and {memory_pages}")


@contextmanager
def _server(url: str | None, progress: Progress) -> Iterator[str]:
    """``url`` as given, or a private server in a temporary directory, stopped when done."""
    if url is not None:
        yield url
        return
    with tempfile.TemporaryDirectory(prefix="pof-bench-", dir="/tmp") as tmp:
        server = RedisServer(tmp).start()
        progress(f"index: started a private server at {server.url} (pid {server.pid})")
        try:
            yield server.url
        finally:
            server.stop()


def _namespace(run_id: str, part: str) -> bytes:
    return Namespace("pof-bench", "bfloat16", "mha:kv_heads=8:head_dim=128", SPEC, extra=f"{run_id}:{part}").digest


def _publish_chain(clients: Sequence[RedisIndex], pages: int, run_id: str,
                   namespaces: list[bytes]) -> tuple[list[PageKey], dict[str, int]]:
    """Node ``k`` publishes the first ``pages * (nodes - k) // nodes`` pages of one chain."""
    ns = _namespace(run_id, "chain")
    namespaces.append(ns)
    tokens = np.random.default_rng(1).integers(0, 32_000, size=pages * PAGE_TOKENS, dtype=np.uint32)
    keys = page_keys(ns, tokens, PAGE_TOKENS)
    n = len(clients)
    expected: dict[str, int] = {}
    for k, client in enumerate(clients):
        assert client.node_id is not None
        count = pages * (n - k) // n
        _publish(client, keys[:count])
        expected[client.node_id] = count
    return keys, expected


def _publish(client: RedisIndex, keys: Sequence[PageKey]) -> None:
    """Publish ``keys`` at slots 0.. of the client's DRAM tier, in batches of :data:`BATCH`."""
    assert client.node_id is not None
    for start in range(0, len(keys), BATCH):
        batch = keys[start:start + BATCH]
        client.publish([(key, Location(client.node_id, MEDIUM, start + i, 1)) for i, key in enumerate(batch)])


def _measure(reader: RedisIndex, keys: list[PageKey], expected: dict[str, int], iterations: int) -> Latencies:
    """Lookups after warm-ups, each followed by one PING and the loader's slot read of one holder;
    every answer's runs are checked, and every holder's slots after the warm-ups and the last lookup."""
    for _ in range(WARMUP):
        _verify(reader.longest_prefix(keys), expected, slots=True)
    lookup_ms: list[float] = []
    rtt_ms: list[float] = []
    resolve_ms: list[float] = []
    for i in range(iterations):
        t0 = time.perf_counter()
        got = reader.longest_prefix(keys)
        lookup_ms.append((time.perf_counter() - t0) * 1000)
        _verify(got, expected, slots=i == iterations - 1)
        rtt_ms.append(reader.ping_ms())
        longest = max(got.values(), key=lambda m: m.pages)
        t0 = time.perf_counter()
        longest.resolve(longest.pages)
        resolve_ms.append((time.perf_counter() - t0) * 1000)
    return Latencies(lookup_ms, rtt_ms, resolve_ms)


def _verify(got: dict[str, PrefixMatch], expected: dict[str, int], *, slots: bool = True) -> None:
    """A wrong answer makes every latency figure meaningless: stop the benchmark. ``slots``: read and
    check every holder's slots too (a round trip per holder: not after every timed lookup)."""
    counts = {node: m.pages for node, m in got.items()}
    if counts != expected:
        raise BenchError(f"longest_prefix returned page counts {counts}, expected {expected}")
    for node, m in got.items():
        if m.per_tier() != {MEDIUM: expected[node]} or (slots and int(m.slots[-1]) != expected[node] - 1):
            raise BenchError(f"longest_prefix returned wrong locations for {node}: {m.per_tier()}, "
                             f"last slot {int(m.slots[-1])}")


def _decode_ms(url: str, auth: IndexAuth | None, keys: list[PageKey], clients: Sequence[RedisIndex],
               iterations: int) -> dict[str, Any]:
    """The client's decoding of one lookup's reply, per decoder (median ms over ``iterations``), on the
    reply the lookups got: what the native decoder saves inside ``lookup_p50_ms``."""
    query = SegmentQuery.of(keys)
    assert query is not None            # page_keys places every key
    r = redis_client(url, auth, timeout_s=None)
    try:
        vals = r.hmget(segment_key(keys[0].namespace), [f.tobytes() for f in query.fields])
    finally:
        r.close()
    alive = [c.incarnation for c in clients if c.incarnation is not None]
    out: dict[str, float | None] = {}
    for name, native in (("native", True), ("numpy", False)):
        if native and not segments.NATIVE:
            out[name] = None
            continue
        times = []
        for _ in range(iterations):
            t0 = time.perf_counter()
            query.decode(vals, alive, len(MEDIA), native=native)
            times.append((time.perf_counter() - t0) * 1000)
        out[name] = round(float(np.median(times)), 4)
    return {"decoder": "native" if segments.NATIVE else "numpy", "decode_ms": out,
            "segments_per_lookup": len(query.fields)}


@dataclass(frozen=True)
class Memory:
    bytes_per_location: float
    hash_bytes_per_location: float
    publish_pages_per_s: float


def _memory(client: RedisIndex, url: str, auth: IndexAuth | None, count: int, run_id: str,
            namespaces: list[bytes]) -> Memory:
    """Server memory growth and publish throughput for ``count`` locations in a fresh namespace."""
    ns = _namespace(run_id, "memory")
    namespaces.append(ns)
    # One chain, as engines publish them (a page's records go to its segment's field).
    keys = page_keys(ns, np.random.default_rng(2).integers(0, 32_000, size=count * PAGE_TOKENS, dtype=np.uint32),
                     PAGE_TOKENS)
    r = redis_client(url, auth, timeout_s=None)
    try:
        before = int(r.info("memory")["used_memory"])
        t0 = time.perf_counter()
        _publish(client, keys)
        elapsed = time.perf_counter() - t0
        after = int(r.info("memory")["used_memory"])
        hash_bytes = sum(int(r.memory_usage(k, samples=0) or 0)
                         for k in (loc_key(ns), segment_key(ns), records_key(ns)))
    finally:
        r.close()
    return Memory((after - before) / count, hash_bytes / count, count / elapsed)


def _hmget_stats(url: str, auth: IndexAuth | None) -> tuple[int, int]:
    """(calls, microseconds) of ``HMGET`` the server has run so far, from ``INFO commandstats``."""
    r = redis_client(url, auth, timeout_s=None)
    try:
        stats = r.info("commandstats").get("cmdstat_hmget", {})
    finally:
        r.close()
    return int(stats.get("calls", 0)), int(stats.get("usec", 0))


def _server_ms(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    """Mean server time of the lookups' ``HMGET`` in milliseconds (``None``: none ran)."""
    calls = after[0] - before[0]
    return (after[1] - before[1]) / calls / 1000 if calls > 0 else None


def _server_version(url: str, auth: IndexAuth | None) -> str:
    r = redis_client(url, auth, timeout_s=None)
    try:
        info = r.info("server")
    finally:
        r.close()
    for name in ("valkey_version", "redis_version"):
        if name in info:
            return f"{name.split('_')[0]} {info[name]}"
    return "unknown"


def _cleanup(url: str, auth: IndexAuth | None, reader: RedisIndex, clients: Sequence[RedisIndex],
             namespaces: Sequence[bytes], progress: Progress) -> None:
    """Leave a shared server as it was: drop the bench's namespaces and deregister its nodes.

    A failure here is reported, not raised: it must not hide the error that ended the run.
    """
    r = redis_client(url, auth, timeout_s=None)
    try:
        if namespaces:
            r.delete(*(k for ns in namespaces
                       for k in (loc_key(ns), segment_key(ns), records_key(ns), flat_key(loc_key(ns)))))
        for client in clients:
            if client.incarnation is not None:
                client.leave()
    except (redis.RedisError, IndexUnavailable) as e:
        progress(f"index: could not clean up the bench's keys and nodes on {redact_url(url)}: {e}")
    finally:
        r.close()
        reader.close()
        for client in clients:
            client.close()


def _pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 4)


def _result(lat: Latencies, memory: Memory, pages: int, nodes: int, iterations: int, memory_pages: int,
            url: str | None, version: str, server_ms: float | None) -> dict[str, Any]:
    lookup_p50, rtt_p50 = float(np.percentile(lat.lookup_ms, 50)), float(np.percentile(lat.rtt_ms, 50))
    return {
        "bench": "index",
        "ratio": round(lookup_p50 / rtt_p50, 3),
        "server_hmget_ms": None if server_ms is None else round(server_ms, 4),
        "ratio_floor": None if server_ms is None else round((rtt_p50 + server_ms) / rtt_p50, 3),
        "lookup_p50_ms": round(lookup_p50, 4),
        "lookup_p90_ms": _pct(lat.lookup_ms, 90),
        "lookup_p99_ms": _pct(lat.lookup_ms, 99),
        "rtt_p50_ms": round(rtt_p50, 4),
        "resolve_p50_ms": _pct(lat.resolve_ms, 50),
        "round_trips_per_lookup": 1,
        "bytes_per_location": round(memory.bytes_per_location, 1),
        "hash_bytes_per_location": round(memory.hash_bytes_per_location, 1),
        "publish_pages_per_s": round(memory.publish_pages_per_s),
        "pages": pages,
        "nodes": nodes,
        "iterations": iterations,
        "memory_pages": memory_pages,
        "server": redact_url(url) if url else "private server on a unix socket",
        "server_version": version,
        "note": NOTE,
    }
