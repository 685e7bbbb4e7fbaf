"""The locality-index contract, run against the in-process index, a real Redis-protocol server and a
real Redis Cluster (3 masters + 3 replicas)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from pof_connector.index import (
    LocalIndex,
    LocalityIndex,
    LocalTable,
    Location,
    NodeIdTaken,
    NodeInfo,
    PrefixMatch,
    TierUsage,
)
from pof_connector.index.cluster_servers import ClusterServers
from pof_connector.index.reach import Run, gather_runs
from pof_connector.index.redis import RedisIndex
from pof_connector.index.redis_cluster import RedisClusterIndex
from pof_connector.index.server import RedisServer
from pof_connector.pages.keys import PageKey, page_keys

Factory = Callable[[str | None], LocalityIndex]


@pytest.fixture(params=["local", "redis", "cluster"])
def make(request: pytest.FixtureRequest) -> Iterator[Factory]:
    clients: list[LocalityIndex] = []
    if request.param == "local":
        table = LocalTable()

        def factory(node: str | None) -> LocalityIndex:
            clients.append(LocalIndex(node, table))
            return clients[-1]
    elif request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")

        def factory(node: str | None) -> LocalityIndex:
            clients.append(RedisIndex(server.url, node))
            return clients[-1]
    else:
        cluster: ClusterServers = request.getfixturevalue("redis_cluster")

        def factory(node: str | None) -> LocalityIndex:
            clients.append(RedisClusterIndex(cluster.url, node))
            return clients[-1]
    yield factory
    for c in clients:
        c.close()


def keys(namespace: bytes, n: int) -> list[PageKey]:
    return page_keys(namespace, list(range(16 * n)), 16)


def loc(node: str, i: int, medium: str = "cpu_dram", gen: int = 1) -> Location:
    return Location(node, medium, i, gen)


def test_longest_prefix_per_node(make: Factory, namespace: bytes) -> None:
    a, b, reader = make("a"), make("b"), make(None)
    assert a.heartbeat(NodeInfo("a"), 10) is True and b.heartbeat(NodeInfo("b"), 10) is True
    assert a.heartbeat(NodeInfo("a"), 10) is False          # same incarnation
    ks = keys(namespace, 10)
    a.publish([(k, loc("a", i)) for i, k in enumerate(ks[:6])])
    b.publish([(k, loc("b", 100 + i, "cxl", 5)) for i, k in enumerate(ks[:3])])
    b.publish([(ks[4], loc("b", 200))])                      # a hole at page 3: b's run is 3
    m = reader.longest_prefix(ks)
    assert {n: x.pages for n, x in m.items()} == {"a": 6, "b": 3}
    assert m["a"].location(5) == loc("a", 5) and m["b"].location(2) == loc("b", 102, "cxl", 5)
    assert m["b"].per_tier() == {"cxl": 3}
    assert reader.longest_prefix(ks[1:]) == {} or set(reader.longest_prefix(ks[1:])) <= {"a", "b"}
    assert reader.longest_prefix(keys(b"\x01" * 16, 3)) == {}


def test_same_node_two_media_prefers_faster(make: Factory, namespace: bytes) -> None:
    a, reader = make("a"), make(None)
    a.heartbeat(NodeInfo("a"), 10)
    ks = keys(namespace, 4)
    a.publish([(k, loc("a", i, "cxl")) for i, k in enumerate(ks)])
    a.publish([(ks[1], loc("a", 9, "cpu_dram"))])
    m = reader.longest_prefix(ks)["a"]
    assert m.pages == 4 and m.location(1) == loc("a", 9) and m.per_tier() == {"cxl": 3, "cpu_dram": 1}


def test_publish_replaces_and_withdraw_is_exact(make: Factory, namespace: bytes) -> None:
    a, reader = make("a"), make(None)
    a.heartbeat(NodeInfo("a"), 10)
    ks = keys(namespace, 2)
    a.publish([(ks[0], loc("a", 1, gen=1)), (ks[1], loc("a", 2, gen=1))])
    a.publish([(ks[0], loc("a", 7, gen=3))])                 # moved within the same medium
    assert reader.longest_prefix(ks)["a"].location(0) == loc("a", 7, gen=3)
    a.withdraw([(ks[0], loc("a", 1, gen=1))])                # a late withdraw of the old place
    assert reader.longest_prefix(ks)["a"].pages == 2
    a.withdraw([(ks[0], loc("a", 7, gen=3))])
    assert reader.longest_prefix(ks) == {}


def test_expired_node_is_never_returned(make: Factory, namespace: bytes) -> None:
    a, reader = make("a"), make(None)
    # 1 s, not less: publishing and the first lookup must fit in it on a busy CI machine (a
    # Redis Cluster of three servers on two cores took over 0.3 s once).
    beat = time.monotonic()
    a.heartbeat(NodeInfo("a"), 1.0)
    ks = keys(namespace, 3)
    a.publish([(k, loc("a", i)) for i, k in enumerate(ks)])
    assert reader.longest_prefix(ks)["a"].pages == 3
    time.sleep(max(0.0, beat + 1.2 - time.monotonic()))
    assert reader.longest_prefix(ks) == {} and [n.node_id for n in reader.nodes()] == []
    assert a.heartbeat(NodeInfo("a"), 10) is True            # a new incarnation: must re-publish
    assert reader.longest_prefix(ks) == {}                   # old entries stay invisible
    a.publish([(k, loc("a", i)) for i, k in enumerate(ks)])
    assert reader.longest_prefix(ks)["a"].pages == 3


def test_node_registry_and_capacity(make: Factory) -> None:
    a, b, reader = make("a"), make("b"), make(None)
    a.heartbeat(NodeInfo("a", {"cpu_dram": TierUsage(100, 40, "dram:1")}, {"url": "http://a"}), 10)
    b.heartbeat(NodeInfo("b", {"cxl": TierUsage(1000, 900, "cxl:x")}), 10)
    nodes = {n.node_id: n for n in reader.nodes()}
    assert nodes["a"].tiers["cpu_dram"].free_bytes == 40 and nodes["a"].meta == {"url": "http://a"}
    assert nodes["b"].tiers["cxl"] == TierUsage(1000, 900, "cxl:x")
    b.leave()
    assert [n.node_id for n in reader.nodes()] == ["a"]
    with pytest.raises(ValueError):
        reader.publish([])


def test_query_must_share_a_namespace(make: Factory, namespace: bytes) -> None:
    reader = make(None)
    mixed = keys(namespace, 1) + keys(b"\x02" * 16, 1)
    with pytest.raises(ValueError):
        reader.longest_prefix(mixed)


def test_spilled_location_is_recorded_as_its_owners(make: Factory, namespace: bytes) -> None:
    """B publishes a page it wrote into M's granted slot: lookups see it on M, it dies with M."""
    b, m, reader = make("b"), make("m"), make(None)
    b.heartbeat(NodeInfo("b"), 10)
    m.heartbeat(NodeInfo("m"), 1.0)                          # 0.5 s flaked on a loaded host (cluster)
    ks = keys(namespace, 2)
    b.publish([(k, loc("m", 40 + i, gen=7)) for i, k in enumerate(ks)] + [(ks[0], loc("x", 1))])  # x: unknown
    got = reader.longest_prefix(ks)
    assert set(got) == {"m"} and got["m"].location(1) == loc("m", 41, gen=7)
    b.withdraw([(ks[1], loc("m", 41, gen=7))])               # the writer withdraws (lease ended)
    assert reader.longest_prefix(ks)["m"].pages == 1
    time.sleep(1.2)                                          # M's heartbeat lapses: its slots are gone
    assert reader.longest_prefix(ks) == {}


