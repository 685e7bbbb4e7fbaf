"""The servers and the router of one ``pof bench capacity`` set-up, started clean and stopped by PID.

What each set-up starts is planned in :mod:`.capacity_setups` (its docstring names the set-ups and
the equal-memory rule); :class:`Fleet` starts a plan and reads the servers' metrics. Every server
runs unpinned with one OpenMP thread (as the chaos bench does), its KV cache bounded with
``--num-gpu-blocks-override``, so memory runs out before compute does.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pof_connector.bench.capacity_replay import Route
from pof_connector.bench.capacity_setups import (
    INDEXED_SETUPS,
    SetupPlan,
    plan,
    static_server,
)
from pof_connector.bench.capacity_trace import TraceRequest
from pof_connector.bench.chaos import UNPINNED
from pof_connector.bench.front_door import make_realtime, sched_of
from pof_connector.bench.router import kv_events_args, start_relay
from pof_connector.bench.router_process import RouterProcess
from pof_connector.bench.service_process import ServiceProcess, niceness_of
from pof_connector.bench.spread_floor import spread_floor
from pof_connector.bench.vllm_server import VllmServer, connector_config, free_port
from pof_connector.index.server import RedisServer

COUNTERS = ("vllm:num_preemptions_total", "vllm:pof_evicted_pages_total", "vllm:iteration_tokens_total_sum",
            "vllm:prefix_cache_hits_total",
            "vllm:external_prefix_cache_hits_total", "vllm:prompt_tokens_total", "vllm:pof_loaded_pages_total",
            "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
            "vllm:request_queue_time_seconds_sum", "vllm:request_queue_time_seconds_count",
            "vllm:request_prefill_time_seconds_sum", "vllm:request_prefill_time_seconds_count")
"""``vllm:pof_loaded_pages`` counts what vLLM's external-hit counter leaves out: the pages a request
resumed after a preemption loads from the pool; ``vllm:pof_evicted_pages``: pages the server's tier
(its partition of a shared one) evicted to make room."""
QUEUES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
OCCUPANCY = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:pof_tier_used_bytes",
             "vllm:pof_tier_capacity_bytes")


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
    router_sched: str = "nice"
    """``rr``: the routers, the index server and the relays run in ``SCHED_RR`` (the front door runs
    as promptly as on hosts of its own: :mod:`.front_door`); ``nice``: at ``router_nice`` only."""
    tier_bytes: int = 1 << 30
    """Tier memory the engines can read back, in all (every set-up alike: see :mod:`.capacity_setups`)."""
    naming: int = 0
    """``static``'s naming (:func:`~.capacity_setups.static_server`)."""
    router_cost: tuple[tuple[str, float], ...] = ()
    """Settings of the pof router's ``cost`` section (``--pof-cost``); empty: its defaults."""
    region_trade: bool = True
    """Whether the pof set-up's servers trade the shared region's slots (``--pof-fixed-shares``: not)."""

    def plan(self, setup: str, workdir: Path, index_url: str | None = None, region: str | None = None,
             port: Any = free_port) -> SetupPlan:
        """What ``setup`` starts on this spec (nothing is started)."""
        return plan(setup, servers=self.servers, tier_bytes=self.tier_bytes, block=self.block,
                    max_num_seqs=self.max_num_seqs, runtime_dir=lambda name: str(workdir / f"rt-{name}"),
                    index_url=index_url, region=region, port=port, audit_rate=self.audit_rate,
                    trade=self.region_trade)

    def server_args(self, events: str | None) -> list[str]:
        """vLLM flags of every server (``events``: where it publishes its KV events)."""
        return ["--block-size", str(self.block), "--num-gpu-blocks-override", str(self.kv_blocks),
                "--max-num-seqs", str(self.max_num_seqs), "--dtype", self.dtype,
                *(kv_events_args(events) if events else [])]


