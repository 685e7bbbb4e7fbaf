"""The Locator over a real Redis-protocol index and real pool nodes: held, usable (shared tiers
count, private ones of other nodes do not) and engine residency published under `<node>:engine`."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from pof_connector.config import PofConfig
from pof_connector.fabric.meta import PeerMeta, Region
from pof_connector.index import Location, NodeInfo
from pof_connector.index.redis import RedisIndex
from pof_connector.index.server import RedisServer
from pof_connector.locality.locator import Locator, ModelRequired, UnknownModel
from pof_connector.pool import Pool
from tests.locality.test_api import NS, SPEC, node

SEG = [np.zeros(512, np.uint8)] * 2


@pytest.fixture
def cluster(redis_server: RedisServer, runtime_dir: str, shm_path: str) -> Iterator[dict[str, Any]]:
    cxl = {"path": shm_path, "size": "1MiB", "partitions": 2}
    a = node("a", redis_server.url, runtime_dir)                              # private DRAM only
    b = node("b", redis_server.url, runtime_dir, cxl=cxl)                     # b and c share one CXL region
    c = node("c", redis_server.url, runtime_dir, cxl=cxl, cpu_dram={"size": "1MiB"})
    tokens = list(range(2000, 2000 + 16 * 8))
    keys = a.keys_for(tokens)
    a.store([(k, SEG) for k in keys[:6]]).result()
    b.store([(k, SEG) for k in keys[:3]]).result()
    c.store([(k, SEG) for k in keys[:4]]).result()
    reader = RedisIndex(redis_server.url, None)
    deadline = time.monotonic() + 5
    while len(reader.longest_prefix(keys)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    yield {"tokens": tokens, "keys": keys, "index": reader, "url": redis_server.url, "pools": (a, b, c)}
    for p in (a, b, c):
        p.close()
    reader.close()


def test_held_and_usable_per_node(cluster: dict[str, Any]) -> None:
    found = Locator(cluster["index"]).locate(cluster["tokens"])
    assert found.model == "org/model-a" and found.page_tokens == 16 and set(found.nodes) == {"a", "b", "c"}
    a, b, c = (found.nodes[n] for n in "abc")
    assert a.held == {"cpu_dram": 96} and a.usable == {"cpu_dram": 96}      # a reads nobody else's memory
    # b reads its own pages 0-2, then page 3 from c's partition of the shared region
    assert b.held == {"cxl": 48} and b.usable == {"cxl": 64}
    assert c.held == {"cxl": 64} and c.usable == {"cxl": 64}
    assert a.engine_tokens == b.engine_tokens == 0
    # the prompt's page digests as the pools key them: what the router matches its requests in
    # flight by; a tenant's salt gives other pages
    assert found.chain == tuple(k.digest for k in cluster["keys"])
    salted = Locator(cluster["index"]).locate(cluster["tokens"], cache_salt="tenant-b")
    assert len(salted.chain) == 8 and not set(salted.chain) & set(found.chain)


def test_engine_residency_merges_into_its_node(cluster: dict[str, Any]) -> None:
    a_meta = next(n.meta for n in cluster["index"].nodes() if n.node_id == "a")
    engine = RedisIndex(cluster["url"], "a:engine")
    try:
        engine.heartbeat(NodeInfo("a:engine", {}, {**a_meta, "engine_of": "a"}), ttl_s=5.0)
        engine.publish([(k, Location("a:engine", "engine", 0, 0)) for k in cluster["keys"][:7]])
        found = Locator(cluster["index"]).locate(cluster["tokens"])
        assert set(found.nodes) == {"a", "b", "c"}                # the engine is not a node of its own
        assert found.nodes["a"].engine_tokens == 112 and found.nodes["b"].engine_tokens == 0
        assert found.nodes["a"].usable == {"cpu_dram": 96}        # engine pages are never loadable
        # and pools never take an engine location as a source
        lookup = cluster["pools"][1].lookup(cluster["keys"])
        assert {loc.medium for loc in lookup.sources} == {"cxl"} and len(lookup.sources) == 4
        assert "a:engine" not in {loc.node for loc in lookup.sources}
    finally:
        engine.leave()
        engine.close()


def test_model_errors(cluster: dict[str, Any]) -> None:
    loc = Locator(cluster["index"])
    with pytest.raises(UnknownModel, match="org/model-a"):
        loc.locate([1, 2, 3], model="other")
    assert loc.pick_model(None) == "org/model-a"
    for p in cluster["pools"]:
        p.close()
    with pytest.raises(ModelRequired, match="no model yet"):
        Locator(cluster["index"], nodes_ttl_s=0).locate([1])


def fabric_node(name: str, url: str, runtime_dir: str) -> Pool:
    """A pool node that publishes fabric metadata. The meta alone is all the Locator and the relay
    read, so it stands in for a NIXL agent's registration (tests/fabric has real ones)."""
    cfg = PofConfig.from_mapping({"node_id": name, "index_url": url, "runtime_dir": runtime_dir,
                                  "heartbeat_s": 0.1, "node_ttl_s": 2.0, "tiers": {"cpu_dram": {"size": "1MiB"}}})
    region = Region("cpu_dram", 4096, 1 << 20, 1088, 900)
    return Pool(cfg, SPEC, NS, meta={"engine": "test", "model": "org/model-a",
                                     **PeerMeta(f"pof/{name}/1", b"md", {"cpu_dram": region}).to_meta()})


