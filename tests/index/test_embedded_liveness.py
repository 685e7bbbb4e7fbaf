"""The embedded index never splits: a slow or frozen server is not replaced, a dead one is
replaced exactly once, and the books are whole afterwards (issue 13).

Real parts throughout: pool node processes (tests/index/embedded_node.py) on ``index_url:
embedded``, the real supervisor and server, busy processes that saturate the CPUs, the locality
API as ``pof index api``. A watcher samples /proc every 0.1 s for the server processes of the
test's runtime directory. Every process a test starts is stopped by its PID.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from pof_connector.cli import main
from pof_connector.index.embedded import embedded_url, stop_embedded
from pof_connector.index.redis import RedisIndex
from pof_connector.index.server import kill_pid, ping
from tests.index.embedded_node import CHAIN_PAGES, MODEL, SPEC, chain_keys, chain_tokens, node_id

REPO = Path(__file__).resolve().parents[2]
LOAD_S = float(os.environ.get("POF_TEST_SATURATION_S", "60"))
"""How long the saturation test keeps both CPUs busy (the issue asks for a minute)."""
SATURATED_TIMEOUT_S = 0.1
"""The pools' index call timeout in the saturation test (``index_timeout_s``): short, as engines
want it, so that the stalls below make calls time out often."""
BUSY_PER_CPU = 2
STALL_S, STALL_EVERY_S = 1.5, 5.0
"""During the saturation the server is also stalled (SIGSTOP) for STALL_S every STALL_EVERY_S: on
this host busy processes alone delay it by milliseconds (a 20 ms timeout fired 3 times in 20 s),
while the incident's engine starved it past the 1 s timeout; the stalls make it slow for sure,
and long enough that the old code's liveness ping (0.5 s, twice) failed too and it started a
second server."""
FREEZE_S = 6.0
"""Longer than the 1 s command timeout, and than the 3-4 s the old code took to start a second
server next to a frozen one."""

pytestmark = pytest.mark.slow


def server_pids(runtime_dir: Path) -> set[int]:
    """Processes running a Redis-protocol server on ``runtime_dir``'s embedded socket (the server
    names its socket in its process title, or in its arguments before it sets the title)."""
    sock = str(runtime_dir / "index.sock").encode()
    out = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            comm = Path(entry.path, "comm").read_text().strip()
            cmdline = Path(entry.path, "cmdline").read_bytes()
        except OSError:
            continue
        if comm in ("valkey-server", "redis-server") and sock in cmdline:
            out.add(int(entry.name))
    return out


class ServerWatch(threading.Thread):
    """Samples the server processes every 0.1 s: how many ran at once at most, and which ran."""

    def __init__(self, runtime_dir: Path) -> None:
        super().__init__(daemon=True)
        self.runtime_dir = runtime_dir
        self.most_at_once = 0
        self.seen: list[int] = []           # in order of appearance
        self.samples = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            pids = server_pids(self.runtime_dir)
            self.most_at_once = max(self.most_at_once, len(pids))
            self.seen += sorted(pids - set(self.seen))
            self.samples += 1
            self._halt.wait(0.1)

    def stop(self) -> None:
        self._halt.set()
        self.join()


class Staller(threading.Thread):
    """SIGSTOPs ``pid`` for :data:`STALL_S` every :data:`STALL_EVERY_S` until stopped."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.stalls = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(STALL_EVERY_S - STALL_S):
            os.kill(self.pid, signal.SIGSTOP)
            try:
                self.stalls += 1
                time.sleep(STALL_S)
            finally:
                os.kill(self.pid, signal.SIGCONT)

    def stop(self) -> None:
        self._halt.set()
        self.join()


