"""``index_url: embedded``: one private Redis-protocol server per host, started on demand.

The first pof process of a host that needs it starts a small supervisor
(``python -m pof_connector.index.embedded``) in its own session; the supervisor runs the server
on a unix socket in the runtime directory (``runtime_dir``, default ``/tmp/pof-<uid>``) and
every later process of that host connects to the same socket. The supervisor stops the server
and exits when no client has been connected for ``--idle-s`` seconds (default 600), when the
server exits, or on SIGTERM; ``pof index stop`` sends that. Its PID and the server's are in
``embedded.pid``.

Whether the server lives is decided by its processes, never by a command that timed out (a busy
CPU makes a live server slow, not dead): the supervisor holds an exclusive ``flock`` on
``embedded.live`` for its whole life and hands the same open file to the server process, so the
lock is held exactly while either of them runs, frozen (SIGSTOP) or not. Only a process that
holds the start lock (``embedded.lock``) and finds ``embedded.live`` free starts a server, and
only a supervisor that took ``embedded.live`` removes a stale socket: a live server's socket is
never replaced, so two servers never split one path. Restarts after a server died are recorded,
one line each, in ``embedded.restarts`` (``pof stats`` shows them).
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
from typing import IO

import redis

from pof_connector.cpu_affinity import unpin, unpin_process
from pof_connector.index.server import RedisServer, ping
from pof_connector.runtime_dir import private_dir

log = logging.getLogger(__name__)

SOCKET = "index.sock"
PIDFILE = "embedded.pid"
START_LOCK = "embedded.lock"
LIVE_LOCK = "embedded.live"
RESTARTS = "embedded.restarts"
TAKE_LIVE_LOCK_S = 5.0
"""How long a new supervisor tries for ``embedded.live`` (held by nobody else unless a server lives)."""


def embedded_url(runtime_dir: str | Path) -> str:
    return f"unix://{Path(runtime_dir) / SOCKET}"


def embedded_alive(runtime_dir: str | Path) -> bool:
    """Does a supervisor or server process of ``runtime_dir`` run (answering or not)?

    Read from ``/proc/locks``, so asking takes no lock: a lock taken to ask would, were the
    asking process forked meanwhile (engines fork workers), stay held by the child and keep
    every later supervisor from starting."""
    try:
        st = os.stat(Path(runtime_dir) / LIVE_LOCK)
    except FileNotFoundError:
        return False
    try:
        with open("/proc/locks") as f:
            table = f.read()
    except OSError:                  # no procfs: ask by trying the lock
        return _held_by_flock(Path(runtime_dir) / LIVE_LOCK)
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:2146589 0 EOF"; waiters' lines carry "->" and are skipped
    return any(f[1:4] == ["FLOCK", "ADVISORY", "WRITE"] and f[5] == where
               for f in (line.split() for line in table.splitlines()) if len(f) >= 6)


def _held_by_flock(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def ensure_embedded(runtime_dir: str | Path, timeout_s: float = 20.0, idle_s: float = 600.0) -> str:
    """The URL of this host's embedded index server, starting it when no server process lives.

    A server that lives but does not answer (yet, or under load) is not replaced: callers' index
    calls fail (a miss) until it does."""
    restart_embedded(runtime_dir, None, timeout_s=timeout_s, idle_s=idle_s)
    return embedded_url(runtime_dir)


def restart_embedded(runtime_dir: str | Path, reason: str | None, *, timeout_s: float = 20.0,
                     idle_s: float = 600.0) -> bool:
    """Start the embedded server unless a server process of ``runtime_dir`` lives; ``True`` when
    this call started it. ``reason``: why the caller thinks the server died (``None``: a first
    start); a start that follows a dead server is logged and recorded in ``embedded.restarts``.

    Raises ``RuntimeError`` when the new supervisor exits before its server runs."""
    rt = private_dir(runtime_dir)
    if embedded_alive(rt):
        return False
    with open(rt / START_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # one starter per host; the others wait and reuse
        if embedded_alive(rt):
            return False
        if ping(embedded_url(rt)):
            return False           # a server that holds no lock (started by hand, or by an older pof): keep it
        # A socket without a live server is what a server that died (not one stopped) leaves.
        died = reason is not None or (rt / SOCKET).exists()
        child = _spawn(rt, idle_s)
        _await_start(rt, child, timeout_s)
        if died:
            why = reason or "a stale socket: the previous server died"
            log.warning("pof: the embedded index server had died (%s); started a new one (PID %d), every node "
                        "re-publishes its pages", why, child.pid)
            with open(rt / RESTARTS, "a") as f:
                f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} {why}\n")
        else:
            log.info("pof: started the embedded index server at %s", embedded_url(rt))
        return True


def restarts(runtime_dir: str | Path) -> list[str]:
    """Recorded restarts of ``runtime_dir``'s server after it died, oldest first (time, reason)."""
    try:
        return (Path(runtime_dir) / RESTARTS).read_text().splitlines()
    except FileNotFoundError:
        return []


