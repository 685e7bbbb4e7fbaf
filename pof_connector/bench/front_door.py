"""The capacity bench's front door (the routers, pof's index server, the relays) in the real-time
scheduling class, so that it runs as promptly as on hosts of its own.

In a deployment the router and the index run on hosts of their own; in ``pof bench capacity``
they share two cores with vLLM servers whose workers poll their queues for a second after each
step (vLLM's ``SpinCondition``). Niceness alone (``--router-nice``) did not make the kernel (EEVDF,
Linux 6.18) wake them promptly: at x16 on the default mix the pof router's index lookup took 7-19 ms
on average and its requests spent 0.11-0.19 s outside the engine, against 0.6 ms and 0.03-0.05 s
with the same processes at ``SCHED_RR`` priority 1. vllm-router kv_aware's goodput did not move
with it, so the routing each set-up chooses, not the host's wake-ups, is what the bench compares.

Threads a process creates later inherit the class from the thread that creates them, so setting
it on each existing thread of a started process covers the rest.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCHEDS = ("rr", "nice")
RT_PRIORITY = 1
"""The lowest real-time priority: above every ordinary process, below the kernel's own threads."""


def can_use_rr() -> bool:
    """Whether this process may put others in ``SCHED_RR`` (root, or ``CAP_SYS_NICE``); asked in a
    child, so that this process's own class is left alone."""
    probe = f"import os; os.sched_setscheduler(0, os.SCHED_RR, os.sched_param({RT_PRIORITY}))"
    return subprocess.run([sys.executable, "-c", probe], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode == 0


def make_realtime(pid: int) -> int:
    """Put every thread of process ``pid`` in ``SCHED_RR`` at :data:`RT_PRIORITY`; the number of
    threads moved (a thread that ended meanwhile is skipped). Raises ``PermissionError``."""
    moved = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setscheduler(int(task.name), os.SCHED_RR, os.sched_param(RT_PRIORITY))
        except ProcessLookupError:
            continue
        moved += 1
    return moved


def sched_of(pid: int | None) -> str | None:
    """``rr`` when ``pid``'s main thread runs in ``SCHED_RR``, ``nice`` otherwise; ``None``: no such
    process."""
    if pid is None:
        return None
    try:
        return "rr" if os.sched_getscheduler(pid) == os.SCHED_RR else "nice"
    except ProcessLookupError:
        return None
