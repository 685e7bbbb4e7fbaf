"""Network namespaces for the benches and tests that put a node behind a veth link (as root)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def ip(*args: str) -> str:
    """Run ``ip ARGS``; its stdout. Raises ``CalledProcessError`` (with stderr) when it fails."""
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10).stdout


def remove_namespaces(names: list[str]) -> None:
    """Kill what still runs in them (by PID), then delete them (which takes their veth ends along)."""
    for ns in names:
        for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
