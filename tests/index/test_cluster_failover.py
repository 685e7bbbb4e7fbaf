"""A master of the index cluster is SIGKILLed while pool nodes store and look up: every answer is
a location its holder published or a miss, nothing raises out of a pool, and full hits return
soon after the replica is promoted (the nodes register again and re-publish)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from pof_connector.config import PofConfig
from pof_connector.index import Location, NodeInfo
from pof_connector.index.cluster_servers import ClusterServers
from pof_connector.index.redis import K_LIVE
from pof_connector.index.redis_cluster import RedisClusterIndex
from pof_connector.pages.keys import PageKey, page_keys
from pof_connector.pages.layout import PageSpec
from pof_connector.pool import Pool

SPEC = PageSpec(num_layers=2, segment_bytes=1024, page_tokens=16)
CHAIN_PAGES = 8
RECOVERY_BOUND_S = 10.0
"""Full hits must be back this long after the cluster is healthy again (measured: well under 1 s)."""


def content(k: PageKey) -> list[np.ndarray]:
    rng = np.random.default_rng(int.from_bytes(k.digest[:8], "little"))
    return [rng.integers(0, 255, SPEC.segment_bytes, dtype=np.uint8) for _ in range(SPEC.num_layers)]


def cfg(node: str, runtime_dir: str, url: str, shm_path: str) -> PofConfig:
    return PofConfig.from_mapping({"node_id": node, "index_url": url, "runtime_dir": runtime_dir,
                                   "heartbeat_s": 0.05, "node_ttl_s": 2.0, "index_timeout_s": 0.5,
                                   "tiers": {"cxl": {"path": shm_path, "size": "16MiB", "partitions": 4}}})


@pytest.fixture
def cluster() -> Iterator[ClusterServers]:
    c = ClusterServers(masters=3, replicas=1).start()
    yield c
    c.stop()


class Traffic:
    """Writers store new chains on ``holders``; a reader looks chains up from ``reader`` and checks
    every source against what its holder published."""

    def __init__(self, holders: list[Pool], reader: Pool) -> None:
        self.holders, self.reader = holders, reader
        self.published: dict[PageKey, set[Location]] = {}
        self.chains: list[list[PageKey]] = []
        self.wrong: list[str] = []
        self.errors: list[BaseException] = []
        self.answers = {"full": 0, "partial": 0, "miss": 0}
        self.stop = threading.Event()
        for pool in holders:
            self._record(pool)

    def _record(self, pool: Pool) -> None:
        inner = pool.index.publish

        def publish(entries):  # type: ignore[no-untyped-def]
            for key, loc in entries:                 # before sending: a publish cut short may still land
                self.published.setdefault(key, set()).add(loc)
            return inner(entries)
        pool.index.publish = publish  # type: ignore[method-assign]

    def write(self) -> None:
        rng = np.random.default_rng(7)
        try:
            while not self.stop.is_set() and len(self.chains) < 120:
                holder = self.holders[len(self.chains) % len(self.holders)]
                keys = holder.keys_for(rng.integers(0, 50_000, 16 * CHAIN_PAGES))
                holder.store([(k, content(k)) for k in keys]).result()
                self.chains.append(keys)
                time.sleep(0.01)
        except BaseException as e:
            self.errors.append(e)

    def check(self, keys: list[PageKey]) -> int:
        lk = self.reader.lookup(keys)
        for i, src in enumerate(lk.sources):
            if src not in self.published.get(keys[i], ()):
                self.wrong.append(f"page {i}: {src} was never published for this key")
        kind = "full" if lk.pages == len(keys) else "miss" if lk.pages == 0 else "partial"
        self.answers[kind] += 1
        return lk.pages

    def read(self) -> None:
        rnd = random.Random(3)
        try:
            while not self.stop.is_set():
                if self.chains:
                    self.check(rnd.choice(self.chains))
                time.sleep(0.002)
        except BaseException as e:
            self.errors.append(e)

    def all_full(self, chains: list[list[PageKey]]) -> bool:
        return all(self.check(keys) == len(keys) for keys in chains)

    def wait_full(self, chains: list[list[PageKey]], since: float, what: str) -> float:
        """Seconds from ``since`` until every chain is a full hit; fails past :data:`RECOVERY_BOUND_S`."""
        while not self.all_full(chains):
            assert time.monotonic() - since < RECOVERY_BOUND_S, what
            time.sleep(0.02)
        return time.monotonic() - since


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["registry", "pages"])
def test_a_killed_master_costs_hits_never_a_wrong_location(cluster: ClusterServers, runtime_dir: str,
                                                         namespace: bytes, shm_path: str, victim: str) -> None:
    """``registry``: the master of the registry's slot (every lookup and heartbeat needs it; it
    holds page buckets too); ``pages``: another master, holding only page buckets."""
    a = Pool(cfg("a", runtime_dir, cluster.url, shm_path), SPEC, namespace)
    b = Pool(cfg("b", runtime_dir, cluster.url, shm_path), SPEC, namespace)
    reader = Pool(cfg("c", runtime_dir, cluster.url, shm_path), SPEC, namespace)
    assert isinstance(reader.index, RedisClusterIndex)
    traffic = Traffic([a, b], reader)
    threads = [threading.Thread(target=traffic.write), threading.Thread(target=traffic.read)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while len(traffic.chains) < 40:
            assert time.monotonic() < deadline and not traffic.errors, traffic.errors
            time.sleep(0.05)
        before = list(traffic.chains)
        assert traffic.all_full(before)
        registry = cluster.primary_of(K_LIVE)
        target = registry if victim == "registry" else next(p for p in cluster.primaries() if p is not registry)
        killed_at = time.monotonic()
        cluster.kill(target)
        promoted_after = cluster.wait_healthy(timeout_s=30)
        healthy_at = time.monotonic()
        recovered_after = traffic.wait_full(before, healthy_at, "full hits did not return")
        time.sleep(1.0)                                     # traffic on the new topology
        traffic.stop.set()
        for t in threads:
            t.join(30)
        # Chains stored during the outage come back only through their holder's re-publish, which
        # waits out the guard's back-off (BACKOFF_S) after the holder's last failed call, then the
        # next heartbeat: under a loaded suite that can end after the 1 s above, so it gets the
        # same bound as the chains stored before the kill.
        republished_after = traffic.wait_full(traffic.chains, healthy_at,
                                              "chains stored during the outage stayed missing")
        print(f"\nfailover ({victim} master): cluster healthy {promoted_after:.2f} s after SIGKILL, full hits "
              f"{recovered_after:.2f} s after that, on every chain {republished_after:.2f} s after it was healthy "
              f"({time.monotonic() - killed_at:.1f} s run since the kill); "
              f"answers {traffic.answers}, chains {len(traffic.chains)}")
        assert traffic.errors == [] and traffic.wrong == []
        assert traffic.answers["miss"] + traffic.answers["partial"] > 0      # the outage was seen
        assert reader.stats.get("index_errors", op="lookup") > 0
    finally:
        traffic.stop.set()
        for t in threads:
            t.join(30)
        for p in (a, b, reader):
            p.close()


def test_the_first_lookup_after_a_failover_is_answered(cluster: ClusterServers, namespace: bytes) -> None:
    """A reader that last looked before a master died finds the promoted replica on its first
    lookup after the failover (its failed call refreshes the slot map and is sent again), instead
    of missing once — a vLLM scheduler looks up rarely, and that one miss would be a whole prompt."""
    a = RedisClusterIndex(cluster.url, "a")
    reader = RedisClusterIndex(cluster.url, None)
    try:
        a.heartbeat(NodeInfo("a"), 30)
        ks = page_keys(namespace, list(range(16 * 200)), 16)
        a.publish([(k, Location("a", "cpu_dram", i, 1)) for i, k in enumerate(ks)])
        assert reader.longest_prefix(ks)["a"].pages == 200
        time.sleep(0.5)                                          # replicated (asynchronously)
        registry = cluster.primary_of(K_LIVE)
        cluster.kill(next(p for p in cluster.primaries() if p is not registry))
        cluster.wait_healthy()
        assert reader.longest_prefix(ks)["a"].pages == 200
    finally:
        a.close()
        reader.close()