def test_pages_of_other_nodes_over_the_fabric(redis_server: RedisServer, runtime_dir: str) -> None:
    """Nodes that publish fabric metadata load each other's pages as tier ``remote``; a node
    without it reads nobody's, and nobody reads it over the fabric."""
    x, y = fabric_node("x", redis_server.url, runtime_dir), fabric_node("y", redis_server.url, runtime_dir)
    a = node("a", redis_server.url, runtime_dir)                              # no fabric
    reader = RedisIndex(redis_server.url, None)
    try:
        tokens = list(range(3000, 3000 + 16 * 6))
        keys = a.keys_for(tokens)
        x.store([(k, SEG) for k in keys[:1]]).result()
        y.store([(k, SEG) for k in keys[:4]]).result()
        a.store([(k, SEG) for k in keys[:6]]).result()
        deadline = time.monotonic() + 5
        while len(reader.longest_prefix(keys)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        found = Locator(reader).locate(tokens)
        fx, fy, fa = (found.nodes[n] for n in "xya")
        assert fx.usable == {"cpu_dram": 16, "remote": 48} and fx.near_tokens == 16   # own page 0, y's 1-3
        assert fy.usable == {"cpu_dram": 64} and fy.near_tokens == 64                 # a's 4-5: no fabric at a
        assert fa.usable == {"cpu_dram": 96} and fa.near_tokens == 96
    finally:
        for p in (x, y, a):
            p.close()
        reader.close()


def test_a_chain_split_over_nodes_counts_whole(redis_server: RedisServer, runtime_dir: str, shm_path: str) -> None:
    """p holds a prompt's head and q its tail in one shared region (as after a spill): every node
    reading that region can load the whole chain, as its Pool.lookup finds it."""
    cxl = {"path": shm_path, "size": "1MiB", "partitions": 3}
    p, q, r = (node(n, redis_server.url, runtime_dir, cxl=cxl) for n in "pqr")
    reader = RedisIndex(redis_server.url, None)
    try:
        tokens = list(range(4000, 4000 + 16 * 8))
        keys = p.keys_for(tokens)
        p.store([(k, SEG) for k in keys[:3]]).result()
        q.store([(k, SEG) for k in keys[3:6]]).result()
        deadline = time.monotonic() + 5
        while r.lookup(keys).pages < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.lookup(keys).pages == 6
        found = Locator(reader).locate(tokens)
        fp, fq, fr = (found.nodes[n] for n in "pqr")
        assert fp.held == {"cxl": 48} and fq.held == {} and fr.held == {}      # held: from the first page
        assert fp.usable == fq.usable == fr.usable == {"cxl": 96}
        assert fr.near_tokens == 96
    finally:
        for pool in (p, q, r):
            pool.close()
        reader.close()


def test_a_late_node_list_is_answered_while_the_next_is_read_off_the_callers_path(cluster: dict[str, Any]) -> None:
    class Counting:
        """The index, counting its node-list reads and the threads they ran on."""

        def __init__(self, index: RedisIndex) -> None:
            self.index = index
            self.reads: list[str] = []

        def nodes(self) -> list[NodeInfo]:
            self.reads.append(threading.current_thread().name)
            return self.index.nodes()

        def __getattr__(self, name: str) -> Any:
            return getattr(self.index, name)

    index = Counting(cluster["index"])
    loc = Locator(index, nodes_ttl_s=0.2)       # type: ignore[arg-type]
    first = loc.nodes()                          # the first list: read before answering
    assert [n.node_id for n in first] and index.reads == [threading.current_thread().name]
    assert loc.nodes() is first and len(index.reads) == 1          # within the ttl: no read
    time.sleep(0.25)
    assert loc.nodes() is first                  # late: the same list at once ...
    deadline = time.monotonic() + 5
    while loc.nodes() is first:                  # ... and the next one, read on a thread
        assert time.monotonic() < deadline, index.reads
        time.sleep(0.01)
    assert index.reads[1] == "pof-locator-nodes" and len(index.reads) == 2
    assert loc.locate(cluster["tokens"]).nodes["a"].held == {"cpu_dram": 96}
    # past ten ttls (an index unreachable that long, or no one asking): read before answering
    time.sleep(2.1)
    loc.nodes()
    assert index.reads[-1] == threading.current_thread().name and len(index.reads) == 3
    assert loc.nodes(fresh=True) is not None and len(index.reads) == 4
