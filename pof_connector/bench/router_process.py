"""A router run as a subprocess (`pof router`, or the stock `vllm-router` for comparison), stopped
by its PID. Used by the routing tests and `pof bench router`."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

from pof_connector.bench.service_process import ServiceProcess
from pof_connector.bench.vllm_server import free_port


class RouterProcess(ServiceProcess):
    def __init__(self, args: list[str], port: int, log: Path) -> None:
        super().__init__(log)
        self.args = args
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

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
        """The stock ``vllm-router`` (the binary of the vllm-router wheel next to this Python), with
        a Prometheus port of its own (two on one host collide on the default)."""
        binary = Path(sys.executable).parent / "vllm-router"
        exe = str(binary) if binary.exists() else shutil.which("vllm-router")
        if exe is None:
            raise FileNotFoundError("vllm-router is not installed (pip install vllm-router==0.1.17)")
        port = free_port()
        args = [exe, "--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--worker-urls", *workers,
                "--prometheus-port", str(free_port()), *(extra or [])]
        return cls(args, port, workdir / f"{name}.log")

    def start(self, timeout_s: float = 60, *, nice: int | None = None) -> RouterProcess:
        """``nice``: the router's niceness (``None``: this process's; see :meth:`ServiceProcess.launch`)."""
        self.launch(self.args, nice=nice)
        self.wait_healthy(self.url + "/health", timeout_s, interval_s=0.2)
        return self