def test_a_restarted_node_hides_its_former_incarnation(make: Factory, namespace: bytes) -> None:
    """A node's process died (no leave) and started again: what its former incarnation published
    points into memory that is gone, and must not be offered until that registration's TTL ends."""
    old, reader = make("a"), make(None)
    old.heartbeat(NodeInfo("a"), 10)
    ks = keys(namespace, 3)
    old.publish([(k, loc("a", i)) for i, k in enumerate(ks)])
    assert reader.longest_prefix(ks)["a"].pages == 3
    new = make("a")                                          # the restarted process
    assert new.heartbeat(NodeInfo("a", meta={"v": "2"}), 10) is True
    assert reader.longest_prefix(ks) == {}
    assert [n.meta for n in reader.nodes()] == [{"v": "2"}]
    new.publish([(k, loc("a", 10 + i, gen=2)) for i, k in enumerate(ks[:2])])
    got = reader.longest_prefix(ks)
    assert got["a"].pages == 2 and got["a"].location(0) == loc("a", 10, gen=2)


def test_two_live_processes_with_one_node_id_do_not_bump_each_other(make: Factory, namespace: bytes) -> None:
    """Two running processes configured with one node id: the newer registration holds it (as
    after a restart); the older one is told so on every heartbeat and publishes nothing, instead
    of both taking a new incarnation (and re-publishing everything) on every heartbeat."""
    first, second, reader = make("a"), make("a"), make(None)
    assert first.heartbeat(NodeInfo("a"), 10) is True
    ks = keys(namespace, 2)
    first.publish([(k, loc("a", 50 + i)) for i, k in enumerate(ks)])
    assert second.heartbeat(NodeInfo("a"), 10) is True
    second.publish([(k, loc("a", i)) for i, k in enumerate(ks)])
    for _ in range(3):
        with pytest.raises(NodeIdTaken, match="'a'"):
            first.heartbeat(NodeInfo("a"), 10)
        assert second.heartbeat(NodeInfo("a"), 10) is False      # no new incarnation, no re-publish
    first.publish([(ks[0], loc("a", 99))])                      # ignored: not registered
    first.withdraw([(ks[1], loc("a", 1))])
    got = reader.longest_prefix(ks)
    assert got["a"].pages == 2 and got["a"].location(0) == loc("a", 0) and got["a"].location(1) == loc("a", 1)
    first.leave()                                                # does not end the other's registration
    assert [n.node_id for n in reader.nodes()] == ["a"]
    second.leave()
    assert first.heartbeat(NodeInfo("a"), 10) is True           # the node id is free again


