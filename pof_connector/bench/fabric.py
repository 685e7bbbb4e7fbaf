"""``pof bench fabric``: remote page fetch through pof against a raw NIXL READ of the same bytes,
between the same two processes, in the same run.

An owner process (:mod:`pof_connector.bench.fabric_owner`) stores pages in its CPU DRAM tier and
publishes them and its NIXL metadata in a private index. This process is the reader and times,
interleaved batch by batch so both see the same machine load:

* ``pof``: what an engine adapter does for remote pages — :meth:`Pool.open_read` (one NIXL READ
  of the slots into pof's staging, a second small READ of the slots' live generation words, then
  header, key, generation and checksum checks), a copy of every layer into destination buffers,
  :meth:`PageReader.check` and ``close``;
* ``raw``: a second NIXL agent in this process, with the same UCX settings, READs the same slots
  of the owner's registered tier memory into a local buffer with prepared descriptor lists
  (``make_prepped_xfer``, ``transfer``, poll ``check_xfer_state`` with the same sleep as pof) —
  the physical floor of moving those bytes.

``ratio`` = pof throughput / raw throughput over the same pages (1.0: pof adds nothing): pof's
fetch ends with validated pages in its staging, where the engine adapter picks them up. A third
path, ``pof_copy_out``, also copies every layer into destination buffers as the adapter does
(``ratio_with_copy_out``): that copy exists for local pages too, but it is reported. Latency is
per single-page fetch (a load of one page), p50 and p99, for every path. Every fetched page of both
paths is compared byte for byte with the content the owner derived from its key (outside the
timed spans).

The default page is the one of ``pof bench vllm``'s model (8 layers of 128 tokens x 4 KV heads x
64 x K,V in fp32: 256 KiB per layer, 2 MiB per page), fetched 16 at a time (a 6,000-token prompt
is 47 such pages).
"""

from __future__ import annotations

import json
import logging
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from pof_connector.bench import BenchError, Progress, quiet
from pof_connector.bench.fabric_owner import bench_keys, bench_namespace, bench_spec, page_content
from pof_connector.bench.raw_nixl_reader import RawNixlReader
from pof_connector.config import PofConfig, format_size
from pof_connector.fabric import PeerMeta, nixl_installed
from pof_connector.fabric.nixl_api import INSTALL_HINT, load_nixl
from pof_connector.index import Location
from pof_connector.index.server import RedisServer
from pof_connector.pages.keys import PageKey
from pof_connector.pages.layout import PageSpec
from pof_connector.pool import Pool

OWNER_START_S = 120.0
NOTE = ("ratio = pof throughput / raw NIXL READ throughput of the same pages between the same two processes, "
        "batches interleaved; pof = Pool.open_read..close: data READ into staging, generation re-read, header/key/"
        "generation/checksum validation; ratio_with_copy_out adds the copy of every layer into destination "
        "buffers (the adapter's copy into engine blocks); latency = one single-page fetch; every fetched page "
        "compared byte for byte")


def run(*, layers: int = 8, segment_bytes: int = 256 << 10, pages: int = 32, batch: int = 16, iterations: int = 50,
        latency_samples: int = 100, tls: str | None = "tcp", ucx_devices: str | None = "lo",
        progress: Progress = quiet) -> dict[str, Any]:
    """Throughput and latency of both paths, as ``--json`` prints them."""
    if not nixl_installed():
        raise BenchError(f"NIXL is not installed: {INSTALL_HINT}")
    if min(layers, segment_bytes, pages, batch, iterations, latency_samples) < 1 or batch > pages:
        raise BenchError("need positive sizes and --batch <= --pages")
    _nixl_logs_to_stderr()
    spec = bench_spec(layers, segment_bytes)
    keys = bench_keys(spec, pages)
    expected = [np.concatenate(page_content(spec, k)) for k in keys]
    work = Path(tempfile.mkdtemp(prefix="pof-bf-", dir="/tmp"))
    server = RedisServer(work / "redis").start()
    try:
        fabric = {"enabled": True, "tls": tls, "ucx_devices": ucx_devices, "timeout_s": 10.0,
                  "staging_size": max(2 * batch * (spec.page_bytes + 64), 1 << 20)}
        common = {"index_url": server.url, "runtime_dir": str(work / "rt"), "heartbeat_s": 0.2, "node_ttl_s": 5.0}
        owner_cfg = {**common, "node_id": "owner", "fabric": fabric,
                     "tiers": {"cpu_dram": {"size": pages * spec.page_bytes + (4 << 20)}}}
        reader_cfg = PofConfig.from_mapping({**common, "node_id": "reader", "fabric": fabric,
                                             "tiers": {"cpu_dram": {"size": 4 * spec.page_bytes + (1 << 20)}}})
        progress(f"fabric: owner stores {pages} pages of {format_size(spec.page_bytes)} ({layers} layers); "
                 f"UCX tls={tls or 'auto'} devices={ucx_devices or 'auto'}")
        with _owner(owner_cfg, spec, pages, work) as _, Pool(reader_cfg, spec, bench_namespace(spec)) as pool:
            sources = _plan(pool, keys)
            meta = _owner_meta(pool)
            with RawNixlReader(reader_cfg.fabric, meta, spec, batch) as raw:
                result = _measure(pool, raw, spec, keys, sources, expected, batch, iterations, latency_samples,
                                  progress)
    finally:
        server.stop()
        _rmtree(work)
    return {"bench": "fabric", **result, "page_bytes": spec.page_bytes, "layers": layers,
            "segment_bytes": segment_bytes, "pages": pages, "batch": batch, "iterations": iterations,
            "latency_samples": latency_samples, "tls": tls, "ucx_devices": ucx_devices, "note": NOTE}


