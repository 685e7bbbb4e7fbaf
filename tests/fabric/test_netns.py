"""Two hosts on one machine: pool nodes in two network namespaces joined by a veth link.

UCX runs over TCP on the veth devices (``fabric.ucx_devices``), the index is a Redis-protocol
server on a unix socket (unix sockets are not network-namespaced, so both nodes reach it). The
namespaces are created by the test and removed at the end, with whatever still runs in them
stopped by PID, also on failure.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator

import pytest

from pof_connector.fabric import nixl_installed
from pof_connector.index.server import RedisServer
from tests.fabric.harness import TIMEOUT_S, NodeProc, node_config, wait_for
from tests.fabric.node_proc import SPEC

pytestmark = [pytest.mark.nixl,
              pytest.mark.skipif(not nixl_installed(),
                                 reason="NIXL is not installed (pip install --no-deps nixl-cu13==1.5.1)")]


def ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10).stdout


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
        for ns in created:
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_remote_reads_across_network_namespaces(redis_server: RedisServer, runtime_dir: str,
                                                two_hosts: list[tuple[str, str]]) -> None:
    (ns_a, dev_a), (ns_b, dev_b) = two_hosts
    nodes: list[NodeProc] = []
    try:
        a = NodeProc(node_config("a", redis_server.url, runtime_dir, ucx_devices=dev_a), ("ip", "netns", "exec", ns_a))
        nodes.append(a)
        b = NodeProc(node_config("b", redis_server.url, runtime_dir, ucx_devices=dev_b), ("ip", "netns", "exec", ns_b))
        nodes.append(b)
        assert a.call("store", seed=1, pages=8) == {"stored": 8}
        wait_for(lambda: b.call("lookup", seed=1, pages=8, save="plan")["nodes"] == ["a"], what="B sees A's pages")
        assert b.call("lookup", seed=1, pages=8, save="plan")["pages"] == 8
        sent = tx_bytes(ns_a, dev_a)
        r = b.call("load", seed=1, pages=8, saved="plan")
        assert r["failed"] == {} and r["exact"], r
        # The pages crossed the veth link (not shared memory between the namespaces).
        assert tx_bytes(ns_a, dev_a) - sent >= 8 * SPEC.page_bytes
        r = b.call("load", seed=1, pages=8, saved="plan", zero_copy=True)
        assert r["failed"] == {} and r["exact"], r
        a.kill()
        r = b.call("load", seed=1, pages=8, saved="plan")
        assert len(r["failed"]) == 8 and set(r["failed"].values()) <= {"remote_error", "peer_down", "timeout"}, r
        assert r["seconds"] < TIMEOUT_S, r
        assert b.call("store", seed=2, pages=2) == {"stored": 2}
        assert b.call("load", seed=2, pages=2)["failed"] == {}
    finally:
        for n in nodes:
            n.close()
