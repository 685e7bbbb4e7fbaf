"""The cluster index beyond the shared contract: its URL forms, records spread over every master,
a graceful failover (MOVED) followed without an error, and the same answers as one server."""

from __future__ import annotations

import random
import time

import pytest

from pof_connector.config import ConfigError, PofConfig
from pof_connector.config.cluster_url import ClusterUrl
from pof_connector.index import Location, NodeInfo, open_index, redis_index
from pof_connector.index.base import MEDIA, PrefixMatch
from pof_connector.index.cluster_servers import ClusterServers
from pof_connector.index.cluster_summaries import SEGMENT_BUCKET_BYTE, SEGMENT_BUCKETS
from pof_connector.index.redis_cluster import BUCKET_BYTE, BUCKETS, RedisClusterIndex
from pof_connector.index.segments import MAX_TAGS
from pof_connector.index.server import RedisServer
from pof_connector.pages.keys import Namespace, PageKey, page_keys
from pof_connector.pages.layout import PageSpec


def test_cluster_urls_parse_and_bad_ones_name_the_key() -> None:
    u = ClusterUrl.parse("rediss+cluster://pof:s3cret@10.0.0.1:7000,[::1]:7001,host-c:7002")
    assert u.tls and u.username == "pof" and u.password == "s3cret"
    assert u.nodes == (("10.0.0.1", 7000), ("::1", 7001), ("host-c", 7002))
    assert PofConfig.from_mapping({"index_url": "redis+cluster://a:1,b:2"}).index_url == "redis+cluster://a:1,b:2"
    for bad in ("redis+cluster://", "redis+cluster://host", "redis+cluster://u:pw@host:port", "redis+cluster://h:0"):
        with pytest.raises(ConfigError, match=r"index_url: .*redis\+cluster://") as e:
            PofConfig.from_mapping({"index_url": bad})
        assert "pw" not in str(e.value)
    with pytest.raises(ConfigError, match="index_tls_ca_file: TLS files are for a rediss://"):
        PofConfig.from_mapping({"index_url": "redis+cluster://a:1", "index_tls_ca_file": "/etc/hostname"})
    ok = PofConfig.from_mapping({"index_url": "rediss+cluster://a:1", "index_tls_ca_file": "/etc/hostname",
                                 "index_username": "pof"})
    assert ok.index_auth.tls_ca_file == "/etc/hostname"


def test_records_spread_over_every_master(redis_cluster: ClusterServers, namespace: bytes) -> None:
    config = PofConfig.from_mapping({"node_id": "a", "index_url": redis_cluster.url})
    a = open_index(config, "a")
    reader = open_index(config, None)
    try:
        assert isinstance(a, RedisClusterIndex)
        a.heartbeat(NodeInfo("a"), 10)
        ks = page_keys(namespace, list(range(16 * 1600)), 16)
        a.publish([(k, Location("a", "cpu_dram", i, 1)) for i, k in enumerate(ks)])
        # Summaries and records are bucketed by their segment's field.
        heads = {k.place.head[SEGMENT_BUCKET_BYTE] % SEGMENT_BUCKETS for k in ks if k.place is not None}
        for kind in ("seg", "rec"):
            per_master = {p.port: sum(1 for _ in p.client().scan_iter(match=f"pof:{{*}}:{kind}")) for p in
                          redis_cluster.primaries()}
            assert len(per_master) == 3 and min(per_master.values()) > 0
            assert sum(per_master.values()) == len(heads) == SEGMENT_BUCKETS
        got = reader.longest_prefix(ks)["a"]
        assert got.pages == 1600 and got.location(1599) == Location("a", "cpu_dram", 1599, 1)
        assert reader.stats()["locations"] == 1600
        # Keys without places (an engine's bare digests) go to per-page fields, bucketed by digest.
        flat = [PageKey(namespace, bytes([i]) * 32) for i in range(1, 101)]
        a.publish([(k, Location("a", "cxl", i, 1)) for i, k in enumerate(flat)])
        per_master = {p.port: sum(1 for _ in p.client().scan_iter(match="pof:{*}:loc")) for p in
                      redis_cluster.primaries()}
        assert sum(per_master.values()) == len({k.digest[BUCKET_BYTE] % BUCKETS for k in flat})
        assert reader.longest_prefix(flat[:3])["a"].pages == 3
        from pof_connector.cli import main

        assert main(["index", "stats", "--url", redis_cluster.url]) == 0        # pof index stats on a cluster
    finally:
        a.close()
        reader.close()