def _nixl_logs_to_stderr() -> None:
    """NIXL's Python API logs to stdout (its logger "nixl"), which must carry only the JSON."""
    load_nixl()
    for handler in logging.getLogger("nixl").handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(sys.stderr)


# ---- the two processes ---------------------------------------------------------------------


@contextmanager
def _owner(config: dict[str, Any], spec: PageSpec, pages: int, work: Path) -> Iterator[subprocess.Popen[str]]:
    """The owner process, stopped (stdin closed, then killed by PID) on the way out."""
    # UCX_* variables would override the settings both sides take from the config.
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    arg = json.dumps({"config": config, "layers": spec.num_layers, "segment_bytes": spec.segment_bytes,
                      "pages": pages})
    log = open(work / "owner.log", "w")   # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen([sys.executable, "-m", "pof_connector.bench.fabric_owner", arg], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + OWNER_START_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
                raise BenchError(f"the owner process did not get ready in {OWNER_START_S:.0f}s")
            line = proc.stdout.readline()
            if not line:
                log.flush()
                raise BenchError(f"the owner process exited with {proc.wait()}: "
                                 f"{(work / 'owner.log').read_text()[-2000:]}")
            if line.startswith("{") and json.loads(line).get("ready"):
                break
        yield proc
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _plan(pool: Pool, keys: list[PageKey]) -> list[Location]:
    """Where the owner's pages are, once the index says all of them are readable."""
    deadline = time.monotonic() + 30
    while True:
        found = pool.lookup(keys)
        if found.pages == len(keys) and {s.node for s in found.sources} == {"owner"}:
            return found.sources
        if time.monotonic() > deadline:
            raise BenchError(f"the reader's lookup found {found.pages} of {len(keys)} owner pages")
        time.sleep(0.1)


def _owner_meta(pool: Pool) -> PeerMeta:
    info = next((n for n in pool.index.nodes() if n.node_id == "owner"), None)
    meta = None if info is None else PeerMeta.from_meta(info.meta)
    if meta is None:
        raise BenchError("the owner publishes no fabric metadata")
    return meta


# ---- measuring -------------------------------------------------------------------------------


class _Check:
    """Byte-exact comparison of fetched pages with the owner's content (never timed)."""

    def __init__(self, spec: PageSpec, expected: list[np.ndarray]) -> None:
        self.spec = spec
        self.expected = expected
        self.pages = 0
        self.wrong = 0
        self.failed = 0

    def segments(self, page: np.ndarray, index: int) -> None:
        self.pages += 1
        if not np.array_equal(page[self.spec.header_bytes:], self.expected[index]):
            self.wrong += 1