def pof_router(workdir: Path, index_url: str, model: Path, backends: list[tuple[str, str]],
               cost: tuple[tuple[str, float], ...] = ()) -> RouterProcess:
    """`pof router` for the pof set-up: the one place its configuration lives. No sticky header:
    sessions may change node between turns (their context is in the pool). ``cost``: settings of
    its ``cost`` section (empty: the defaults)."""
    config: dict[str, Any] = {"index_url": index_url, "tokenizer": str(model),
                              "backends": [{"name": n, "url": u} for n, u in backends]}
    if cost:
        config["cost"] = dict(cost)
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
        self.plan: SetupPlan | None = None
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
        index_url = region = None
        if self.setup in INDEXED_SETUPS:
            self.redis = RedisServer(self.workdir / "redis").start()
            if s.router_nice is not None and self.redis.pid is not None:
                # The index, like the router, has a host of its own in a deployment. Its serving
                # thread is the main one (later threads do background work only).
                with contextlib.suppress(PermissionError):
                    os.setpriority(os.PRIO_PROCESS, self.redis.pid, s.router_nice)
            index_url = self.redis.url
        if self.setup == "pof":
            self._shm = Path(tempfile.mkdtemp(prefix="pof-capacity-", dir="/dev/shm"))
            region = str(self._shm / "cxl.region")
        self.plan = p = s.plan(self.setup, self.workdir, index_url, region)
        for server in p.servers:
            self.servers.append(VllmServer(self.model, self.workdir / server.name,
                                           kv_transfer=connector_config(server.pool, role="kv_both"),
                                           max_model_len=s.max_model_len, extra_args=s.server_args(server.events),
                                           env=UNPINNED))
        with ThreadPoolExecutor(len(self.servers)) as ex:
            list(ex.map(lambda v: v.start(timeout_s=600), self.servers))
        backends = list(zip(self.names(), [v.url for v in self.servers], strict=True))
        for relay in p.relays:
            self.relays.append(start_relay(self.workdir, relay.node, relay.pool, relay.events, bind=relay.bind,
                                           pool_residency=relay.pool_residency))
        if p.router == "pof":
            assert index_url is not None
            self.router = pof_router(self.workdir, index_url, self.model, backends,
                                     s.router_cost).start(nice=s.router_nice)
        elif p.router == "vllm-router":
            assert p.policy is not None
            urls = [u for _, u in backends]
            extra = p.router_args(urls) if p.router_args is not None else []
            self.router = RouterProcess.vllm_router(self.workdir, urls, p.policy, extra).start(nice=s.router_nice)
        if s.router_sched == "rr":
            for pid in self.front_door_pids():
                make_realtime(pid)

    def front_door_pids(self) -> list[int]:
        """The processes requests and their routing pass through: the router, the index server, the relays."""
        procs = [self.router.proc if self.router is not None else None, *(r.proc for r in self.relays)]
        pids = [p.pid for p in procs if p is not None]
        return pids + ([self.redis.pid] if self.redis is not None and self.redis.pid is not None else [])

    def front_door_sched(self) -> str | None:
        """``rr`` or ``nice``: the router's class, else the index server's (:func:`~.front_door.sched_of`);
        ``None``: the set-up has neither (static, round_robin)."""
        return sched_of(self.router.pid if self.router is not None and self.router.pid is not None else
                        self.redis.pid if self.redis is not None else None)

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
                return urls[static_server(key, self.spec.naming, len(urls))], {}
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
            out[f"{name}:evicted_pages"] = m.get("vllm:pof_evicted_pages_total", 0.0)
        return out

    def occupancy(self) -> list[tuple[float, int, float, float]]:
        """Each server's KV usage (0-1), running requests, and its tier's used and capacity bytes
        (0 until its connector first reported them), read in one scrape."""
        out = []
        for v in self.servers:
            m = v.metrics(OCCUPANCY)
            out.append((m.get("vllm:kv_cache_usage_perc", 0.0), round(m.get("vllm:num_requests_running", 0.0)),
                        m.get("vllm:pof_tier_used_bytes", 0.0), m.get("vllm:pof_tier_capacity_bytes", 0.0)))
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
        self.tier_used: list[list[float]] = []
        """Per sample, each server's tier bytes in use."""
        self.tier_capacity = 0.0
        self.usage: list[tuple[float, list[float]]] = []
        """Per sample, seconds since the sampler started and each server's KV usage (0-1)."""
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> UsageSampler:
        self._t0 = time.monotonic()
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
            u = [o[0] for o in occupancy]
            self.usage.append((time.monotonic() - self._t0, u))
            if all(len(o) > 3 for o in occupancy):       # a fleet that reads its tiers
                self.tier_used.append([o[2] for o in occupancy])      # type: ignore[misc]
                self.tier_capacity = max(self.tier_capacity, sum(o[3] for o in occupancy))   # type: ignore[misc]
            self.spreads.append(max(u) - min(u))
            self.floors.append(spread_floor(u, [o[1] for o in occupancy]))
            self.peaks.append(max(u))

    def tier_figures(self) -> dict[str, Any]:
        """The tiers' peak use over the samples: all servers' together (a shared region: the sum
        of its partitions) and each server's, with their capacity (sampled every ``interval_s``: a
        peak between two samples is missed)."""
        if not self.tier_used:
            return {"tier_peak_used_bytes": None, "tier_peak_used_bytes_by_server": None, "tier_capacity_bytes": None}
        return {"tier_peak_used_bytes": int(max(sum(s) for s in self.tier_used)),
                "tier_peak_used_bytes_by_server": [int(max(col)) for col in zip(*self.tier_used, strict=True)],
                "tier_capacity_bytes": int(self.tier_capacity)}

    def figures(self) -> dict[str, Any]:
        if not self.spreads:
            return {"spread_mean": None, "spread_p90": None, "spread_floor_mean": None, "spread_floor_p90": None,
                    "samples": 0, **self.tier_figures(), "kv_usage": self.usage_series()}

        def p90(values: list[float]) -> float:
            return round(sorted(values)[int(0.9 * (len(values) - 1))], 4)

        return {"spread_mean": round(statistics.fmean(self.spreads), 4), "spread_p90": p90(self.spreads),
                "spread_floor_mean": round(statistics.fmean(self.floors), 4), "spread_floor_p90": p90(self.floors),
                "max_usage_mean": round(statistics.fmean(self.peaks), 4), "samples": len(self.spreads),
                **self.tier_figures(), "kv_usage": self.usage_series()}

    def usage_series(self) -> dict[str, list[Any]]:
        """Each server's KV usage over the trial (what ``--plot`` draws): ``t_s`` the samples'
        times, ``by_server`` one list of usages per server, in the fleet's order."""
        return {"t_s": [round(t, 2) for t, _ in self.usage],
                "by_server": [[round(u, 3) for u in col] for col in zip(*(u for _, u in self.usage), strict=True)]}
