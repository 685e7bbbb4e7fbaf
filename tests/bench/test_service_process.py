"""What a failed service's error shows of its log (`ServiceProcess.tail`)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from pof_connector.bench.service_process import ServiceProcess


def _log(tmp_path: Path, lines: list[str]) -> ServiceProcess:
    service = ServiceProcess(tmp_path / "s.log")
    service.log.write_text("\n".join(lines) + "\n")
    return service


def test_tail_shows_the_first_traceback_when_the_last_lines_do_not_reach_it(tmp_path: Path) -> None:
    cause = ["(EngineCore pid=7) ERROR EngineCore failed to start.",
             "(EngineCore pid=7) Traceback (most recent call last):",
             "(EngineCore pid=7) OSError: [Errno 98] Address already in use"]
    service = _log(tmp_path, [f"info {i}" for i in range(200)] + cause + [f"parent {i}" for i in range(200)])
    text = service.tail(20).splitlines()
    assert text[:2] == ["info 198", "info 199"] and text[2:5] == cause
    assert text[-1] == "parent 199" and len(text) == 3 + 20 + 1 + 20
    assert "lines ..." in text[23] and text[22] == "parent 17"


def test_tail_is_the_last_lines_when_they_hold_the_traceback_or_there_is_none(tmp_path: Path) -> None:
    plain = _log(tmp_path, [f"line {i}" for i in range(100)])
    assert plain.tail(10).splitlines() == [f"line {i}" for i in range(90, 100)]
    near = _log(tmp_path, [f"a {i}" for i in range(50)] + ["Traceback (most recent call last):", "boom"] + ["b"] * 5)
    assert near.tail(10).splitlines()[-7:] == ["Traceback (most recent call last):", "boom"] + ["b"] * 5
    overlap = _log(tmp_path, ["x"] * 30 + ["Traceback (most recent call last):"] + [f"c {i}" for i in range(15)])
    assert overlap.tail(10).splitlines()[0] == "x" and overlap.tail(10).splitlines()[-1] == "c 14"


def test_a_service_that_exits_at_start_raises_with_its_root_cause(tmp_path: Path) -> None:
    service = ServiceProcess(tmp_path / "dies.log")
    code = "import sys\nprint('\\n'.join(f'noise {i}' for i in range(300)))\nraise SystemExit(sys.argv[1])"
    service.launch([sys.executable, "-c", code, "root cause here"])
    with pytest.raises(RuntimeError, match="root cause here"):
        service.wait_healthy("http://127.0.0.1:9/health", timeout_s=30, interval_s=0.05)


def test_a_service_runs_at_the_niceness_asked_for_threads_included(tmp_path: Path) -> None:
    target = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 3)     # raising it needs no privilege
    code = ("import os, threading, time\n"
            "t = threading.Thread(target=lambda: print('thread', os.getpriority(os.PRIO_PROCESS, 0), flush=True))\n"
            "t.start(); t.join(); time.sleep(30)")
    service = ServiceProcess(tmp_path / "nice.log")
    service.launch([sys.executable, "-c", code], nice=target)
    try:
        deadline = time.monotonic() + 20
        while "thread" not in service.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert service.niceness() == target
        assert f"thread {target}" in service.log.read_text()
    finally:
        service.stop(grace_s=5)
    assert service.niceness() is None


def test_pid_is_the_launched_process_until_it_is_stopped(tmp_path: Path) -> None:
    service = ServiceProcess(tmp_path / "s.log")
    assert service.pid is None
    service.launch([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        pid = service.pid
        assert pid is not None and os.path.exists(f"/proc/{pid}")
    finally:
        service.stop(grace_s=5)
    assert service.pid is None and not os.path.exists(f"/proc/{pid}")
