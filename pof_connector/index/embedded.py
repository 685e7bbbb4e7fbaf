"""``index_url: embedded``: one private Redis-protocol server per host, started on demand.

The first pof process of a host that needs it starts a small supervisor
(``python -m pof_connector.index.embedded``) in its own session; the supervisor runs the server
on a unix socket in the runtime directory (``runtime_dir``, default ``/tmp/pof-<uid>``) and
every later process of that host connects to the same socket. The supervisor stops the server
and exits when no client has been connected for ``--idle-s`` seconds (default 600), or on
SIGTERM; ``pof index stop`` sends that. Its PID is in ``embedded.pid``.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

from pof_connector.index.server import RedisServer, ping

log = logging.getLogger(__name__)

SOCKET = "index.sock"
PIDFILE = "embedded.pid"


def embedded_url(runtime_dir: str | Path) -> str:
    return f"unix://{Path(runtime_dir) / SOCKET}"


def ensure_embedded(runtime_dir: str | Path, timeout_s: float = 20.0, idle_s: float = 600.0) -> str:
    """The URL of this host's embedded index server, starting it if none answers."""
    rt = Path(runtime_dir)
    rt.mkdir(parents=True, exist_ok=True, mode=0o700)
    url = embedded_url(rt)
    if ping(url):
        return url
    with open(rt / "embedded.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # one starter per host; the others wait and reuse
        if ping(url):
            return url
        logfile = open(rt / "embedded.log", "ab")  # noqa: SIM115 - handed to the child
        subprocess.Popen(
            [sys.executable, "-m", "pof_connector.index.embedded", "--runtime-dir", str(rt),
             "--idle-s", str(idle_s)],
            stdin=subprocess.DEVNULL, stdout=logfile, stderr=logfile, start_new_session=True,
        )
        logfile.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ping(url):
                log.info("pof: started the embedded index server at %s", url)
                return url
            time.sleep(0.05)
    raise TimeoutError(f"the embedded index server did not start within {timeout_s}s; see {rt / 'embedded.log'}")


def stop_embedded(runtime_dir: str | Path) -> bool:
    """Stop this host's embedded server by the supervisor's PID; ``False`` when none ran.

    The PID is signalled only when it is still a pof supervisor: a stale pidfile's PID may belong
    to an unrelated process by now.
    """
    from pof_connector.index.server import kill_pid

    pidfile = Path(runtime_dir) / PIDFILE
    try:
        pid = int(pidfile.read_text().split()[0])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ValueError, IndexError):
        return False
    if b"pof" not in cmdline:      # `python -m pof_connector.index.embedded` or `pof index serve`
        return False
    kill_pid(pid)
    return True


def supervise(runtime_dir: Path, idle_s: float) -> int:
    """Run the server until SIGTERM/SIGINT, until no client was connected for ``idle_s``, or until
    its socket disappears (somebody removed the runtime directory)."""
    pidfile = runtime_dir / PIDFILE
    pidfile.write_text(f"{os.getpid()}\n")        # stoppable before the server answers
    stop = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    server = RedisServer(runtime_dir).start()
    pidfile.write_text(f"{os.getpid()} {server.pid}\n")
    watch = redis.Redis.from_url(server.url, socket_timeout=2)
    idle_since = time.monotonic()
    try:
        while not stop:
            time.sleep(1.0)
            if server.proc is None or server.proc.poll() is not None:
                print("index server exited", file=sys.stderr)
                return 1
            if not server.socket.exists():
                print("socket removed: stopping", file=sys.stderr)
                break
            try:
                clients = int(watch.info("clients")["connected_clients"]) - 1   # minus this watcher
            except redis.RedisError:
                clients = 0        # cannot tell: count it as idle, so a broken server cannot live forever
            if clients > 0:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > idle_s:
                print(f"no clients for {idle_s}s: stopping", file=sys.stderr)
                break
    finally:
        watch.close()
        server.stop()
        try:
            pidfile.unlink()
        except FileNotFoundError:
            pass
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="pof embedded index supervisor")
    ap.add_argument("--runtime-dir", required=True)
    ap.add_argument("--idle-s", type=float, default=600.0)
    a = ap.parse_args(argv)
    return supervise(Path(a.runtime_dir), a.idle_s)


if __name__ == "__main__":
    sys.exit(main())
