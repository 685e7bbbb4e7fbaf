"""Redis specifics: restart recovery, outage behaviour, the embedded server."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from pof_connector.config import PofConfig
from pof_connector.index import IndexTimeout, IndexUnavailable, Location, NodeIdTaken, NodeInfo
from pof_connector.index.embedded import (
    PIDFILE,
    SOCKET,
    ensure_embedded,
    restart_embedded,
    stop_embedded,
    write_pids,
)
from pof_connector.index.redis import RedisIndex
from pof_connector.index.server import RedisServer, ping
from pof_connector.pages.keys import PageKey, page_keys
from pof_connector.pages.layout import PageSpec
from pof_connector.pool import Pool


def test_restart_owners_republish_and_lookups_recover(runtime_dir: str, namespace: bytes) -> None:
    """Kill the index server, start an empty one on the same socket: the pool's heartbeat sees a
    new registration and re-publishes what it holds."""
    server = RedisServer(Path(runtime_dir) / "r").start()
    spec = PageSpec(2, 1024, 16)
    cfg = PofConfig.from_mapping({"node_id": "a", "index_url": server.url, "heartbeat_s": 0.1,
                                  "node_ttl_s": 1.0, "runtime_dir": runtime_dir,
                                  "tiers": {"cpu_dram": {"size": "1MiB"}}})
    pool = Pool(cfg, spec, namespace)
    reader = RedisIndex(server.url, None)
    try:
        ks = page_keys(namespace, list(range(16 * 8)), 16)
        pool.store([(k, [np.full(1024, i, np.uint8)] * 2) for i, k in enumerate(ks)]).result()
        deadline = time.monotonic() + 5
        while not reader.longest_prefix(ks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reader.longest_prefix(ks)["a"].pages == 8
        server.stop()
        with pytest.raises(IndexUnavailable):
            reader.longest_prefix(ks)
        assert pool.lookup(ks).pages == 8      # own pages need no index
        server.start()
        assert reader.longest_prefix(ks) == {}          # empty after the restart
        deadline = time.monotonic() + 10
        while not reader.longest_prefix(ks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reader.longest_prefix(ks)["a"].pages == 8
        assert pool.stats.get("index_errors") >= 1
    finally:
        reader.close()
        pool.close()
        server.stop()


def test_unreachable_index_raises_index_unavailable_fast(runtime_dir: str, namespace: bytes) -> None:
    idx = RedisIndex(f"unix://{runtime_dir}/nothing.sock", "a", timeout_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(IndexUnavailable):
        idx.heartbeat(NodeInfo("a"), 1)
    with pytest.raises(IndexUnavailable):
        idx.longest_prefix(page_keys(namespace, list(range(16)), 16))
    assert time.monotonic() - t0 < 2


def test_memory_per_location(redis_server: RedisServer, namespace: bytes) -> None:
    a = RedisIndex(redis_server.url, "a")
    a.heartbeat(NodeInfo("a"), 30)
    before = int(a._r.info("memory")["used_memory"])
    ks = page_keys(namespace, np.arange(16 * 20000), 16)
    for s in range(0, len(ks), 5000):
        a.publish([(k, Location("a", "cpu_dram", s + i, 1)) for i, k in enumerate(ks[s:s + 5000])])
    per = (int(a._r.info("memory")["used_memory"]) - before) / len(ks)
    assert per <= 200, f"{per:.0f} bytes per location"
    a.close()


def test_sweep_drops_dead_incarnations(redis_server: RedisServer, namespace: bytes) -> None:
    a = RedisIndex(redis_server.url, "a")
    a.heartbeat(NodeInfo("a"), 0.2)
    ks = page_keys(namespace, list(range(16 * 5)), 16)
    a.publish([(k, Location("a", "cpu_dram", i, 1)) for i, k in enumerate(ks)])
    time.sleep(0.3)
    b = RedisIndex(redis_server.url, "b")
    b.heartbeat(NodeInfo("b"), 10)            # expires a's incarnation in the server's books
    b.publish([(ks[0], Location("b", "cxl", 3, 1))])
    assert b.sweep(namespace) == 5
    assert b.stats()["locations"] == 1
    a.close()
    b.close()


def test_embedded_server_is_shared_and_stopped_by_pid(runtime_dir: str) -> None:
    url = ensure_embedded(runtime_dir, idle_s=60)
    try:
        assert ping(url) and ensure_embedded(runtime_dir) == url     # a second caller reuses it
        pids = [int(p) for p in (Path(runtime_dir) / PIDFILE).read_text().split()]
        assert all(os.path.exists(f"/proc/{p}") for p in pids)
    finally:
        assert stop_embedded(runtime_dir)
    assert not ping(url)
    for p in pids:
        assert not os.path.exists(f"/proc/{p}") or Path(f"/proc/{p}/stat").read_text().split()[2] == "Z"


def test_embedded_supervisor_exits_when_idle(runtime_dir: str) -> None:
    url = ensure_embedded(runtime_dir, idle_s=1)
    pids = [int(p) for p in (Path(runtime_dir) / PIDFILE).read_text().split()]
    deadline = time.monotonic() + 15
    while ping(url) and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        assert not ping(url)
    finally:
        stop_embedded(runtime_dir)
        for p in pids:
            if os.path.exists(f"/proc/{p}"):
                os.kill(p, 9)


@contextlib.contextmanager
def paused_pool(redis_server: RedisServer, runtime_dir: str, namespace: bytes,
                dram: str) -> Iterator[tuple[Pool, RedisIndex, redis.Redis]]:
    """Node "a" with a short index timeout, a reader of the index, and an admin client that can
    pause the server's writes (CLIENT PAUSE ... WRITE)."""
    cfg = PofConfig.from_mapping({"node_id": "a", "index_url": redis_server.url, "heartbeat_s": 0.1,
                                  "node_ttl_s": 5.0, "index_timeout_s": 0.2, "runtime_dir": runtime_dir,
                                  "tiers": {"cpu_dram": {"size": dram}}})
    pool = Pool(cfg, PageSpec(2, 1024, 16), namespace)
    reader = RedisIndex(redis_server.url, None)
    admin = redis.Redis.from_url(redis_server.url)
    try:
        yield pool, reader, admin
    finally:
        admin.close()
        reader.close()
        pool.close()