def test_a_graceful_failover_is_followed_and_the_node_registers_again(redis_cluster: ClusterServers,
                                                                       namespace: bytes) -> None:
    """A replica takes over its master (``CLUSTER FAILOVER``): the reader's next lookup is answered
    ``MOVED`` by the old master, refreshes its slot map and answers right; the node's next
    heartbeat sees new masters and asks for a re-publish under a new incarnation."""
    a = RedisClusterIndex(redis_cluster.url, "a")
    reader = RedisClusterIndex(redis_cluster.url, None)
    try:
        assert a.heartbeat(NodeInfo("a"), 10) is True
        ks = page_keys(namespace, list(range(16 * 100)), 16)
        a.publish([(k, Location("a", "cpu_dram", i, 1)) for i, k in enumerate(ks)])
        assert reader.longest_prefix(ks)["a"].pages == 100
        old = a.incarnation
        replica = next(p for p in redis_cluster.procs if p.alive and p not in redis_cluster.primaries())
        replica.cmd("CLUSTER", "FAILOVER")
        deadline = time.monotonic() + 20
        while replica.client().info("replication")["role"] != "master":
            assert time.monotonic() < deadline, "the replica did not take over"
            time.sleep(0.05)
        redis_cluster.wait_healthy()
        assert reader.longest_prefix(ks)["a"].pages == 100       # MOVED, refreshed, sent again
        assert a.heartbeat(NodeInfo("a"), 10) is True            # masters changed: register again
        assert a.incarnation != old
        assert reader.longest_prefix(ks) == {}                   # the former incarnation is gone
        a.publish([(k, Location("a", "cpu_dram", i, 2)) for i, k in enumerate(ks)])
        assert reader.longest_prefix(ks)["a"].location(0) == Location("a", "cpu_dram", 0, 2)
        assert a.heartbeat(NodeInfo("a"), 10) is False
    finally:
        a.close()
        reader.close()


def test_bench_compares_a_cluster_with_one_server() -> None:
    from pof_connector.bench import index_cluster

    r = index_cluster.run(pages=100, nodes=2, iterations=5, memory_pages=2000, masters=3, replicas=0, clients=1,
                          saturate_s=0.3)
    assert r["cluster_ratio"] == pytest.approx(r["cluster_lookup_p50_ms"] / r["single_lookup_p50_ms"], rel=0.01)
    for name in ("single", "cluster"):
        assert r[f"{name}_lookups_per_s"] > 0 and r[f"{name}_publish_pages_per_s"] > 0
        assert 20 < r[f"{name}_bytes_per_location_10m"] < 1000
        assert r[f"{name}_bytes_per_location_1m_is"] == "extrapolated from 2,000"


def test_bench_cluster_takes_no_url(capsys: pytest.CaptureFixture[str]) -> None:
    from pof_connector.cli import main

    assert main(["bench", "index", "--cluster", "--url", "redis://127.0.0.1:1/0"]) != 0
    assert "--cluster starts its own server and cluster; it takes no --url" in capsys.readouterr().err


def test_a_cluster_that_does_not_answer_costs_misses_not_a_start(runtime_dir: str, namespace: bytes) -> None:
    """No node of the URL answers (ports nobody listens on): the client is made anyway, every call
    is IndexUnavailable, and a pool on it starts and answers misses."""
    from pof_connector.index import IndexUnavailable
    from pof_connector.index.cluster_servers import _free_ports
    from pof_connector.pages.layout import PageSpec
    from pof_connector.pool import Pool

    url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in _free_ports(2))
    index = RedisClusterIndex(url, "a", timeout_s=0.2)
    ks = page_keys(namespace, list(range(32)), 16)
    try:
        for call in (lambda: index.longest_prefix(ks), index.nodes, lambda: index.heartbeat(NodeInfo("a"), 5)):
            with pytest.raises(IndexUnavailable):
                call()
    finally:
        index.close()
    config = PofConfig.from_mapping({"node_id": "a", "index_url": url, "runtime_dir": runtime_dir,
                                     "index_timeout_s": 0.2, "tiers": {"cpu_dram": {"size": "1MiB"}}})
    pool = Pool(config, PageSpec(num_layers=2, segment_bytes=512, page_tokens=16), namespace)
    try:
        assert pool.lookup(ks).pages == 0 and pool.stats.get("index_errors", op="heartbeat") >= 1
    finally:
        pool.close()