def _spawn(rt: Path, idle_s: float) -> subprocess.Popen[bytes]:
    with open(rt / "embedded.log", "ab") as logfile:
        return subprocess.Popen(
            [sys.executable, "-m", "pof_connector.index.embedded", "--runtime-dir", str(rt),
             "--idle-s", str(idle_s)],
            stdin=subprocess.DEVNULL, stdout=logfile, stderr=logfile, start_new_session=True,
        )


def _await_start(rt: Path, child: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Return once the new supervisor holds ``embedded.live`` (so the start lock may go) and,
    within ``timeout_s``, its server answers; raise when the supervisor exits first."""
    url = embedded_url(rt)
    deadline = time.monotonic() + timeout_s
    while True:
        code = child.poll()
        if code is not None:
            raise RuntimeError(f"the embedded index supervisor exited with {code}; see {rt / 'embedded.log'}")
        if embedded_alive(rt) and ping(url):
            return
        if time.monotonic() > deadline and embedded_alive(rt):
            log.warning("pof: the embedded index server at %s runs but did not answer within %.0fs (a busy "
                        "host?); calls miss until it does", url, timeout_s)
            return
        time.sleep(0.05)


def stop_embedded(runtime_dir: str | Path) -> bool:
    """Stop this host's embedded server by the PIDs in its pidfile; ``False`` when none ran.

    A PID is signalled only when it is still ours: the supervisor (its command line names pof) or
    the server (its command line names this directory's socket); a stale pidfile's PID may
    belong to an unrelated process by now. The supervisor goes first (it stops its server); the
    server is signalled itself only when it outlived a killed supervisor.
    """
    from pof_connector.index.server import kill_pid

    rt = Path(runtime_dir)
    try:
        pids = [int(p) for p in (rt / PIDFILE).read_text().split()]
    except (FileNotFoundError, ValueError):
        return False
    marks = (b"pof", str(rt / SOCKET).encode())
    stopped = False
    for pid, mark in zip(pids, marks, strict=False):     # a pidfile written before the server ran has one
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if mark in cmdline:        # `python -m pof_connector.index.embedded` / `pof index serve`; the server
            kill_pid(pid)
            stopped = True
    return stopped


def write_pids(pidfile: Path, *pids: int) -> None:
    """Replace ``pidfile`` atomically: a reader (``stop_embedded``) never sees it half written,
    empty, between the truncation and the write."""
    tmp = pidfile.with_name(f"{pidfile.name}.{os.getpid()}.tmp")
    tmp.write_text(" ".join(map(str, pids)) + "\n")
    os.replace(tmp, pidfile)


def take_live_lock(runtime_dir: Path, wait_s: float = TAKE_LIVE_LOCK_S) -> IO[bytes] | None:
    """The open, exclusively locked ``embedded.live``; ``None`` when another server process holds it.
    Keep it open for as long as the server runs (and hand it to the server process)."""
    f = open(runtime_dir / LIVE_LOCK, "ab")  # noqa: SIM115 - held for the supervisor's life
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return f
        except BlockingIOError:
            if time.monotonic() > deadline:
                f.close()
                return None
            time.sleep(0.01)


def supervise(runtime_dir: Path, idle_s: float) -> int:
    """Run the server until SIGTERM/SIGINT, until no client was connected for ``idle_s``, until
    the server exits, or until its socket disappears (somebody removed the runtime directory).
    Returns 2 without starting anything when another server process of ``runtime_dir`` lives."""
    unpin()      # the engine worker that started this supervisor may be bound to its cores
    live = take_live_lock(runtime_dir)
    if live is None:
        print("another embedded index server lives in this runtime directory: not starting", file=sys.stderr)
        return 2
    pidfile = runtime_dir / PIDFILE
    write_pids(pidfile, os.getpid())               # stoppable before the server answers
    stop = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    # The server inherits the locked file: were this supervisor killed, its server still holds
    # the lock while it runs, and nobody starts a second one next to it.
    server = RedisServer(runtime_dir).start(pass_fds=(live.fileno(),))
    assert server.proc is not None
    unpin_process(server.proc.pid)
    write_pids(pidfile, os.getpid(), server.proc.pid)
    watch = redis.Redis.from_url(server.url, socket_timeout=2)
    idle_since = time.monotonic()
    code = 0
    try:
        while not stop:
            try:
                server.proc.wait(timeout=1.0)      # returns at once when the server dies
            except subprocess.TimeoutExpired:
                pass
            if server.proc.poll() is not None:
                print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} index server exited ({server.proc.returncode}): the next "
                      f"pool heartbeat starts a new one", file=sys.stderr, flush=True)
                code = 1
                break
            if not server.socket.exists():
                print("socket removed: stopping", file=sys.stderr)
                break
            try:
                clients = int(watch.info("clients")["connected_clients"]) - 1   # minus this watcher
            except redis.TimeoutError:
                clients = 1        # frozen or busy, not idle: a slow server is not stopped for it
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
        live.close()               # after the server is gone: only then may another start
    return code


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="pof embedded index supervisor")
    ap.add_argument("--runtime-dir", required=True)
    ap.add_argument("--idle-s", type=float, default=600.0)
    a = ap.parse_args(argv)
    return supervise(Path(a.runtime_dir), a.idle_s)


if __name__ == "__main__":
    sys.exit(main())
