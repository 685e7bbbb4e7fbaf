"""Pool nodes in separate processes (tests/fabric/node_proc.py), stopped by PID."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
NODE_PROC = Path(__file__).with_name("node_proc.py")
TIMEOUT_S = 1.0
"""fabric.timeout_s of the test nodes."""


LEASE_S = 3.0
"""fabric.spill_lease_s of the test nodes (the owner keeps a slot TIMEOUT_S longer)."""


def node_config(node: str, index_url: str, runtime_dir: str, *, ucx_devices: str = "lo", spill: bool = False,
                dram: str = "1MiB") -> dict[str, Any]:
    return {"node_id": node, "index_url": index_url, "runtime_dir": runtime_dir, "heartbeat_s": 0.1,
            "node_ttl_s": 2.0, "tiers": {"cpu_dram": {"size": dram}},
            # TLS=tcp: without it UCX would copy between processes of one host (or of two network
            # namespaces) through shared memory, and the test would not cross a network at all.
            "fabric": {"enabled": True, "tls": "tcp", "ucx_devices": ucx_devices, "timeout_s": TIMEOUT_S,
                       "staging_size": "256KiB", "spill": spill, "spill_lease_s": LEASE_S}}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}   # UCX_* would override pof's
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["NIXL_LOG_LEVEL"] = "WARN"
    return env


def _state(task: Path) -> str:
    """A thread's state letter from /proc (``T`` or ``t``: stopped); ``X`` once it is gone."""
    try:
        stat = (task / "stat").read_text()
    except OSError:
        return "X"
    return stat[stat.rindex(")") + 2]


class _Child:
    """A test's child process, stopped by its PID."""

    proc: subprocess.Popen[str]
    pid: int

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def stop(self, timeout: float = 5.0) -> None:
        """SIGSTOP, then wait until every thread is stopped: the signal only asks. On a busy VM a
        thread running on another vCPU answered one more READ after the kill returned (a flake:
        a load "through a stalled owner" succeeded in 6 ms)."""
        os.kill(self.pid, signal.SIGSTOP)
        tasks = Path(f"/proc/{self.pid}/task")
        deadline = time.monotonic() + timeout
        while not all(_state(t) in "tTX" for t in tasks.iterdir()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.pid} did not stop within {timeout} s")
            time.sleep(0.001)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(10)


class NodeProc(_Child):
    def __init__(self, config: dict[str, Any], prefix: tuple[str, ...] = (),
                 page: tuple[int, int] | None = None) -> None:
        """``page``: (layers, segment bytes) of the node's pages; ``None``: node_proc.SPEC."""
        self.name = config["node_id"]
        geometry = [] if page is None else [f"{page[0]}:{page[1]}"]
        self.proc = subprocess.Popen([*prefix, sys.executable, str(NODE_PROC), json.dumps(config), *geometry],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())
        self.pid = self.proc.pid
        # Lines are read on a thread into a queue: select() on the pipe cannot see lines already
        # sitting in the reader's buffer (e.g. a reply read together with a library's log line).
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, name=f"{self.name}-stdout", daemon=True).start()
        self.ready = self._reply(60)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put("")          # EOF

    def call(self, op: str, timeout: float = 30, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        reply = self._reply(timeout)
        assert "error" not in reply, f"{self.name}: {reply['error']}"
        return reply

    def _reply(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{self.name} did not answer in {timeout}s") from None
            if not line:
                raise RuntimeError(f"{self.name} exited with {self.proc.wait()}")
            if line.startswith("{"):        # anything else is a library printing to stdout
                reply: dict[str, Any] = json.loads(line)
                return reply

    def close(self) -> None:
        """Quit politely; kill by PID if that does not work."""
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGCONT)
                assert self.proc.stdin is not None
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


class MemdProc(_Child):
    """``pof memd`` in its own process (its log on stderr, captured in ``log_path``)."""

    def __init__(self, config: dict[str, Any], config_path: Path, slot_bytes: int,
                 prefix: tuple[str, ...] = ()) -> None:
        config_path.write_text(json.dumps(config))
        self.name = config["node_id"]
        self.log_path = config_path.with_suffix(".log")
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "pof_connector.cli", "memd", "--config",
                                      str(config_path), "--slot-size", str(slot_bytes), "--report-s", "0.5"],
                                     stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=_env())
        self.pid = self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text()

    def close(self) -> None:
        """SIGTERM (a clean stop); kill by PID if that does not work."""
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGCONT)
                os.kill(self.pid, signal.SIGTERM)
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        self._log.close()


def wait_for(pred: Any, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout}s"
        time.sleep(0.05)