def test_timed_out_publish_and_withdraw_are_sent_again(redis_server: RedisServer, runtime_dir: str,
                                                       namespace: bytes) -> None:
    """The server pauses writes (CLIENT PAUSE) while the pool stores a chain that evicts another:
    the publish and the withdrawals time out, and a paused client that gives up has its commands
    dropped. Once writes resume, the heartbeat sends both again: the new chain is found, the
    evicted one is no longer claimed by the node."""
    with paused_pool(redis_server, runtime_dir, namespace, "8KiB") as (pool, reader, admin):
        seg = [np.zeros(1024, np.uint8)] * 2
        old, new = page_keys(namespace, list(range(48)), 16), page_keys(namespace, list(range(100, 148)), 16)
        pool.store([(k, seg) for k in old]).result()
        wait_until(lambda: "a" in reader.longest_prefix(old))
        admin.execute_command("CLIENT", "PAUSE", "1500", "WRITE")
        pool.store([(k, seg) for k in new]).result()                  # evicts `old`
        assert pool.stats.get("index_timeouts") >= 1
        wait_until(lambda: "a" in reader.longest_prefix(new), 10)
        wait_until(lambda: "a" not in reader.longest_prefix(old), 5)
        assert pool.lookup(old).pages == 0 and pool.stats.get("index_restarts") == 0


def test_a_timed_out_withdrawal_of_a_corrupt_page_is_sent_again(redis_server: RedisServer, runtime_dir: str,
                                                                 namespace: bytes) -> None:
    """Withdrawals other than evictions (a corrupt page dropped, a lost tier, a lease that ended,
    a lent slot reclaimed) were sent once: one that timed out left the index offering the page to
    every other node, each load then failing. They are now re-sent like evictions."""
    with paused_pool(redis_server, runtime_dir, namespace, "64KiB") as (pool, reader, admin):
        keys = page_keys(namespace, list(range(32)), 16)
        pool.store([(k, [np.full(1024, i, np.uint8)] * 2) for i, k in enumerate(keys)]).result()
        wait_until(lambda: reader.longest_prefix(keys).get("a") is not None)
        tier = pool.tiers[0]
        ref = tier.find(keys[0])
        assert ref is not None
        tier.region[tier.slot_offset(ref.slot) + pool.spec.segment_offset(0)] ^= 1
        admin.execute_command("CLIENT", "PAUSE", "1500", "WRITE")
        sources = pool.lookup(keys).sources
        handle = pool.load(keys, sources, [np.zeros(pool.spec.page_bytes, np.uint8) for _ in keys])
        assert handle.wait(5) and handle.failed == {0: "bad_checksum"}
        assert pool.stats.get("index_timeouts", op="withdraw") >= 1
        wait_until(lambda: reader.longest_prefix(keys).get("a") is None, 10)     # page 0 no longer offered
        assert pool.stats.get("index_restarts") == 0


