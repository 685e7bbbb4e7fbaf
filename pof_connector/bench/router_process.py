"""A router run as a subprocess (`pof router`, or the stock `vllm-router` for comparison), stopped
by its PID. Used by the routing tests and `pof bench router`."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from pof_connector.bench.vllm_server import free_port


class RouterProcess:
    def __init__(self, args: list[str], port: int, log: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def pof(cls, workdir: Path, config: dict[str, Any], name: str = "pof-router") -> RouterProcess:
        """`pof router` with ``config`` (its ``listen`` is set to a free port)."""
        port = free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        path = workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**config, "listen": f"127.0.0.1:{port}"}))
        return cls([sys.executable, "-m", "pof_connector.cli", "router", "--config", str(path)], port,
                   workdir / f"{name}.log")

    @classmethod
    def vllm_router(cls, workdir: Path, workers: list[str], policy: str, extra: list[str] | None = None,
                    name: str = "vllm-router") -> RouterProcess:
        """The stock ``vllm-router`` (the binary of the vllm-router wheel next to this Python)."""
        binary = Path(sys.executable).parent / "vllm-router"
        exe = str(binary) if binary.exists() else shutil.which("vllm-router")
        if exe is None:
            raise FileNotFoundError("vllm-router is not installed (pip install vllm-router==0.1.17)")
        port = free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        args = [exe, "--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--worker-urls", *workers,
                "--prometheus-port", str(free_port()), *(extra or [])]
        return cls(args, port, workdir / f"{name}.log")

    def start(self, timeout_s: float = 60, health: str = "/health") -> RouterProcess:
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                         env=dict(os.environ, **self.env), start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.args[0]} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + health, timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"{self.args[0]} did not come up in {timeout_s}s:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