def test_a_cluster_with_a_password_through_index_password_env(monkeypatch: pytest.MonkeyPatch,
                                                               namespace: bytes) -> None:
    from pof_connector.index import IndexUnavailable

    secret = "pof-cluster-S3cr3t-41"
    cluster = ClusterServers(masters=3, replicas=0, password=secret).start()
    try:
        monkeypatch.setenv("POF_TEST_CLUSTER_PASSWORD", secret)
        config = PofConfig.from_mapping({"node_id": "a", "index_url": cluster.url,
                                         "index_password_env": "POF_TEST_CLUSTER_PASSWORD"})
        a = open_index(config, "a")
        try:
            a.heartbeat(NodeInfo("a"), 10)
            ks = page_keys(namespace, list(range(16 * 50)), 16)
            a.publish([(k, Location("a", "cpu_dram", i, 1)) for i, k in enumerate(ks)])
            assert a.longest_prefix(ks)["a"].pages == 50
        finally:
            a.close()
        monkeypatch.setenv("POF_TEST_CLUSTER_PASSWORD", "wrong")
        wrong = open_index(PofConfig.from_mapping({"index_url": cluster.url,
                                                   "index_password_env": "POF_TEST_CLUSTER_PASSWORD"}), None)
        try:
            with pytest.raises(IndexUnavailable) as e:
                wrong.nodes()
            assert secret not in str(e.value) and "wrong" not in str(e.value)
        finally:
            wrong.close()
    finally:
        cluster.stop()


def test_the_cluster_answers_as_one_server(redis_cluster: ClusterServers, redis_server: RedisServer) -> None:
    """The same holdings on one server and on the cluster: branches past what an offset keeps (so
    some pages overflow to per-page fields), a placeless publisher in the placed namespace, withdraws,
    a spill; every lookup, from several starts, gives the same runs, slots and generations on both."""
    rng = random.Random(11)
    ns = Namespace("cl", "bfloat16", "x", PageSpec(2, 1024, 16)).digest
    trunk = [rng.randrange(30_000) for _ in range(16 * 20)]
    chains = [page_keys(ns, trunk + [rng.randrange(30_000) for _ in range(16 * 30)], 16) for _ in range(MAX_TAGS + 2)]
    sides = {url: {n: redis_index(url, n) for n in ("a", "b")} for url in (redis_server.url, redis_cluster.url)}
    readers = {url: redis_index(url, None) for url in sides}
    try:
        for clients in sides.values():
            for n, c in clients.items():
                c.heartbeat(NodeInfo(n), 30)
        ops: list[tuple[str, str, list[tuple[PageKey, Location]]]] = []
        for c, chain in enumerate(chains):
            for n in ("a", "b"):
                held = chain[:rng.randrange(len(chain))]
                ops.append(("publish", n, [(k, Location(n, MEDIA[rng.randrange(3)], 1000 * c + i,
                                                        rng.randrange(1, 99))) for i, k in enumerate(held)]))
        ops.append(("publish", "b", [(PageKey(ns, k.digest), Location("b", "cxl", i, 7))       # placeless
                                     for i, k in enumerate(chains[0][:25])]))
        ops.append(("publish", "a", [(k, Location("b", "cpu_dram", 9000 + i, 3))               # spilled into b
                                     for i, k in enumerate(chains[1][:10])]))
        ops.append(("withdraw", "a", rng.sample(ops[0][2], len(ops[0][2]) // 3)))
        for what, n, entries in ops:
            for clients in sides.values():
                getattr(clients[n], what)(entries)
        looked = 0
        for chain in chains:
            for start in (0, 3, 16, 21, 37):
                for end in (start + 5, len(chain)):
                    one, cl = (_view(readers[u].longest_prefix(chain[start:end])) for u in sides)
                    assert one == cl, (start, end)
                    looked += bool(one)
        assert looked > 20
    finally:
        for clients in sides.values():
            for c in clients.values():
                c.close()
        for r in readers.values():
            r.close()


def _view(found: dict[str, PrefixMatch]) -> dict[str, tuple[list[int], list[int], list[int]]]:
    return {n: (m.media.tolist(), m.slots.tolist(), m.generations.tolist()) for n, m in found.items()}
