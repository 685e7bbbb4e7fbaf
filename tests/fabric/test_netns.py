"""Two hosts on one machine: pool nodes in two network namespaces joined by a veth link; the
link is also cut and healed while one reads the other.

UCX runs over TCP on the veth devices (``fabric.ucx_devices``), the index is a Redis-protocol
server on a unix socket (unix sockets are not network-namespaced, so both nodes reach it). The
namespaces are created by the test and removed at the end, with whatever still runs in them
stopped by PID, also on failure.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pof_connector.bench.netns import ip, remove_namespaces
from pof_connector.fabric import nixl_installed
from pof_connector.index.server import RedisServer
from tests.fabric.harness import TIMEOUT_S, NodeProc, node_config, wait_for
from tests.fabric.node_proc import SPEC

FAILURES = {"remote_error", "peer_down", "timeout"}
CUT_S = 8.0
"""Long enough for UCX to declare the connection dead (TCP_USER_TIMEOUT 5 s with 1 s keepalives):
B then reconnects while the link is still down (blocked connects must not break the deadline)
and again after it heals."""

pytestmark = [pytest.mark.nixl,
              pytest.mark.skipif(not nixl_installed(),
                                 reason="NIXL is not installed (pip install --no-deps nixl-cu13==1.5.1)")]


def tx_bytes(ns: str, dev: str) -> int:
    (link,) = json.loads(ip("-n", ns, "-j", "-s", "link", "show", dev))
    return int(link["stats64"]["tx"]["bytes"])


@pytest.fixture
def two_hosts() -> Iterator[list[tuple[str, str]]]:
    """[(namespace, veth device)] for hosts A (10.78.N.1) and B (10.78.N.2)."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_SYS_ADMIN, CAP_NET_ADMIN)")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed")
    tag = os.getpid() % 100000
    hosts = [(f"pofA{tag}", f"vA{tag}"), (f"pofB{tag}", f"vB{tag}")]
    created: list[str] = []
    try:
        for ns, _ in hosts:
            ip("netns", "add", ns)
            created.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        # Both ends are created inside the namespaces: the host's own interfaces are never touched.
        (ns_a, dev_a), (ns_b, dev_b) = hosts
        ip("-n", ns_a, "link", "add", dev_a, "type", "veth", "peer", "name", dev_b, "netns", ns_b)
        for i, (ns, dev) in enumerate(hosts, start=1):
            ip("-n", ns, "addr", "add", f"10.78.{tag % 250}.{i}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
        yield hosts
    finally:
        remove_namespaces(created)


def start_pair(redis_url: str, runtime_dir: str, hosts: list[tuple[str, str]],
               nodes: list[NodeProc]) -> tuple[NodeProc, NodeProc]:
    """Nodes a and b, each in its namespace with UCX on its veth (appended to ``nodes`` as they
    start); a stores 8 pages of chain 1, and b's lookup of all 8 on a is saved as "plan"."""
    for name, (ns, dev) in zip("ab", hosts, strict=True):
        nodes.append(NodeProc(node_config(name, redis_url, runtime_dir, ucx_devices=dev), ("ip", "netns", "exec", ns)))
    a, b = nodes[-2], nodes[-1]
    assert a.call("store", seed=1, pages=8) == {"stored": 8}
    wait_for(lambda: b.call("lookup", seed=1, pages=8, save="plan")["nodes"] == ["a"], what="B sees A's pages")
    assert b.call("lookup", seed=1, pages=8, save="plan")["pages"] == 8
    return a, b


def test_remote_reads_across_network_namespaces(redis_server: RedisServer, runtime_dir: str,
                                                two_hosts: list[tuple[str, str]]) -> None:
    ns_a, dev_a = two_hosts[0]
    nodes: list[NodeProc] = []
    try:
        a, b = start_pair(redis_server.url, runtime_dir, two_hosts, nodes)
        sent = tx_bytes(ns_a, dev_a)
        r = b.call("load", seed=1, pages=8, saved="plan")
        assert r["failed"] == {} and r["exact"], r
        # The pages crossed the veth link (not shared memory between the namespaces).
        assert tx_bytes(ns_a, dev_a) - sent >= 8 * SPEC.page_bytes
        r = b.call("load", seed=1, pages=8, saved="plan", zero_copy=True)
        assert r["failed"] == {} and r["exact"], r
        a.kill()
        r = b.call("load", seed=1, pages=8, saved="plan")
        assert len(r["failed"]) == 8 and set(r["failed"].values()) <= FAILURES, r
        assert r["seconds"] < TIMEOUT_S, r
        assert b.call("store", seed=2, pages=2) == {"stored": 2}
        assert b.call("load", seed=2, pages=2)["failed"] == {}
    finally:
        for n in nodes:
            n.close()


def test_a_cut_link_gives_misses_in_time_and_reads_resume_after_it_heals(
        redis_server: RedisServer, runtime_dir: str, two_hosts: list[tuple[str, str]]) -> None:
    """`ip link set ... down` on A's end of the veth while B reads A's pages in a loop: every load
    returns within the deadline with misses or byte-exact pages (never a wrong page), B keeps
    serving its own pages, and once the link is up again B reads A again (reconnecting if UCX
    declared the old connection dead)."""
    ns_a, dev_a = two_hosts[0]
    nodes: list[NodeProc] = []
    try:
        _, b = start_pair(redis_server.url, runtime_dir, two_hosts, nodes)
        assert b.call("load", seed=1, pages=8, saved="plan")["failed"] == {}

        results: list[tuple[float, float, dict[str, Any]]] = []     # (start, end, reply) per load
        stop = threading.Event()

        def read_loop() -> None:
            while not stop.is_set():
                started = time.monotonic()
                reply = b.call("load", seed=1, pages=8, saved="plan", timeout=TIMEOUT_S + 10)
                results.append((started, time.monotonic(), reply))

        reader = threading.Thread(target=read_loop, name="b-reads", daemon=True)
        reader.start()
        time.sleep(0.5)
        cut_at = time.monotonic()
        ip("-n", ns_a, "link", "set", dev_a, "down")          # the cable is pulled mid-stream
        cut_done = time.monotonic()
        time.sleep(CUT_S)
        stop.set()
        reader.join(TIMEOUT_S + 15)
        assert not reader.is_alive(), "B's load loop hung"
        before = [r for _, end, r in results if end < cut_at]
        during = [r for _, end, r in results if end >= cut_at]
        after = [r for start, _, r in results if start > cut_done]
        assert before and all(r["failed"] == {} for r in before), before
        assert after and all(len(r["failed"]) == 8 for r in after), after
        for r in before + during:
            assert r["exact"], r                               # never a wrong page
            assert set(r["failed"].values()) <= FAILURES, r
            assert r["seconds"] < TIMEOUT_S + 0.5, r           # the deadline holds: no hang
        # The first read that met the dead link ran into the deadline (or UCX's error); later
        # ones were refused at once while A is in its back-off.
        assert any({"timeout", "remote_error"} & set(r["failed"].values()) for r in during), during

        # B keeps serving its own pages while A is unreachable.
        assert b.call("store", seed=2, pages=2) == {"stored": 2}
        r = b.call("load", seed=2, pages=2)
        assert r["pages"] == 2 and r["failed"] == {} and r["exact"], r

        # The link heals: B reads A again (after its back-off; a dead connection is replaced).
        ip("-n", ns_a, "link", "set", dev_a, "up")
        healed = time.monotonic()
        last: dict[str, Any] = {}

        def reads_again() -> bool:
            nonlocal last
            last = b.call("load", seed=1, pages=8, saved="plan", timeout=TIMEOUT_S + 10)
            assert last["exact"], last
            return bool(last["failed"] == {})

        wait_for(reads_again, timeout=45, what="B reading A after the link came back")
        assert b.call("peers")["peers"] == ["a"]
        print(f"\nlink cut: {len(during)} loads during the cut, max {max(r['seconds'] for r in during):.2f} s; "
              f"reads resumed {time.monotonic() - healed:.1f} s after the heal; last failures {last['failed']}")
    finally:
        for n in nodes:
            n.close()
