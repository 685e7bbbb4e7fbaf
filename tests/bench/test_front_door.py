"""The capacity bench's front door in SCHED_RR: every thread of a started process, and the threads
it starts afterwards (they inherit the class)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pof_connector.bench.front_door import can_use_rr, make_realtime, sched_of

CHILD = """
import sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
sys.stdout.write("up\\n"); sys.stdout.flush()
sys.stdin.readline()                     # the test moved us: start one more thread
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
sys.stdout.write("more\\n"); sys.stdout.flush()
time.sleep(60)
"""


def _classes(pid: int) -> list[int]:
    return [os.sched_getscheduler(int(t.name)) for t in Path(f"/proc/{pid}/task").iterdir()]


def test_every_thread_moves_and_later_threads_inherit_it() -> None:
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline() == "up\n"
        assert sched_of(proc.pid) == "nice" and len(_classes(proc.pid)) == 2
        if not can_use_rr():
            with pytest.raises(PermissionError):
                make_realtime(proc.pid)
            return
        assert make_realtime(proc.pid) == 2
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "more\n"
        classes = _classes(proc.pid)
        assert len(classes) == 3 and set(classes) == {os.SCHED_RR}, classes
        assert sched_of(proc.pid) == "rr"
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 5
    while sched_of(proc.pid) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sched_of(proc.pid) is None           # no such process
    assert sched_of(None) is None
