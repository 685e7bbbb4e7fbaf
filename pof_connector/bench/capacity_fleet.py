"""The servers and the router of one ``pof bench capacity`` set-up, started clean and stopped by PID.

Set-ups (:data:`SETUPS`):

- ``static``: each session (a short request: its tenant) goes to the server its id hashes to, for
  the whole run — the fixed, affinity-based allocation of a cluster without a pool;
- ``round_robin``: requests go round the servers;
- ``cache_aware``: the stock ``vllm-router --policy cache_aware``;
- ``cache_aware_offload``: the same router in front of servers that each offload KV to a CPU
  memory tier of their own and load it back (pof's connector with a private DRAM tier and a
  private index: what a per-node offload such as vLLM's CPU offloading or LMCache's local CPU
  backend gives), so a conversation that returns to its server finds its context even after the
  engine evicted it, but no server reads another's;
- ``pof``: `pof router` (configured in :func:`pof_router`, the one place this bench depends on
  it) in front of servers whose pools share one CXL region and one index, sessions free to move,
  a `pof relay` per server reporting its engine's prefix cache.

``static``, ``round_robin`` and ``cache_aware`` run servers whose connector only stores
(``kv_role: kv_producer``, private pools): the same engine code as the pooled servers, never a
load (as ``pof bench router`` does for fairness). Every server runs unpinned with one OpenMP
thread (as the chaos bench does), its KV cache bounded with ``--num-gpu-blocks-override``, so
memory runs out before compute does.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import shutil
import statistics
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pof_connector.bench.capacity_replay import Route
from pof_connector.bench.capacity_trace import TraceRequest
from pof_connector.bench.chaos import UNPINNED
from pof_connector.bench.router import kv_events_args, start_relay
from pof_connector.bench.router_process import RouterProcess
from pof_connector.bench.service_process import ServiceProcess, niceness_of
from pof_connector.bench.spread_floor import spread_floor
from pof_connector.bench.vllm_server import VllmServer, connector_config, free_port
from pof_connector.index.server import RedisServer

SETUPS = ("static", "round_robin", "cache_aware", "cache_aware_offload", "pof")
VLLM_ROUTER_SETUPS = ("cache_aware", "cache_aware_offload")
COUNTERS = ("vllm:num_preemptions_total", "vllm:iteration_tokens_total_sum", "vllm:prefix_cache_hits_total",
            "vllm:external_prefix_cache_hits_total", "vllm:prompt_tokens_total", "vllm:pof_loaded_pages_total",
            "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
            "vllm:request_queue_time_seconds_sum", "vllm:request_queue_time_seconds_count",
            "vllm:request_prefill_time_seconds_sum", "vllm:request_prefill_time_seconds_count")
"""``vllm:pof_loaded_pages`` counts what vLLM's external-hit counter leaves out: the pages a request
resumed after a preemption loads from the pool."""
QUEUES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
OCCUPANCY = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running")


@dataclass(frozen=True)
class FleetSpec:
    servers: int
    kv_blocks: int
    block: int
    max_model_len: int
    max_num_seqs: int
    dtype: str = "float32"
    audit_rate: float = 0.0
    """The pof set-up's ``audit.sample_rate`` (the benches measure without it unless asked)."""
    router_nice: int | None = None
    """The niceness of the routing tier: the routers (pof router and vllm-router alike) and pof's
    index server (``None``: this process's). Negative: what a deployment runs on hosts of its own
    is served before the engines that share this one's cores."""


def pof_router(workdir: Path, index_url: str, model: Path, backends: list[tuple[str, str]]) -> RouterProcess:
    """`pof router` for the pof set-up: the one place its configuration lives. No sticky header:
    sessions may change node between turns (their context is in the pool)."""
    config: dict[str, Any] = {"index_url": index_url, "tokenizer": str(model),
                              "backends": [{"name": n, "url": u} for n, u in backends]}
    return RouterProcess.pof(workdir, config)