def _pof_fetch(pool: Pool, keys: list[PageKey], sources: list[Location], dest: np.ndarray | None,
               spec: PageSpec, check: _Check, index: list[int]) -> float:
    """pof's path for remote pages; returns its seconds. ``dest`` given: copy every layer out as
    an engine adapter does (timed); ``None``: the fetch alone (pages validated in pof's staging).
    The pages are compared with the owner's content outside the timed span either way."""
    t0 = time.perf_counter()
    reader = pool.open_read(keys, sources)
    try:
        # Every layer of every page, in the adapter's order: remote layers arrive in parts, and a
        # part is only read (and checked) once a layer in it is asked for.
        for layer in range(spec.num_layers):
            for i in range(len(keys)):
                if dest is not None:
                    start = i * spec.page_bytes + spec.segment_offset(layer)
                    reader.copy_into(i, layer, dest[start:start + spec.segment_bytes])
                else:
                    seg = reader.segment(i, layer)
                    if seg is not None:
                        reader.check(i, layer, reader.landed_sum(i, seg))
        elapsed = time.perf_counter() - t0
        for j, i in enumerate(index):
            if j in reader.failed:
                check.failed += 1
            elif dest is not None:
                check.segments(dest[j * spec.page_bytes:(j + 1) * spec.page_bytes], i)
            else:
                segs = [reader.segment(j, layer) for layer in range(spec.num_layers)]
                check.segments(np.concatenate([np.zeros(spec.header_bytes, np.uint8), *segs]), i)
        t1 = time.perf_counter()
    finally:
        reader.close()
    return elapsed + time.perf_counter() - t1         # close() gives the staging back: part of the path


PATHS = ("pof", "pof_copy_out", "raw")


def _measure(pool: Pool, raw: RawNixlReader, spec: PageSpec, keys: list[PageKey], sources: list[Location],
             expected: list[np.ndarray], batch: int, iterations: int, latency_samples: int,
             progress: Progress) -> dict[str, Any]:
    n = len(keys)
    dest = np.zeros(batch * spec.page_bytes, dtype=np.uint8)
    checks = {name: _Check(spec, expected) for name in PATHS}

    def fetch(name: str, idx: list[int]) -> float:
        if name == "raw":
            t0 = time.perf_counter()
            raw.read([sources[i].slot for i in idx])
            dt = time.perf_counter() - t0
            for j, i in enumerate(idx):
                checks["raw"].segments(raw.page(j), i)
            return dt
        return _pof_fetch(pool, [keys[i] for i in idx], [sources[i] for i in idx],
                          dest if name == "pof_copy_out" else None, spec, checks[name], idx)

    progress("fabric: warm-up (connects both agents)")
    for name in PATHS:
        fetch(name, list(range(batch)))
    times: dict[str, list[float]] = {name: [] for name in PATHS}
    progress(f"fabric: throughput, {iterations} batches of {batch} pages per path, interleaved")
    for it in range(iterations):
        idx = [(it * batch + j) % n for j in range(batch)]
        for name in PATHS[it % 3:] + PATHS[:it % 3]:          # rotate who goes first
            times[name].append(fetch(name, idx))
        if (it + 1) % max(1, iterations // 4) == 0:
            progress(f"  {it + 1}/{iterations} batches")
    lat: dict[str, list[float]] = {name: [] for name in PATHS}
    progress(f"fabric: latency, {latency_samples} single-page fetches per path")
    for k in range(latency_samples):
        for name in PATHS[k % 3:] + PATHS[:k % 3]:
            lat[name].append(fetch(name, [k % n]))
    out: dict[str, Any] = {}
    moved = iterations * batch
    for name in PATHS:
        total = sum(times[name])
        ms = sorted(x * 1e3 for x in lat[name])
        out[name] = {"gbps": round(moved * spec.page_bytes / total / 1e9, 4),
                     "pages_per_s": round(moved / total, 1),
                     "batch_ms_p50": round(statistics.median(times[name]) * 1e3, 3),
                     "latency_ms_p50": round(_pct(ms, 50), 4), "latency_ms_p99": round(_pct(ms, 99), 4)}
    out["ratio"] = round(out["pof"]["gbps"] / out["raw"]["gbps"], 4)
    out["ratio_with_copy_out"] = round(out["pof_copy_out"]["gbps"] / out["raw"]["gbps"], 4)
    out["verified_pages"] = {k: c.pages for k, c in checks.items()}
    out["failed_pages"] = sum(c.failed for c in checks.values())
    out["wrong_pages"] = {k: c.wrong for k, c in checks.items()}
    out["exact"] = all(c.wrong == 0 and c.failed == 0 for c in checks.values())
    return out


def _pct(sorted_values: list[float], p: float) -> float:
    """The ``p``-th percentile (nearest rank) of an ascending list."""
    k = max(0, min(len(sorted_values) - 1, round(p / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
