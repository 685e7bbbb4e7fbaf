"""A process a test or benchmark starts: its own session, output to a log file, stopped by its PID
(the whole process group, so an engine's children go with it)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


class ServiceProcess:
    def __init__(self, log: Path) -> None:
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def launch(self, args: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None,
               nice: int | None = None) -> None:
        """Start ``args`` with ``env`` added to this process's environment, at niceness ``nice``
        (``None``: this process's). Set through coreutils ``nice`` before the program runs, so every
        thread it starts has it too; where lowering it is not allowed, the process runs at this
        one's (:meth:`niceness` says which)."""
        if nice is not None and (adjust := nice - os.getpriority(os.PRIO_PROCESS, 0)) != 0:  # `nice -n` is relative
            args = ["nice", "-n", str(adjust), *args]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                         env=dict(os.environ, **(env or {})), start_new_session=True)

    def wait_healthy(self, url: str, timeout_s: float, *, interval_s: float = 0.5) -> None:
        """Until ``url`` answers 200; raises (and stops the process) if it exits or times out."""
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.log.name}: exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(interval_s)
        self.stop()
        raise TimeoutError(f"{self.log.name}: {url} did not answer in {timeout_s}s:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        """The log's last ``n`` lines, after its first traceback when that lies further up: an engine
        that fails to start prints the root cause in a child process, then a long traceback of its
        parent that only says "see root cause above"."""
        if not self.log.exists():
            return ""
        lines = self.log.read_text(errors="replace").splitlines()
        first = next((i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line), None)
        if first is None or first >= len(lines) - n:
            return "\n".join(lines[-n:])
        start, skipped = max(0, first - 3), len(lines) - n - (first + n)
        if skipped <= 0:
            return "\n".join(lines[start:])
        return "\n".join([*lines[start:first + n], f"[... {skipped} lines ...]", *lines[-n:]])

    @property
    def pid(self) -> int | None:
        """The launched process's pid; ``None`` before :meth:`launch` and after :meth:`stop`."""
        return self.proc.pid if self.proc is not None else None

    def niceness(self) -> int | None:
        """The running process's niceness; ``None`` when it is not running."""
        return niceness_of(self.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the process group at once (a crash, as a fault injects it) and reap it."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def stop(self, grace_s: float = 30) -> int | None:
        """SIGTERM the process group, SIGKILL what is left after ``grace_s``; the exit code."""
        if self.proc is None:
            return None
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        try:
            os.killpg(proc.pid, signal.SIGKILL)     # stragglers of the group, if any
        except ProcessLookupError:
            pass
        return proc.returncode


def niceness_of(pid: int | None) -> int | None:
    """Process ``pid``'s niceness (its main thread's); ``None`` when there is no such process."""
    if pid is None:
        return None
    try:
        return os.getpriority(os.PRIO_PROCESS, pid)
    except ProcessLookupError:
        return None