def wait_until(pred, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_a_frozen_embedded_server_is_not_replaced(runtime_dir: str) -> None:
    """A server that does not answer but whose processes live (here SIGSTOPped) keeps its socket:
    nobody starts a second one behind the same path."""
    url = ensure_embedded(runtime_dir, idle_s=60)
    sock, pidfile = Path(runtime_dir) / SOCKET, Path(runtime_dir) / PIDFILE
    wait_until(lambda: len(pidfile.read_text().split()) == 2)     # the server's PID follows its first answer
    before = (pidfile.read_text(), sock.stat().st_ino)
    server = int(before[0].split()[1])
    try:
        os.kill(server, signal.SIGSTOP)
        try:
            assert not ping(url)
            assert ensure_embedded(runtime_dir) == url
            assert not restart_embedded(runtime_dir, "a test froze it")
            assert (pidfile.read_text(), sock.stat().st_ino) == before
        finally:
            os.kill(server, signal.SIGCONT)
        assert ping(url)
    finally:
        stop_embedded(runtime_dir)
    assert not os.path.exists(Path(runtime_dir) / "embedded.restarts")


def test_racing_starters_start_one_server(runtime_dir: str) -> None:
    code = "import sys; from pof_connector.index.embedded import restart_embedded; " \
           "print(restart_embedded(sys.argv[1], None, idle_s=60))"
    procs = [subprocess.Popen([sys.executable, "-c", code, runtime_dir], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[2]) for _ in range(3)]
    try:
        started = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
        assert started == ["False", "False", "True"]
        assert ping(f"unix://{Path(runtime_dir) / SOCKET}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        stop_embedded(runtime_dir)


def test_a_timeout_is_raised_once_not_retried(redis_server: RedisServer, namespace: bytes) -> None:
    """A slow server costs a caller one timeout, and says it was a timeout (not a dead server)."""
    idx = RedisIndex(redis_server.url, "a", timeout_s=0.3)
    idx.heartbeat(NodeInfo("a"), 10)
    assert redis_server.pid is not None
    os.kill(redis_server.pid, signal.SIGSTOP)
    try:
        for call in (lambda: idx.heartbeat(NodeInfo("a"), 10),
                     lambda: idx.longest_prefix(page_keys(namespace, list(range(16)), 16))):
            t0 = time.monotonic()
            with pytest.raises(IndexTimeout):
                call()
            assert time.monotonic() - t0 < 0.55
    finally:
        os.kill(redis_server.pid, signal.SIGCONT)
        idx.close()


def test_restarts_and_timeouts_are_prometheus_counters() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from pof_connector.metrics import PoolStats, register_prometheus

    stats, registry = PoolStats(), CollectorRegistry()
    register_prometheus(stats, registry)
    stats.add("index_restarts", reason="server_died")
    stats.add("index_timeouts", op="lookup")
    text = generate_latest(registry).decode()
    assert 'pof_index_restarts_total{reason="server_died"} 1.0' in text
    assert 'pof_index_timeouts_total{op="lookup"} 1.0' in text


def test_a_heartbeat_whose_reply_was_lost_is_not_taken_for_another_process(redis_server: RedisServer) -> None:
    """A heartbeat that times out on the client may still have run on the server. If it
    registered a new incarnation (the old one had expired while the host was too busy to renew
    it), the client never saw it; its next heartbeat must recognise that registration as its own,
    not conclude that another process took its node id (it would stop publishing for a TTL).
    Seen in the TP=2 vLLM e2e on a saturated host."""
    a = RedisIndex(redis_server.url, "a")
    try:
        assert a.heartbeat(NodeInfo("a"), 0.2) is True
        time.sleep(0.3)                           # A's registration expires: the host was busy
        lost = RedisIndex(redis_server.url, "a")  # stands in for A's heartbeat whose reply was lost:
        lost._owner = a._owner                    # the same client, as the server sees it
        lost._last_inc = a._last_inc
        lost.heartbeat(NodeInfo("a"), 5.0)        # the server registers a new incarnation for A...
        assert a.heartbeat(NodeInfo("a"), 5.0) is True     # ...which A adopts (and re-publishes)
        assert a.incarnation == lost.incarnation
        other = RedisIndex(redis_server.url, "a")           # a genuinely newer process still wins
        other.heartbeat(NodeInfo("a"), 5.0)
        with pytest.raises(NodeIdTaken):
            a.heartbeat(NodeInfo("a"), 5.0)
        other.close()
    finally:
        a.close()


def test_the_pidfile_is_never_seen_half_written(tmp_path: Path) -> None:
    """The supervisor rewrites its pidfile once its server runs; ``stop_embedded`` reading it at
    that moment must get the old or the new PIDs, never an empty file (it then stopped nothing)."""
    pidfile = tmp_path / PIDFILE
    write_pids(pidfile, 11)
    stop = threading.Event()

    def rewrite() -> None:
        while not stop.is_set():
            write_pids(pidfile, 11, 12)
            write_pids(pidfile, 11)

    writer = threading.Thread(target=rewrite)
    writer.start()
    try:
        reads = [pidfile.read_text().split() for _ in range(20_000)]
    finally:
        stop.set()
        writer.join()
    assert all(r in (["11"], ["11", "12"]) for r in reads)


@pytest.mark.parametrize("decoder", ["native", "numpy"])
def test_hostile_records_end_the_run_and_are_counted(redis_server: RedisServer, namespace: bytes, decoder: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """What a broken or hostile index writer leaves — a value cut short, padded or empty, a medium
    code no build knows, records of an incarnation nobody holds — costs misses, counted through
    ``on_refused``; the lookup never raises. Both decoders of the reply."""
    from pof_connector.index import record_runs
    from pof_connector.index.record_runs import FIELD_BYTES, RECORD
    from pof_connector.index.redis import loc_key

    if decoder == "numpy":
        monkeypatch.setattr(record_runs, "_native", None)
    elif not record_runs.NATIVE:
        pytest.skip("pof_connector._prefix_runs was not built (test_record_runs says whether it must be)")

    a, b = RedisIndex(redis_server.url, "a"), RedisIndex(redis_server.url, "b")
    reader = RedisIndex(redis_server.url, None)
    raw = redis.Redis(unix_socket_path=str(redis_server.socket))
    refused: list[tuple[int, str]] = []
    reader.on_refused = lambda n, why: refused.append((n, why))
    try:
        a.heartbeat(NodeInfo("a"), 10)
        b.heartbeat(NodeInfo("b"), 10)
        # Keys without places: their records are in per-page fields (test_segments.py has the same
        # hostile values in segment records).
        ks = [PageKey(k.namespace, k.digest) for k in page_keys(namespace, list(range(16 * 8)), 16)]
        a.publish([(k, Location("a", "cpu_dram", i, 1)) for i, k in enumerate(ks)])
        b.publish([(k, Location("b", "cxl", 50 + i, 2)) for i, k in enumerate(ks[:4])])
        key, field = loc_key(namespace), [k.digest[:FIELD_BYTES] for k in ks]
        m = reader.longest_prefix(ks)
        assert {n: x.pages for n, x in m.items()} == {"a": 8, "b": 4} and not refused

        good5 = raw.hget(key, field[5])
        assert good5 is not None and len(good5) == RECORD.itemsize
        for bad in (good5 + b"\x00", good5[:-1], b""):          # padded, cut short, empty
            raw.hset(key, field[5], bad)
            refused.clear()
            m = reader.longest_prefix(ks)
            assert {n: x.pages for n, x in m.items()} == {"a": 5, "b": 4}
            assert refused == [(1, "malformed")]
        good0 = raw.hget(key, field[0])
        raw.hset(key, field[0], b"\x01")                          # the first page: nothing at all
        refused.clear()
        assert reader.longest_prefix(ks) == {} and refused == [(1, "malformed")]
        raw.hset(key, field[0], good0)
        raw.hset(key, field[5], good5)

        # b's record of page 2 in a medium code no build knows: b's run ends there, a's goes on.
        recs = np.frombuffer(raw.hget(key, field[2]), dtype=RECORD).copy()
        recs["medium"][recs["inc"] == b.incarnation] = 200
        raw.hset(key, field[2], recs.tobytes())
        # A record of an incarnation that is not live, on every page: ignored.
        ghost = np.zeros(1, dtype=RECORD)
        ghost["inc"], ghost["slot"] = 999, 7
        for f in field:
            raw.hset(key, f, ghost.tobytes() + raw.hget(key, f))
        refused.clear()
        m = reader.longest_prefix(ks)
        assert {n: x.pages for n, x in m.items()} == {"a": 8, "b": 2}
        assert m["a"].location(7) == Location("a", "cpu_dram", 7, 1)
        assert m["b"].location(1) == Location("b", "cxl", 51, 2)
        assert refused == [(1, "unknown_medium")]
        raw.hdel(key, field[3])                                    # a hole, the last page still held
        assert {n: x.pages for n, x in reader.longest_prefix(ks).items()} == {"a": 3, "b": 2}
    finally:
        raw.close()
        for c in (a, b, reader):
            c.close()


def test_many_holders_are_decoded_in_bounded_blocks(redis_server: RedisServer, namespace: bytes,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The numpy decoder takes the holders of the first page a block of rows at a time (memory
    bounded by ``MAX_CELLS``): the runs are those of one block, a page in two media included, and
    those of the native decoder."""
    from pof_connector.index import record_runs

    nodes = [RedisIndex(redis_server.url, f"n{k}") for k in range(5)]
    reader = RedisIndex(redis_server.url, None)
    try:
        ks = page_keys(namespace, list(range(16 * 8)), 16)
        for k, node in enumerate(nodes):
            node.heartbeat(NodeInfo(f"n{k}"), 10)
            node.publish([(key, Location(f"n{k}", "cxl", 10 * k + i, k)) for i, key in enumerate(ks[:8 - k])])
        nodes[2].publish([(ks[1], Location("n2", "cpu_dram", 99, 7))])     # a faster copy of page 1
        nodes[3].withdraw([(ks[2], Location("n3", "cxl", 32, 3))])          # a hole at page 2
        native = reader.longest_prefix(ks)
        monkeypatch.setattr(record_runs, "_native", None)                    # the numpy decoder
        whole = reader.longest_prefix(ks)
        monkeypatch.setattr(record_runs, "MAX_CELLS", 9)                     # one row per block
        blocks = reader.longest_prefix(ks)
        assert {n: m.pages for n, m in whole.items()} == {"n0": 8, "n1": 7, "n2": 6, "n3": 2, "n4": 4}
        for n, m in whole.items():
            for other in (blocks[n], native[n]) if record_runs.NATIVE else (blocks[n],):
                assert [other.location(i) for i in range(other.pages)] == [m.location(i) for i in range(m.pages)]
        assert whole["n2"].location(1) == Location("n2", "cpu_dram", 99, 7)
        assert whole["n2"].location(2) == Location("n2", "cxl", 22, 2)
    finally:
        for c in (*nodes, reader):
            c.close()



def test_a_lapsed_registration_is_counted_and_said_and_its_pages_come_back(
        redis_server: RedisServer, runtime_dir: str, namespace: bytes, caplog: pytest.LogCaptureFixture) -> None:
    """The server takes no writes for longer than ``node_ttl_s`` (CLIENT PAUSE): the node's
    heartbeats time out, its registration lapses and lookups stop returning its pages. The first
    heartbeat that gets through says so (a lapse hides pages: a P/D decode waiting for them may
    give up) and publishes them again."""
    cfg = PofConfig.from_mapping({"node_id": "a", "index_url": redis_server.url, "heartbeat_s": 0.1,
                                  "node_ttl_s": 0.5, "index_timeout_s": 0.2, "runtime_dir": runtime_dir,
                                  "tiers": {"cpu_dram": {"size": "64KiB"}}})
    pool = Pool(cfg, PageSpec(2, 1024, 16), namespace)
    reader = RedisIndex(redis_server.url, None)
    admin = redis.Redis.from_url(redis_server.url)
    try:
        keys = page_keys(namespace, list(range(48)), 16)
        pool.store([(k, [np.zeros(1024, np.uint8)] * 2) for k in keys]).result()
        wait_until(lambda: "a" in reader.longest_prefix(keys))
        assert pool.stats.get("registration_lapses") == 0
        with caplog.at_level(logging.WARNING, logger="pof_connector.pool"):
            admin.execute_command("CLIENT", "PAUSE", "1500", "WRITE")
            wait_until(lambda: "a" not in reader.longest_prefix(keys), 5)      # lapsed: its pages are hidden
            wait_until(lambda: pool.stats.get("registration_lapses") == 1, 10)
        assert "registration had lapsed" in caplog.text, caplog.text
        wait_until(lambda: "a" in reader.longest_prefix(keys), 5)
    finally:
        admin.close()
        reader.close()
        pool.close()
