"""``pof bench chaos``: real traffic through a pooled cluster while faults arrive at random
moments; every answer is checked against a server without the connector.

The cluster: two vLLM servers whose pools share a CXL region (a file in /dev/shm) and reach each
other and a ``pof memd`` memory node through the fabric (NIXL, UCX over TCP; spilled pages go to
the memory node); a Redis-protocol index; ``pof router`` in front; and a reference vLLM server
without the connector. When run as root the memory node lives in a network namespace of its own,
behind a veth link the ``link_cut`` fault takes down. Traffic and faults are seeded
(:mod:`~pof_connector.bench.chaos_traffic`, :mod:`~pof_connector.bench.chaos_faults`).

The figures: requests sent / answered / failed, ``wrong_answers`` (an answer that differs from the
reference's: must be 0), ``unplanned_crashes`` (a process found dead that no fault took down: must
be 0; it is restarted so the run goes on), faults injected by kind, and for each fault the hit
rate (cached prompt tokens / prompt tokens, as vLLM reports them) in the minute before, during and
in the minute after, with the time until the first request got every block its tenant computed
before. Needs vLLM and NIXL in this Python.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pof_connector.bench import BenchError
from pof_connector.bench.chaos_faults import KINDS, FaultRecord, Faults, schedule
from pof_connector.bench.chaos_traffic import BLOCK, Client, Outcome, Sessions
from pof_connector.bench.netns import ip, remove_namespaces
from pof_connector.bench.router_process import RouterProcess
from pof_connector.bench.service_process import ServiceProcess
from pof_connector.bench.vllm_server import VllmServer, build_model, connector_config
from pof_connector.index.redis import RedisIndex
from pof_connector.index.server import RedisServer

Progress = Callable[[str], None]
FABRIC_TIMEOUT_S = 2.0
WINDOW_S = 60.0
"""Hit rates are compared over this long before and after each fault."""


class Cluster:
    """Every process of the run, started, watched and stopped by PID."""

    def __init__(self, workdir: Path, model: Path, seed: int, progress: Progress) -> None:
        self.workdir = workdir
        self.model = model
        self.progress = progress
        self.fabric_timeout_s = FABRIC_TIMEOUT_S
        self.shm = Path(tempfile.mkdtemp(prefix="pof-chaos-", dir="/dev/shm"))
        self.shared_region = self.shm / "shared.region"
        self.memd_region = self.shm / "memd.region"
        self.redis = RedisServer(workdir / "index")
        self.index_url = f"unix://{self.redis.socket}"
        self.netns: tuple[str, str] | None = None
        self.netns_why = ""
        self.host_dev = "lo"
        self.servers: list[VllmServer] = []
        self.reference: VllmServer | None = None
        self.memd = ServiceProcess(workdir / "memd.log")
        self.router: RouterProcess | None = None
        self.sessions = Sessions(vocab=_vocab(model), seed=seed)
        self.planned_down: set[str] = set()
        self.crashes: list[dict[str, Any]] = []
        self._page_bytes = 0
        self._carried: dict[str, float] = {}
        self._t0 = time.monotonic()
        self._lock = threading.Lock()

    def now(self) -> float:
        """Seconds since the traffic began."""
        return time.monotonic() - self._t0

    def reset_clock(self) -> None:
        self._t0 = time.monotonic()

    @contextlib.contextmanager
    def planned(self, name: str) -> Iterator[None]:
        with self._lock:
            self.planned_down.add(name)
        try:
            yield
        finally:
            with self._lock:
                self.planned_down.discard(name)

    def region_files(self) -> list[Path]:
        return [self.shared_region, self.memd_region]

    # ---- start ---------------------------------------------------------------------------

    def start(self) -> None:
        self.redis.start()
        self._make_netns()
        self.progress("starting 3 vLLM servers (2 pooled, 1 reference without the connector) ...")
        self.servers = [self._server(i) for i in range(2)]
        self.reference = VllmServer(self.model, self.workdir / "reference", extra_args=_engine_args(),
                                    max_model_len=4096, env=UNPINNED)
        threads = [threading.Thread(target=s.start) for s in [*self.servers, self.reference]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in [*self.servers, self.reference]:
            if not s.alive():
                raise BenchError(f"a vLLM server did not start:\n{s.tail()}")
        self._page_bytes = self._writers_page_bytes()
        self.start_memd()
        config = {"index_url": self.index_url, "sticky_header": "x-session-id",
                  "backends": [{"name": f"n{i}", "url": s.url} for i, s in enumerate(self.servers)]}
        self.router = RouterProcess.pof(self.workdir, config).start()

    def _pool(self, node: str, tiers: dict[str, Any], dev: str) -> dict[str, Any]:
        return {"node_id": node, "index_url": self.index_url, "runtime_dir": str(self.workdir / f"rt-{node}"),
                "heartbeat_s": 0.5, "node_ttl_s": 3.0, "tiers": tiers, "audit": {"sample_rate": AUDIT_RATE},
                "fabric": {"enabled": True, "tls": "tcp", "ucx_devices": dev, "timeout_s": self.fabric_timeout_s,
                           "staging_size": "32MiB", "spill": True, "spill_lease_s": 10.0}}

    def _server(self, i: int) -> VllmServer:
        # Small tiers: pages move down to the shared region and spill to the memory node within
        # minutes, so faults there hit pages that are read.
        tiers = {"cpu_dram": {"size": "1MiB"},
                 "cxl": {"path": str(self.shared_region), "size": "16MiB", "partitions": 2, "partition": i}}
        kv = connector_config(self._pool(f"n{i}", tiers, self.host_dev))
        return VllmServer(self.model, self.workdir / f"n{i}", kv_transfer=kv, max_model_len=4096,
                          extra_args=_engine_args(), env={"NIXL_LOG_LEVEL": "WARN", **UNPINNED})

    def counters(self) -> dict[str, float]:
        """The pooled servers' hit and pool counters, summed, including those of their earlier lives."""
        out = dict(self._carried)
        for s in self.servers:
            for name, value in _counters(s).items():
                out[name] = out.get(name, 0.0) + value
        return out

    def kill_server(self, i: int) -> None:
        """SIGKILL server ``i`` (a crash), keeping its counters."""
        server = self.servers[i]
        for name, value in _counters(server).items():
            self._carried[name] = self._carried.get(name, 0.0) + value
        assert server.proc is not None
        server.kill()

    def start_server(self, i: int) -> None:
        server = self.servers[i]
        if server.log.exists():
            server.log.rename(server.log.with_suffix(f".{int(self.now())}.log"))
        server.start(timeout_s=900)

    def _writers_page_bytes(self) -> int:
        index = RedisIndex(self.index_url, None)
        try:
            sizes = {int(n.meta["page_bytes"]) for n in index.nodes() if "page_bytes" in n.meta}
        finally:
            index.close()
        if len(sizes) != 1:
            raise BenchError(f"the pooled servers published no single page size: {sizes}")
        return sizes.pop()

    def start_memd(self) -> None:
        dev = self.netns[1] if self.netns else "lo"
        cfg = self.workdir / "memd.json"
        tiers = {"cxl": {"path": str(self.memd_region), "size": "16MiB", "partitions": 1}}
        cfg.write_text(json.dumps(self._pool("memd", tiers, dev)))
        prefix = ["ip", "netns", "exec", self.netns[0]] if self.netns else []
        if self.memd.log.exists():
            self.memd.log.rename(self.memd.log.with_suffix(f".{int(self.now())}.log"))
        self.memd.launch([*prefix, sys.executable, "-m", "pof_connector.cli", "memd", "--config", str(cfg),
                          "--slot-size", str(self._page_bytes), "--report-s", "5"], env={"NIXL_LOG_LEVEL": "WARN"})

    def _make_netns(self) -> None:
        """As root: the memory node in a namespace of its own, a veth link to this one."""
        if os.geteuid() != 0 or shutil.which("ip") is None:
            self.netns_why = "link_cut needs root and iproute2 (a network namespace for the memory node)"
            return
        tag = os.getpid() % 10000
        ns, host, peer = f"pofCh{tag}", f"pofCh{tag}h", f"pofCh{tag}m"
        net = f"10.83.{tag % 250}"
        try:
            ip("netns", "add", ns)
            ip("link", "add", host, "type", "veth", "peer", "name", peer, "netns", ns)
            ip("addr", "add", f"{net}.1/30", "dev", host)
            ip("link", "set", host, "up")
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "addr", "add", f"{net}.2/30", "dev", peer)
            ip("-n", ns, "link", "set", peer, "up")
        except subprocess.CalledProcessError as e:
            remove_namespaces([ns])
            self.netns_why = f"could not make a network namespace: {e.stderr.strip()}"
            return
        self.netns, self.host_dev = (ns, peer), host

    def storm_requests(self) -> int:
        """Unique prompts that overflow every tier of the cluster once over."""
        pool_bytes = 2 * (1 << 20) + (16 << 20) + (16 << 20)
        pages = pool_bytes // max(self._page_bytes, 1)
        return int(pages * BLOCK * 1.2 // self.sessions.storm_tokens) + 1

    # ---- watch and stop ------------------------------------------------------------------

    def watch(self) -> None:
        """A process that is down while no fault planned it is an unplanned crash: count it,
        restart it."""
        checks: dict[str, tuple[Callable[[], bool], Callable[[], object], Path]] = {
            "memd": (self.memd.alive, self.start_memd, self.memd.log),
            "index": (lambda: self.redis.proc is not None and self.redis.proc.poll() is None, self.redis.start,
                      self.redis.workdir / "index-server.log"),
        }
        for i, s in enumerate(self.servers):
            checks[f"n{i}"] = (s.alive, functools.partial(self.start_server, i), s.log)
        for name, (alive, restart, log) in checks.items():
            with self._lock:
                if name in self.planned_down:
                    continue
            if alive():
                continue
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:]) if log.exists() else ""
            self.crashes.append({"process": name, "at_s": round(self.now(), 1), "log_tail": tail})
            self.progress(f"UNPLANNED: {name} is down; restarting it")
            with self.planned(name):
                restart()

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop(grace_s=10)
        for s in [*self.servers, *([self.reference] if self.reference else [])]:
            s.stop()
        self.memd.stop(grace_s=10)
        self.redis.stop()
        if self.netns is not None:
            remove_namespaces([self.netns[0]])
        shutil.rmtree(self.shm, ignore_errors=True)


