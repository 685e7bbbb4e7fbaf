"""Two real vLLM CPU servers whose pool index is a real Redis Cluster (3 masters + 3 replicas):
a prefix computed on one is served to the other from the pool, greedy outputs equal a server
without the connector, and a master killed under them costs hits, never an engine error."""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pof_connector.bench.vllm_server import VllmServer, connector_config
from pof_connector.index.cluster_servers import ClusterServers
from pof_connector.index.redis import K_LIVE
from tests.adapters.test_vllm import DTYPE, HITS, Reference, model, pool_tokens, prompt, reference, workdir

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
__all__ = ["model", "reference", "workdir"]      # module fixtures shared with test_vllm


@pytest.fixture
def cluster() -> Iterator[ClusterServers]:
    c = ClusterServers(masters=3, replicas=1).start()
    yield c
    c.stop()


def test_two_servers_share_a_prefix_through_a_cluster_index(model: Path, workdir: Path, reference: Reference,
                                                            cluster: ClusterServers) -> None:
    region = Path(tempfile.mkdtemp(prefix="pof-vllm-", dir="/dev/shm")) / "cxl.region"
    tiers = {"cxl": {"path": str(region), "size": "256MiB", "partitions": 4}}

    def server(name: str) -> VllmServer:
        cfg = {"node_id": name, "index_url": cluster.url, "runtime_dir": str(workdir / f"rt-{name}"),
               "tiers": tiers, "index_timeout_s": 0.5}
        return VllmServer(model, workdir / f"cl-{name}", kv_transfer=connector_config(cfg), dtype=DTYPE)

    a, b = server("a"), server("b")
    with ThreadPoolExecutor(2) as ex:
        list(ex.map(lambda s: s.start(), (a, b)))
    try:
        prompts = [prompt(1000, seed=71), prompt(300, seed=72)]
        assert [a.complete(p) for p in prompts] == [reference(p) for p in prompts]
        time.sleep(1.5)                                      # a's store thread publishes the pages
        hits = b.metrics()[HITS]
        assert [b.complete(p) for p in prompts] == [reference(p) for p in prompts]
        assert b.metrics()[HITS] - hits == sum(pool_tokens(len(p)) for p in prompts) == 1152
        assert re.search(r"from the pool \(cxl: 896; node a\)", b.log.read_text()), b.tail()
        # The registry's master dies under both servers: answers stay right (hits may be lost).
        cluster.kill(cluster.primary_of(K_LIVE))
        later = [prompt(700, seed=73), prompt(1000, seed=71)]
        assert [b.complete(p) for p in later] == [reference(p) for p in later]
        cluster.wait_healthy()
        time.sleep(3.0)                                      # heartbeats see new masters, nodes re-publish
        fresh = prompt(900, seed=74)
        assert a.complete(fresh) == reference(fresh)
        time.sleep(1.5)
        hits = b.metrics()[HITS]
        assert b.complete(fresh) == reference(fresh)
        assert b.metrics()[HITS] - hits == pool_tokens(900)  # the pool serves again after the failover
        for s in (a, b):
            assert "Traceback" not in s.log.read_text(), s.tail()
    finally:
        a.stop()
        b.stop()
        shutil.rmtree(region.parent, ignore_errors=True)
