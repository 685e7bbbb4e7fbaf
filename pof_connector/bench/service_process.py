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

    def launch(self, args: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        """Start ``args`` with ``env`` added to this process's environment."""
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
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""

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