class Cluster:
    """Pool node processes sharing one runtime directory's embedded index."""

    def __init__(self, runtime_dir: Path) -> None:
        self.rt = runtime_dir
        self.url = embedded_url(runtime_dir)
        self.nodes: list[subprocess.Popen[bytes]] = []
        self.others: list[subprocess.Popen[bytes]] = []
        self.watch = ServerWatch(runtime_dir)
        self.watch.start()

    def start_nodes(self, n: int, index_timeout_s: float = 1.0) -> None:
        for i in range(n):
            self.nodes.append(subprocess.Popen(
                [sys.executable, "-m", "tests.index.embedded_node", str(self.rt), str(i), str(n), str(index_timeout_s)],
                cwd=REPO,
                stdin=subprocess.DEVNULL))
        reader = self.reader()
        try:
            want = {node_id(i) for i in range(n)}
            deadline = time.monotonic() + 60
            while not want <= self._live(reader):
                assert time.monotonic() < deadline, "the nodes did not register"
                assert all(p.poll() is None for p in self.nodes), "a node process exited"
                time.sleep(0.1)
        finally:
            reader.close()

    def reader(self) -> RedisIndex:
        return RedisIndex(self.url, None, timeout_s=5.0)

    @staticmethod
    def _live(reader: RedisIndex) -> set[str]:
        try:
            return {n.node_id for n in reader.nodes()}
        except Exception:         # not up yet
            return set()

    def start(self, args: list[str]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(args, cwd=REPO, stdin=subprocess.DEVNULL)
        self.others.append(proc)
        return proc

    def stop_storing(self) -> list[dict[str, Any]]:
        """Tell the nodes to stop storing; what each stored and counted (``done-<node>.json``)."""
        (self.rt / "stop-store").touch()
        deadline = time.monotonic() + 60
        files = [self.rt / f"done-{node_id(i)}.json" for i in range(len(self.nodes))]
        while not all(f.exists() for f in files):
            assert time.monotonic() < deadline, "the nodes did not stop storing"
            time.sleep(0.1)
        time.sleep(0.1)           # written whole
        return [json.loads(f.read_text()) for f in files]

    def missing(self, done: list[dict[str, Any]]) -> list[tuple[str, int]]:
        """(node, chain) of every stored chain the index does not hold whole for its node."""
        reader = self.reader()
        try:
            out = []
            for i, d in enumerate(done):
                for c in range(d["chains"]):
                    got = reader.longest_prefix(chain_keys(i, c)).get(node_id(i))
                    if got is None or got.pages != CHAIN_PAGES:
                        out.append((node_id(i), c))
            return out
        finally:
            reader.close()

    def books_whole(self, done: list[dict[str, Any]], timeout_s: float = 30.0) -> float:
        """Seconds until every chain each node stored is found in the index (asserts it is)."""
        t0 = time.monotonic()
        while True:
            try:
                gone = self.missing(done)
            except Exception as e:    # the index not answering (yet) is "not whole yet"
                gone = [("index", repr(e))]  # type: ignore[list-item]
            if not gone:
                return time.monotonic() - t0
            assert time.monotonic() - t0 < timeout_s, f"{len(gone)} chains lost, e.g. {gone[:5]}"
            time.sleep(0.2)

    def finish(self) -> list[dict[str, float]]:
        """SIGTERM the nodes by PID; their pools' final counters."""
        for p in self.nodes:
            p.send_signal(signal.SIGTERM)
        for p in self.nodes:
            assert p.wait(timeout=30) == 0
        return [json.loads((self.rt / f"final-{node_id(i)}.json").read_text()) for i in range(len(self.nodes))]

    def close(self) -> None:
        for p in self.others + self.nodes:
            if p.poll() is None:
                kill_pid(p.pid)
                p.wait()
        self.watch.stop()
        stop_embedded(self.rt)
        for pid in server_pids(self.rt):      # one the supervisor left behind (a failing test)
            os.kill(pid, signal.SIGCONT)
            kill_pid(pid)


@contextmanager
def cluster(runtime_dir: str) -> Iterator[Cluster]:
    c = Cluster(Path(runtime_dir))
    try:
        yield c
    finally:
        c.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def locality(port: int, tokens: list[int]) -> dict[str, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/locality", method="POST",
                                 data=json.dumps({"model": MODEL, "tokens": tokens}).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        answer: dict[str, Any] = json.loads(r.read())
        return answer


def summed(counts: list[dict[str, Any]], name: str) -> int:
    return int(sum(c[name] for c in counts))


def test_saturated_cpus_keep_one_server_and_whole_books(runtime_dir: str) -> None:
    """Both CPUs busy for a minute, the server stalled now and then, while three pool processes
    publish and look up: one server throughout, every page published found afterwards, the
    locality API answering throughout."""
    nodes = 3
    with cluster(runtime_dir) as c:
        c.start_nodes(nodes, SATURATED_TIMEOUT_S)
        port = free_port()
        c.start([sys.executable, "-m", "pof_connector.cli", "index", "api", "--url", c.url, "--http-port", str(port)])
        deadline = time.monotonic() + 30
        while True:
            try:
                locality(port, chain_tokens(0, 0))
                break
            except OSError:
                assert time.monotonic() < deadline, "the locality API did not come up"
                time.sleep(0.2)
        (server,) = server_pids(c.rt)
        spin = [sys.executable, "-c", "while True: pass"]
        busy = [c.start(spin) for _ in range(BUSY_PER_CPU * (os.cpu_count() or 2))]
        stalls = Staller(server)
        stalls.start()
        answers: list[tuple[float, str | set[str]]] = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < LOAD_S:
            n = len(answers)
            sent = time.monotonic()
            try:
                got = locality(port, chain_tokens(n % nodes, 0))
                whole = {x["node_id"] for x in got["nodes"] if x["matched_tokens"] == CHAIN_PAGES * SPEC.page_tokens}
                answers.append((time.monotonic() - sent, whole))
            except urllib.error.HTTPError as e:
                answers.append((time.monotonic() - sent, f"{e.code} {e.headers.get('x-pof-reason')}"))
            except OSError as e:
                answers.append((time.monotonic() - sent, f"{type(e).__name__}: {e}"))
            time.sleep(0.5)
        stalls.stop()
        for p in busy:
            kill_pid(p.pid)
            p.wait()
        done = c.stop_storing()
        whole_after_s = c.books_whole(done)
        final = c.finish()
        c.watch.stop()
    # During a stall the API may answer 503 saying it has no index (x-pof-reason): honest, not wrong.
    honest = [a for a in answers if isinstance(a[1], str) and a[1].startswith("503 fallback:Index")]
    failed = [a for a in answers if not isinstance(a[1], set) and a not in honest]
    wrong = [(i, a) for i, a in enumerate(answers) if isinstance(a[1], set) and node_id(i % nodes) not in a[1]]
    print(f"\nsaturation {LOAD_S:.0f}s with {len(busy)} busy processes and {stalls.stalls} stalls: servers seen "
          f"{c.watch.seen} (most at once {c.watch.most_at_once}, {c.watch.samples} samples); chains "
          f"{[d['chains'] for d in done]}; lookups found {summed(done, 'found')}/{summed(done, 'lookups')}; index "
          f"timeouts {summed(final, 'index_timeouts')}, errors {summed(final, 'index_errors')}, restarts "
          f"{summed(final, 'index_restarts')}; API answers {len(answers)}, slowest {max(a[0] for a in answers):.2f}s, "
          f"503 without the index {len(honest)}, failed {len(failed)}, without the asked node {len(wrong)}; "
          f"books whole {whole_after_s:.1f}s after the load")
    assert c.watch.most_at_once == 1 and len(c.watch.seen) == 1, c.watch.seen
    assert summed(final, "index_restarts") == 0
    assert summed(final, "index_timeouts") > 0        # it was slow, and that was counted
    assert not failed, failed[:3]
    assert not wrong, wrong[:3]
    assert len(honest) < len(answers) / 2


def test_killed_server_is_replaced_once_and_nodes_republish(runtime_dir: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """SIGKILL the server: exactly one new one comes up (three pools race to restart it), every
    node re-publishes, lookups hit again, and the restart is counted and recorded."""
    with cluster(runtime_dir) as c:
        c.start_nodes(3)
        time.sleep(2)
        (old,) = server_pids(c.rt)
        os.kill(old, signal.SIGKILL)
        killed = time.monotonic()
        while not (server_pids(c.rt) - {old}) or not ping(c.url):
            assert time.monotonic() - killed < 30, "no new server came up"
            time.sleep(0.05)
        restart_s = time.monotonic() - killed
        time.sleep(2)             # the nodes go on storing into the new server
        config = c.rt / "pof.yaml"
        config.write_text(f"runtime_dir: {c.rt}\n")
        assert main(["stats", "--json", "--config", str(config)]) == 0
        stats = json.loads(capsys.readouterr().out)
        done = c.stop_storing()
        whole_s = c.books_whole(done)
        final = c.finish()
        c.watch.stop()
        recorded = (c.rt / "embedded.restarts").read_text().splitlines() \
            if (c.rt / "embedded.restarts").exists() else []
    print(f"\nSIGKILL: new server answering {restart_s:.2f}s after the kill; books whole {whole_s:.1f}s after the "
          f"nodes stopped storing; chains {[d['chains'] for d in done]}; servers seen {c.watch.seen}; restarts "
          f"counted {summed(final, 'index_restarts')}; recorded {recorded}")
    assert len(c.watch.seen) == 2 and c.watch.most_at_once == 1, c.watch.seen
    assert summed(final, "index_restarts") == 1
    assert len(recorded) == 1 and "no index server process runs" in recorded[0]
    assert stats["totals"]["restarts"] == 1 and stats["totals"]["nodes"] == 3     # pof stats shows it
    assert summed(done, "found") > 0


def test_frozen_server_is_not_replaced_and_books_are_whole(runtime_dir: str) -> None:
    """SIGSTOP the server for longer than the command timeout while the nodes store, then
    SIGCONT: the same single server throughout, and every chain stored meanwhile is found."""
    with cluster(runtime_dir) as c:
        c.start_nodes(2)
        time.sleep(2)
        (server,) = server_pids(c.rt)
        os.kill(server, signal.SIGSTOP)
        try:
            time.sleep(FREEZE_S)
            during = server_pids(c.rt)
        finally:
            os.kill(server, signal.SIGCONT)
        time.sleep(2)
        done = c.stop_storing()
        whole_s = c.books_whole(done)
        final = c.finish()
        c.watch.stop()
    print(f"\nSIGSTOP {FREEZE_S:.0f}s: servers seen {c.watch.seen}; index timeouts {summed(final, 'index_timeouts')}, "
          f"errors {summed(final, 'index_errors')}, restarts {summed(final, 'index_restarts')}; chains "
          f"{[d['chains'] for d in done]}; books whole {whole_s:.1f}s after the nodes stopped storing")
    assert during == {server}
    assert c.watch.seen == [server] and c.watch.most_at_once == 1
    assert summed(final, "index_timeouts") > 0        # the freeze was felt, and counted
    assert summed(final, "index_restarts") == 0