class Fleet:
    """One set-up's processes. :meth:`start` raises (after stopping what it started) if one fails."""

    def __init__(self, setup: str, model: Path, workdir: Path, spec: FleetSpec) -> None:
        self.setup = setup
        self.model = model
        self.workdir = workdir
        self.spec = spec
        self.servers: list[VllmServer] = []
        self.router: RouterProcess | None = None
        self.relays: list[ServiceProcess] = []
        self.redis: RedisServer | None = None
        self._shm: Path | None = None
        self._rr = itertools.count()
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return [f"n{i}" for i in range(self.spec.servers)]

    def start(self) -> Fleet:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        s = self.spec
        common = ["--block-size", str(s.block), "--num-gpu-blocks-override", str(s.kv_blocks), "--max-num-seqs",
                  str(s.max_num_seqs), "--dtype", s.dtype]
        pooled = self.setup == "pof"
        offload = self.setup == "cache_aware_offload"      # a private tier per server, loaded back
        events: list[str] = []
        pool: dict[str, Any]
        if pooled:
            self.redis = RedisServer(self.workdir / "redis").start()
            if s.router_nice is not None and self.redis.pid is not None:
                # The index, like the router, has a host of its own in a deployment. Its serving
                # thread is the main one (later threads do background work only).
                with contextlib.suppress(PermissionError):
                    os.setpriority(os.PRIO_PROCESS, self.redis.pid, s.router_nice)
            self._shm = Path(tempfile.mkdtemp(prefix="pof-capacity-", dir="/dev/shm"))
            pool = {"index_url": self.redis.url, "audit": {"sample_rate": s.audit_rate, "seed": 7},
                    "tiers": {"cxl": {"path": str(self._shm / "cxl.region"), "size": "1GiB", "partitions": s.servers}}}
            events = [f"tcp://127.0.0.1:{free_port()}" for _ in range(s.servers)]
        else:
            # offload: an embedded index in each server's own runtime_dir, as private as its tier
            pool = {"index_url": "embedded" if offload else "local", "tiers": {"cpu_dram": {"size": "256MiB"}}}
        node_pools: list[dict[str, Any]] = []
        for i, name in enumerate(self.names()):
            node_pool = {**pool, "runtime_dir": str(self.workdir / f"rt-{name}")}
            if pooled:
                node_pool["tiers"] = {"cxl": {**pool["tiers"]["cxl"], "partition": i}}
            node_pools.append(node_pool)
            role = "kv_both" if pooled or offload else "kv_producer"
            kv = connector_config({"node_id": name, **node_pool}, role=role)
            extra = [*common, *(kv_events_args(events[i]) if pooled else [])]
            self.servers.append(VllmServer(self.model, self.workdir / name, kv_transfer=kv,
                                           max_model_len=s.max_model_len, extra_args=extra, env=UNPINNED))
        with ThreadPoolExecutor(len(self.servers)) as ex:
            list(ex.map(lambda v: v.start(timeout_s=600), self.servers))
        backends = list(zip(self.names(), [v.url for v in self.servers], strict=True))
        if pooled:
            assert self.redis is not None
            for i, name in enumerate(self.names()):
                # as `pof bench router` configures its relays: the shared pool, no writer partition
                relay_pool = {**pool, "runtime_dir": node_pools[i]["runtime_dir"]}
                self.relays.append(start_relay(self.workdir, name, relay_pool, events[i]))
            self.router = pof_router(self.workdir, self.redis.url, self.model, backends).start(nice=s.router_nice)
        elif self.setup in VLLM_ROUTER_SETUPS:
            self.router = RouterProcess.vllm_router(self.workdir, [u for _, u in backends],
                                                    "cache_aware").start(nice=s.router_nice)

    def route(self, trace: list[TraceRequest]) -> Route:
        """Where each request of ``trace`` goes."""
        urls = [v.url for v in self.servers]
        if self.router is not None:
            url = self.router.url
            return lambda r, k: (url, {})
        if self.setup == "static":
            turns: dict[str, int] = {}
            for r in trace:
                turns[r.session] = turns.get(r.session, 0) + 1

            def static(r: TraceRequest, k: int) -> tuple[str, dict[str, str]]:
                """A conversation stays on its session's server, a one-off request goes to its tenant's."""
                key = r.session if turns[r.session] > 1 else r.tenant
                return urls[int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little") % len(urls)], {}
            return static

        def round_robin(r: TraceRequest, k: int) -> tuple[str, dict[str, str]]:
            with self._lock:
                return urls[next(self._rr) % len(urls)], {}
        return round_robin

    def index_niceness(self) -> int | None:
        """The index server's niceness; ``None``: this set-up runs none."""
        return niceness_of(self.redis.pid if self.redis is not None else None)

    def counters(self) -> dict[str, float]:
        """:data:`COUNTERS` summed over the servers, and each server's count of requests that got a
        first token as ``"<name>:first_tokens"`` (where a router sent them: vllm-router says not)."""
        out = dict.fromkeys(COUNTERS, 0.0)
        for name, v in zip(self.names(), self.servers, strict=True):
            m = v.metrics(COUNTERS)
            for k in COUNTERS:
                out[k] += m.get(k, 0.0)
            out[f"{name}:first_tokens"] = m.get("vllm:time_to_first_token_seconds_count", 0.0)
        return out

    def occupancy(self) -> list[tuple[float, int]]:
        """Each server's KV usage (0-1) and running requests, read in one scrape."""
        out = []
        for v in self.servers:
            m = v.metrics(OCCUPANCY)
            out.append((m.get("vllm:kv_cache_usage_perc", 0.0), round(m.get("vllm:num_requests_running", 0.0))))
        return out

    def idle(self) -> bool:
        for v in self.servers:
            m = v.metrics(QUEUES)
            if m.get("vllm:num_requests_running", 0.0) + m.get("vllm:num_requests_waiting", 0.0) > 0:
                return False
        return True

    def reset_caches(self) -> None:
        for v in self.servers:
            v.reset_prefix_cache()

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop(grace_s=10)
        for r in self.relays:
            r.stop(grace_s=10)
        for v in self.servers:
            v.stop()
        if self.redis is not None:
            self.redis.stop()
        if self._shm is not None:
            shutil.rmtree(self._shm, ignore_errors=True)


class UsageSampler:
    """Samples every server's KV usage while a trial runs: the spread (max - min) over time is the
    fragmentation figure (one server full while another idles); beside each spread, the least one
    any placement of the requests running then could have had (:func:`spread_floor`)."""

    def __init__(self, fleet: Fleet, interval_s: float = 0.5) -> None:
        self.fleet = fleet
        self.interval_s = interval_s
        self.spreads: list[float] = []
        self.floors: list[float] = []
        self.peaks: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> UsageSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                occupancy = self.fleet.occupancy()
            except OSError:
                continue
            u = [usage for usage, _ in occupancy]
            self.spreads.append(max(u) - min(u))
            self.floors.append(spread_floor(u, [running for _, running in occupancy]))
            self.peaks.append(max(u))

    def figures(self) -> dict[str, float | None]:
        if not self.spreads:
            return {"spread_mean": None, "spread_p90": None, "spread_floor_mean": None, "spread_floor_p90": None,
                    "samples": 0}

        def p90(values: list[float]) -> float:
            return round(sorted(values)[int(0.9 * (len(values) - 1))], 4)

        return {"spread_mean": round(statistics.fmean(self.spreads), 4), "spread_p90": p90(self.spreads),
                "spread_floor_mean": round(statistics.fmean(self.floors), 4), "spread_floor_p90": p90(self.floors),
                "max_usage_mean": round(statistics.fmean(self.peaks), 4), "samples": len(self.spreads)}
