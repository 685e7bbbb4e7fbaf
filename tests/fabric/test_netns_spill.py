"""Must-show 1 of the fabric: three hosts on one machine — A, B and memory node M in three network
namespaces, each with a veth link to a bridge in a fourth namespace.

UCX runs over TCP on each host's veth device (``fabric.ucx_devices``); the index is a
Redis-protocol server on a unix socket, which every namespace reaches (unix sockets are not
network-namespaced). Pages stored on A are read by B byte-exact; B's evicted pages spill into
slots M (a ``pof memd`` process) grants and are read back by A byte-exact. The link counters
show the bytes crossed the veth links. Namespaces and processes are removed at the end, also on
failure.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pof_connector.bench.netns import ip, remove_namespaces
from pof_connector.cli import main
from pof_connector.fabric import nixl_installed
from pof_connector.index.server import RedisServer
from pof_connector.tiers.base import slot_bytes_for
from tests.fabric.harness import MemdProc, NodeProc, node_config, wait_for
from tests.fabric.node_proc import SPEC

pytestmark = [pytest.mark.nixl, pytest.mark.slow,
              pytest.mark.skipif(not nixl_installed(),
                                 reason="NIXL is not installed (pip install --no-deps nixl-cu13==1.5.1)")]

SLOT = slot_bytes_for(SPEC)


def link_bytes(ns: str, dev: str) -> tuple[int, int]:
    """(sent, received) bytes of ``dev`` in ``ns``."""
    (link,) = json.loads(ip("-n", ns, "-j", "-s", "link", "show", dev))
    return int(link["stats64"]["tx"]["bytes"]), int(link["stats64"]["rx"]["bytes"])


@pytest.fixture
def three_hosts() -> Iterator[dict[str, tuple[str, str]]]:
    """{"a"|"b"|"m": (namespace, veth device)}, all on one bridge (10.79.N.1-3/24)."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_SYS_ADMIN, CAP_NET_ADMIN)")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed")
    tag = os.getpid() % 100000
    bridge = f"pofS{tag}"
    hosts = {h: (f"pof{h.upper()}s{tag}", f"v{h.upper()}s{tag}") for h in ("a", "b", "m")}
    created: list[str] = []
    try:
        ip("netns", "add", bridge)
        created.append(bridge)
        ip("-n", bridge, "link", "set", "lo", "up")
        ip("-n", bridge, "link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0")
        ip("-n", bridge, "link", "set", "br0", "up")
        for i, (ns, dev) in enumerate(hosts.values(), start=1):
            ip("netns", "add", ns)
            created.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
            # Both ends are created inside the namespaces: the host's own interfaces are never touched.
            port = f"p{i}s{tag}"
            ip("-n", ns, "link", "add", dev, "type", "veth", "peer", "name", port, "netns", bridge)
            ip("-n", bridge, "link", "set", port, "master", "br0")
            ip("-n", bridge, "link", "set", port, "up")
            ip("-n", ns, "addr", "add", f"10.79.{tag % 250}.{i}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
        yield hosts
    finally:
        remove_namespaces(list(reversed(created)))


def test_three_hosts_read_and_spill_to_memory_node(redis_server: RedisServer, runtime_dir: str,
                                                   three_hosts: dict[str, tuple[str, str]],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    (ns_a, dev_a), (ns_b, dev_b), (ns_m, dev_m) = (three_hosts[h] for h in ("a", "b", "m"))
    procs: list[NodeProc | MemdProc] = []
    try:
        m = MemdProc(node_config("m", redis_server.url, runtime_dir, ucx_devices=dev_m, dram=str(64 * SLOT)),
                     Path(runtime_dir) / "m.json", SLOT, ("ip", "netns", "exec", ns_m))
        procs.append(m)
        a = NodeProc(node_config("a", redis_server.url, runtime_dir, ucx_devices=dev_a), ("ip", "netns", "exec", ns_a))
        procs.append(a)
        b = NodeProc(node_config("b", redis_server.url, runtime_dir, ucx_devices=dev_b, spill=True,
                                 dram=str(4 * SLOT)), ("ip", "netns", "exec", ns_b))
        procs.append(b)

        # Pages stored on A are read by B byte-exact, over the veth links.
        assert a.call("store", seed=5, pages=4) == {"stored": 4}
        wait_for(lambda: b.call("lookup", seed=5, pages=4)["nodes"] == ["a"], what="B finds A's pages")
        sent = link_bytes(ns_a, dev_a)[0]
        r = b.call("load", seed=5, pages=4)
        assert r["pages"] == 4 and r["failed"] == {} and r["exact"], r
        assert link_bytes(ns_a, dev_a)[0] - sent >= 4 * SPEC.page_bytes

        # B's spill lands on M: chain 1 leaves B's only tier when chain 2 comes.
        wait_for(lambda: "m" in {n["node_id"] for n in _stats(redis_server.url, capsys)["nodes"]}, 30,
                 "M's registration")
        received = link_bytes(ns_m, dev_m)[1]
        assert b.call("store", seed=1, pages=4) == {"stored": 4}
        assert b.call("store", seed=2, pages=4) == {"stored": 4}
        assert b.call("stats")["stats"].get("spilled_pages") == 4
        assert link_bytes(ns_m, dev_m)[1] - received >= 4 * SPEC.page_bytes

        # ... and A reads it back from M, byte-exact.
        wait_for(lambda: a.call("lookup", seed=1, pages=4)["nodes"] == ["m"], what="A finds chain 1 on M")
        sent = link_bytes(ns_m, dev_m)[0]
        r = a.call("load", seed=1, pages=4)
        assert r["pages"] == 4 and r["failed"] == {} and r["exact"], r
        assert link_bytes(ns_m, dev_m)[0] - sent >= 4 * SPEC.page_bytes

        # pof stats shows the memory node's occupancy (once M's heartbeat has reported the leases).
        def m_in_stats() -> dict[str, Any]:
            (node,) = [n for n in _stats(redis_server.url, capsys)["nodes"] if n["node_id"] == "m"]
            return node
        wait_for(lambda: m_in_stats()["tiers"]["cpu_dram"]["lent_slots"] >= 4, 5, "M's report of the leases")
        node_m = m_in_stats()
        assert node_m["role"] == "memory" and node_m["tiers"]["cpu_dram"]["lent_slots"] >= 4, node_m
        assert node_m["tiers"]["cpu_dram"]["lease_writers"] == 1
    finally:
        for p in reversed(procs):
            p.close()
    assert m.proc.returncode == 0 and "pof memd: node m stopped" in m.log()     # SIGTERM: a clean stop


def _stats(url: str, capsys: pytest.CaptureFixture[str]) -> dict[str, list[dict[str, object]]]:
    capsys.readouterr()
    assert main(["stats", "--url", url, "--json"]) == 0
    out: dict[str, list[dict[str, object]]] = json.loads(capsys.readouterr().out)
    return out
