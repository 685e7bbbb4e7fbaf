"""pof's background threads and its embedded index server run on every CPU, not on the engine's.

vLLM's CPU worker binds its threads to cores (``VLLM_CPU_OMP_THREADS_BIND``, default ``auto``),
and every thread and process it starts afterwards inherits that binding: pof's heartbeat, its
store thread, and the embedded index server the first pof process of a host starts. Several
servers on one host each bind to the same cores. Measured on a 2-core host with four vLLM CPU
servers: all four workers and the index server on core 0, core 1 nearly idle; a P/D decode whose
pages had not arrived made vLLM run empty steps back to back, its worker took core 0, and the other
servers' heartbeats did not reach the index for 8-11 s, so their registrations lapsed and their
pages were hidden from every lookup (issue 43's rare decode miss)."""

from __future__ import annotations

import logging
import os

log = logging.getLogger("pof_connector.pool")


def unpin(tid: int = 0) -> None:
    """Let thread ``tid`` (0: the calling one, and what it starts later) run on every CPU the
    host's cpuset allows, whatever binding it inherited. Where the platform cannot, nothing changes."""
    setaffinity = getattr(os, "sched_setaffinity", None)
    count = os.cpu_count()
    if setaffinity is None or not count:
        return
    try:
        setaffinity(tid, range(count))   # the kernel keeps only the CPUs this cgroup's cpuset allows
    except OSError as e:                 # gone, or a cpuset that excludes them all: as it was
        log.debug("pof: could not widen the CPU affinity of thread %d: %s", tid, e)


def unpin_process(pid: int) -> None:
    """:func:`unpin` every thread of process ``pid`` (a server this process started: it was seen
    bound to the engine's core although its parent was not)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        unpin(tid)