UNPINNED = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
"""vLLM on a CPU pins its worker to cores and its other processes to the rest: a server restarted
while the others serve traffic found its engine process pinned to a core a busy worker held, and
took minutes to start (or never did). Unpinned, one thread each, the kernel shares the cores."""


def _engine_args() -> list[str]:
    # A small engine cache (48 blocks of 128 tokens) that long sessions overflow: prefixes come
    # back from the pool, not only from the engine's own cache. float32: every answer is compared
    # token for token with a server without the connector, and in bf16 on CPUs with AMX vLLM's own
    # numbers differ between a server with any KV connector and one without.
    return ["--block-size", str(BLOCK), "--num-gpu-blocks-override", "48", "--max-num-seqs", "4",
            "--enable-prompt-tokens-details", "--dtype", "float32"]


COUNTERS = ("vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total")


AUDIT_RATE = 0.1
"""The pooled servers audit a tenth of their pool hits: enough that a few minutes of chaos compare
pages that moved through every fault (an operator's default is 0.01)."""


def _counters(server: VllmServer) -> dict[str, float]:
    """vLLM's hit counters and every pof counter (by label set too) of a live server; {} if down."""
    try:
        samples = server.metrics() if server.alive() else {}
    except OSError:
        return {}
    return {k: v for k, v in samples.items()
            if k in COUNTERS or ("pof_" in k and "_created" not in k and k.endswith(("_total", "}")))}


