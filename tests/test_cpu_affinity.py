"""pof's heartbeat and its embedded index server run on every CPU even when the engine thread
that started them is bound to one (vLLM's CPU worker binds its threads: pof_connector/cpu_affinity.py)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pof_connector.config import PofConfig
from pof_connector.index.embedded import PIDFILE, ensure_embedded, stop_embedded
from pof_connector.index.server import RedisServer
from pof_connector.pages.layout import PageSpec
from pof_connector.pool import Pool

CPUS = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
pytestmark = pytest.mark.skipif(len(CPUS) < 2, reason="binding to one CPU changes nothing on a one-CPU host")


@pytest.fixture
def bound_to_one_cpu() -> Iterator[int]:
    """The calling thread bound to one CPU, as a vLLM CPU worker's thread is; restored after."""
    cpu = min(CPUS)
    os.sched_setaffinity(0, {cpu})
    try:
        yield cpu
    finally:
        os.sched_setaffinity(0, CPUS)


def threads_cpus(pid: int) -> list[set[int]]:
    return [os.sched_getaffinity(int(t)) for t in os.listdir(f"/proc/{pid}/task")]


def eventually(pred: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_the_embedded_index_server_started_from_a_bound_thread_runs_on_every_cpu(bound_to_one_cpu: int,
                                                                                   runtime_dir: str) -> None:
    ensure_embedded(runtime_dir, idle_s=30)
    pidfile = Path(runtime_dir) / PIDFILE
    try:
        assert eventually(lambda: pidfile.exists() and len(pidfile.read_text().split()) == 2)
        supervisor, server = (int(p) for p in pidfile.read_text().split())
        for pid in (supervisor, server):
            assert eventually(lambda pid=pid: all(c == CPUS for c in threads_cpus(pid))), (pid, threads_cpus(pid))
    finally:
        stop_embedded(runtime_dir)


def test_the_heartbeat_of_a_pool_made_on_a_bound_thread_runs_on_every_cpu(bound_to_one_cpu: int,
                                                                          redis_server: RedisServer,
                                                                          runtime_dir: str, namespace: bytes) -> None:
    cfg = PofConfig.from_mapping({"node_id": "a", "index_url": redis_server.url, "runtime_dir": runtime_dir,
                                  "tiers": {"cpu_dram": {"size": "64KiB"}}})
    pool = Pool(cfg, PageSpec(2, 1024, 16), namespace)
    try:
        beat = next(t for t in threading.enumerate() if t.name == "pof-heartbeat")
        assert beat.native_id is not None
        assert eventually(lambda: os.sched_getaffinity(beat.native_id) == CPUS)
        assert os.sched_getaffinity(0) == {bound_to_one_cpu}          # the engine's own thread keeps its binding
    finally:
        pool.close()
