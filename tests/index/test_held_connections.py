"""A cluster client's lookups keep one connection per (thread, master) between calls
(:mod:`pof_connector.index.held_connections`), on a real 3-master valkey cluster."""

from __future__ import annotations

import threading

import pytest

from pof_connector.config import PofConfig
from pof_connector.index import IndexUnavailable, Location, NodeInfo, open_index
from pof_connector.index.cluster_servers import ClusterServers
from pof_connector.index.redis_cluster import RedisClusterIndex
from pof_connector.pages.keys import page_keys


def _in_use(reader: RedisClusterIndex) -> int:
    return sum(len(n.redis_connection.connection_pool._in_use_connections)
               for n in reader._r.get_nodes() if n.redis_connection is not None)


def _opened(reader: RedisClusterIndex) -> int:
    return sum(len(n.redis_connection.connection_pool._in_use_connections)
               + len(n.redis_connection.connection_pool._available_connections)
               for n in reader._r.get_nodes() if n.redis_connection is not None)


@pytest.fixture
def published(redis_cluster: ClusterServers, namespace: bytes):  # type: ignore[no-untyped-def]
    config = PofConfig.from_mapping({"node_id": "a", "index_url": redis_cluster.url})
    writer = open_index(config, "a")
    reader = open_index(config, None)
    assert isinstance(reader, RedisClusterIndex)
    writer.heartbeat(NodeInfo("a"), 10)
    keys = page_keys(namespace, list(range(16 * 400)), 16)
    writer.publish([(k, Location("a", "cpu_dram", i, 1)) for i, k in enumerate(keys)])
    try:
        yield reader, keys
    finally:
        reader.close()
        writer.close()


def test_a_threads_lookups_reuse_its_connections(published) -> None:  # type: ignore[no-untyped-def]
    reader, keys = published
    assert reader.longest_prefix(keys)["a"].pages == 400
    held, opened = _in_use(reader), _opened(reader)
    assert held >= 2                     # the registry's master and the summaries' ones, kept out
    for _ in range(50):
        assert reader.longest_prefix(keys)["a"].pages == 400
    assert _in_use(reader) == held and _opened(reader) == opened


def test_a_connection_the_server_closed_costs_one_lookup(redis_cluster: ClusterServers,  # type: ignore[no-untyped-def]
                                                         published) -> None:
    reader, keys = published
    assert reader.longest_prefix(keys)["a"].pages == 400
    for p in redis_cluster.primaries():             # every client connection of every master
        p.client().client_kill_filter(_type="normal", skipme=True)
    failures = 0
    for _ in range(3):
        try:
            assert reader.longest_prefix(keys)["a"].pages == 400
        except IndexUnavailable:
            failures += 1
    assert failures <= 1                     # the dead sockets are dropped, not used again
    assert reader.longest_prefix(keys)["a"].pages == 400


def test_an_ended_threads_connections_go_back_and_close_frees_all(published) -> None:  # type: ignore[no-untyped-def]
    reader, keys = published
    found: list[int] = []
    t = threading.Thread(target=lambda: found.append(reader.longest_prefix(keys)["a"].pages))
    t.start()
    t.join()
    assert found == [400]
    after_thread = _in_use(reader)
    assert after_thread >= 2                 # the ended thread's, still out
    assert reader.longest_prefix(keys)["a"].pages == 400       # this thread checks its own out ...
    assert _in_use(reader) == after_thread   # ... and the ended thread's went back (as many out as before)
    reader._held.close()
    assert _in_use(reader) == 0