def _vocab(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


# ---- the run ---------------------------------------------------------------------------------


def run(*, minutes: float, seed: int, rounds: int, model: str | None, max_requests: int,
        progress: Progress, kinds: tuple[str, ...] = KINDS) -> dict[str, Any]:
    """``kinds``: the fault kinds to inject, ``rounds`` times each."""
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise BenchError(f"unknown fault kinds {bad}; allowed: {', '.join(KINDS)}")
    model_dir = Path(model) if model else build_model("tiny")
    workdir = Path(tempfile.mkdtemp(prefix="pof-chaos-", dir="/tmp"))
    cluster = Cluster(workdir, model_dir, seed, progress)
    records: list[FaultRecord] = []
    keep: bool | None = None
    try:
        cluster.start()
        assert cluster.router is not None and cluster.reference is not None
        cluster.reset_clock()
        client = Client(cluster.router.url, cluster.reference.url, cluster.sessions, cluster.now)
        duration = minutes * 60
        plan = schedule(seed, rounds, duration - 30, 30.0, kinds)
        progress(f"{duration / 60:g} minutes of traffic, {len(plan)} faults ({rounds} of each kind); "
                 f"memory node {'in network namespace ' + cluster.netns[0] if cluster.netns else 'on loopback'}")
        stop = threading.Event()
        traffic = threading.Thread(target=client.run, args=(stop, max_requests), daemon=True)
        traffic.start()
        faults = Faults(cluster, seed)
        next_report = 60.0
        for at, kind in plan:
            while cluster.now() < at and traffic.is_alive():
                cluster.watch()
                next_report = _report(client, cluster, next_report, progress)
                time.sleep(0.5)
            if not traffic.is_alive():
                break
            record = faults.inject(kind, cluster.now())
            records.append(record)
            progress(f"[{record.at_s:6.0f} s] fault {kind}: {record.skipped or record.detail}")
            cluster.watch()
        end = max(duration, cluster.now() + WINDOW_S / 2)
        while cluster.now() < end and traffic.is_alive():
            cluster.watch()
            next_report = _report(client, cluster, next_report, progress)
            time.sleep(0.5)
        stop.set()
        traffic.join(timeout=600)
        if client.error:
            raise BenchError(client.error)
        # The logs of a run with a wrong answer or a crash stay, for the post-mortem.
        keep = any(o.wrong for o in client.outcomes) or bool(cluster.crashes)
        return _result(client.outcomes, records, cluster, minutes, seed, rounds, kinds,
                       str(workdir) if keep else None)
    finally:
        cluster.stop()
        if keep is False:
            shutil.rmtree(workdir, ignore_errors=True)


def _report(client: Client, cluster: Cluster, next_at: float, progress: Progress) -> float:
    if cluster.now() < next_at:
        return next_at
    outs = list(client.outcomes)
    progress(f"[{cluster.now():6.0f} s] {len(outs)} requests, {sum(o.wrong for o in outs)} wrong, "
             f"{sum(o.answer is None for o in outs)} failed, hit rate {_hit_rate(outs)}")
    return cluster.now() + 60.0


def _hit_rate(outs: list[Outcome]) -> float | None:
    """Cached / prompt tokens of the answered requests (storms left out); None: there were none."""
    answered = [o for o in outs if o.answer is not None and not o.request.storm]
    prompt = sum(len(o.request.prompt) for o in answered)
    return round(sum(o.cached_tokens for o in answered) / prompt, 3) if prompt else None


def _fault_row(r: FaultRecord, outs: list[Outcome]) -> dict[str, Any]:
    def window(lo: float, hi: float) -> list[Outcome]:
        return [o for o in outs if lo <= o.at_s < hi]

    before, during = window(r.at_s - WINDOW_S, r.at_s), window(r.at_s, r.end_s)
    after = window(r.end_s, r.end_s + WINDOW_S)
    recovered = next((o.at_s for o in outs if o.at_s >= r.end_s and o.full_hit and not o.request.storm), None)
    row: dict[str, Any] = {"kind": r.kind, "at_s": round(r.at_s, 1), "lasted_s": round(r.end_s - r.at_s, 1),
                           "detail": r.detail}
    if r.skipped:
        row["skipped"] = r.skipped
        return row
    row.update({"hit_rate_before": _hit_rate(before), "hit_rate_during": _hit_rate(during),
                "hit_rate_after": _hit_rate(after), "requests_during": len(during),
                "failed_during": sum(o.answer is None for o in during),
                "recover_full_hits_s": None if recovered is None else round(recovered - r.end_s, 1)})
    return row


def _result(outs: list[Outcome], records: list[FaultRecord], cluster: Cluster, minutes: float, seed: int,
            rounds: int, kinds: tuple[str, ...], kept: str | None) -> dict[str, Any]:
    rows = [_fault_row(r, outs) for r in records]
    counters = {k: int(v) for k, v in sorted(cluster.counters().items())}
    injected = {k: sum(1 for r in records if r.kind == k and not r.skipped) for k in kinds}
    skipped = {r.kind: r.skipped for r in records if r.skipped}
    recover = [row["recover_full_hits_s"] for row in rows if row.get("recover_full_hits_s") is not None]
    wrong = [o for o in outs if o.wrong]
    failed = [o for o in outs if o.answer is None]
    return {
        "bench": "chaos",
        "minutes": minutes, "seed": seed, "rounds": rounds,
        "requests": {"sent": len(outs), "answered": len(outs) - len(failed), "failed": len(failed),
                     "storm": sum(o.request.storm for o in outs)},
        "wrong_answers": len(wrong),
        # The pooled servers' own audit (audit.sample_rate of their hits recomputed and compared).
        "audit_mismatches": int(cluster.counters().get("vllm:pof_audit_mismatches_total", 0)),
        "audited_pages": int(cluster.counters().get("vllm:pof_audit_pages_total", 0)),
        "answers_differing_from_cold_reference": sum(o.differs for o in outs),
        "unplanned_crashes": len(cluster.crashes),
        "faults": injected,
        "faults_skipped": skipped,
        "hit_rate": _hit_rate(outs),
        "pool_counters": counters,
        "full_hit_share": round(sum(o.full_hit for o in outs) / max(1, sum(o.bound_tokens > 0 for o in outs)), 4),
        "recover_full_hits_s": {"median": round(statistics.median(recover), 1) if recover else None,
                                "max": max(recover) if recover else None},
        "fault_log": rows,
        "crashes": cluster.crashes,
        "differing": [{"at_s": round(o.at_s, 1), "tenant": o.request.tenant, "backend": o.backend,
                       "prompt_tokens": len(o.request.prompt), "cached_tokens": o.cached_tokens,
                       "reference": o.reference, "answer": o.answer, "recheck": o.recheck,
                       "recheck_cached_tokens": o.recheck_cached, "wrong": o.wrong}
                      for o in outs if o.differs][:10],
        "failures": [{"at_s": round(o.at_s, 1), "error": o.error[:300]} for o in failed[:10]],
        "kept_logs": kept,
        "note": "wrong_answers: answers through pof router that differ from the reference server's (no connector) "
                "greedy answer to the same prompt, computed cold and again with as many prompt tokens from its own "
                "prefix cache as the pooled server had (a prefix hit changes vLLM's arithmetic on a CPU, with or "
                "without a pool: answers_differing_from_cold_reference counts those too); hit rate: cached prompt "
                f"tokens / prompt tokens as vLLM reports them, over {WINDOW_S:g} s before a fault, during it and "
                f"{WINDOW_S:g} s after; recover_full_hits_s: "
                "from the end of a fault to the first request served with every block its tenant computed before",
    }