def test_a_partial_hit_costs_one_round_and_a_spilled_tail_is_still_found(make: Factory, namespace: bytes) -> None:
    """gather_runs asks again from where the runs stop only when some holder has that page: a known
    prefix followed by a new turn (the common partial hit) is one query on an index that says where
    holding ends (Redis, cluster); a tail spilled to another node is still found in a second round."""
    a, b, reader = make("a"), make("b"), make(None)
    assert a.heartbeat(NodeInfo("a"), 10) and b.heartbeat(NodeInfo("b"), 10)
    ks = keys(namespace, 40)
    a.publish([(k, loc("a", i)) for i, k in enumerate(ks[:6])])
    asked: list[int] = []

    def ask(q: list[PageKey]) -> dict[str, PrefixMatch]:
        asked.append(len(ks) - len(q))
        return reader.longest_prefix(q)

    def covered(rs: list[Run]) -> int:
        return max(at + m.pages for at, m in rs)

    runs = gather_runs(ks, ask, covered)
    assert [(at, m.node, m.pages) for at, m in runs] == [(0, "a", 6)]
    assert asked == ([0, 6] if isinstance(reader, LocalIndex) else [0])
    b.publish([(k, loc("b", i)) for i, k in enumerate(ks[6:], start=6)])      # the tail, on another node
    asked.clear()
    runs = gather_runs(ks, ask, covered)
    assert [(at, m.node, m.pages) for at, m in runs] == [(0, "a", 6), (6, "b", 34)] and asked == [0, 6]
    b.withdraw([(k, loc("b", i)) for i, k in enumerate(ks[20:], start=20)])   # a gap: runs stop at 20
    asked.clear()
    runs = gather_runs(ks, ask, covered)
    assert [(at, m.node, m.pages) for at, m in runs] == [(0, "a", 6), (6, "b", 14)]
    assert asked == ([0, 6, 20] if isinstance(reader, LocalIndex) else [0, 6])
