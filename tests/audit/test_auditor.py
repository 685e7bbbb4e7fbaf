"""The auditor on real pools sharing a CXL region through a real Redis-protocol server: a page that
is the engine's KV passes, a wrong one is withdrawn for every node, counted by writer, named in
the index for ``pof audit``, and a writer with too many is quarantined until it registers again."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from pof_connector.audit.auditor import Auditor
from pof_connector.cli import main
from pof_connector.config import PofConfig
from pof_connector.config.audit_config import AuditConfig
from pof_connector.index.server import RedisServer
from pof_connector.pages.keys import Namespace, PageKey
from pof_connector.pages.layout import PageSpec
from pof_connector.pool import Pool
from tests.audit.test_tolerance import DIM, HEADS, TOKENS, as_floats, kv, to_bytes

LAYERS = 3
SPEC = PageSpec(num_layers=LAYERS, segment_bytes=2 * TOKENS * HEADS * DIM * 2, page_tokens=TOKENS)
NS = Namespace("tests/audit", "bfloat16", f"mha:kv_heads={HEADS}:head_dim={DIM}", SPEC).digest


def pool(node: str, runtime_dir: str, url: str, shm_path: str) -> Pool:
    return Pool(PofConfig.from_mapping({"node_id": node, "index_url": url, "runtime_dir": runtime_dir,
                                        "heartbeat_s": 0.05, "node_ttl_s": 0.5,
                                        "tiers": {"cxl": {"path": shm_path, "size": "4MiB", "partitions": 4}}}),
                SPEC, NS)


def page_kv(key: PageKey) -> list[np.ndarray]:
    seed = int.from_bytes(key.digest[:4], "little")
    return [kv(seed + layer, "bfloat16") for layer in range(LAYERS)]


def recomputed(layers: list[np.ndarray]) -> list[np.ndarray]:
    """The same KV as another batch computes it: each value moved by up to 2 units of bf16's last place."""
    out = []
    for seg in layers:
        x = as_floats(seg, "bfloat16")
        assert x is not None
        out.append(to_bytes(x * (1 + 2 * 2.0 ** -8 * np.random.default_rng(7).uniform(-1, 1, x.shape)), "bfloat16"))
    return out


def wait_for(pred, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_a_right_page_passes_and_a_wrong_one_is_withdrawn_everywhere(runtime_dir: str, shm_path: str,
                                                                     redis_server: RedisServer,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    w, r, c = (pool(n, runtime_dir, redis_server.url, shm_path) for n in ("w", "r", "c"))
    auditor = Auditor(r, AuditConfig(sample_rate=1.0), "bfloat16", HEADS, DIM)
    try:
        keys = w.keys_for(np.arange(TOKENS * 4))
        wrong = {2: page_kv(keys[3])}                  # page 2 stored with another prefix's KV
        w.store([(k, wrong.get(i, page_kv(k))) for i, k in enumerate(keys)]).result()
        wait_for(lambda: r.lookup(keys).pages == 4)
        sources = r.lookup(keys).sources
        results = [auditor.submit(k, sources[i], recomputed(page_kv(k))).result() for i, k in enumerate(keys)]
        assert [x is not None and x.reason for x in results] == [None, None, "values", None]
        assert all(x is not None and x.error < 0.06 for i, x in enumerate(results) if i != 2)
        assert results[2] is not None and results[2].error > 0.3
        # Withdrawn for every node: a third node's lookups, the auditor's, and the writer's own (it
        # finds its own pages in its books first: it drops the page once it sees the revocation).
        wait_for(lambda: c.lookup(keys).pages == 2 and r.lookup(keys).pages == 2 and w.lookup(keys).pages == 2)
        assert w.stats.get("audit_revoked", tier="cxl") == 1
        assert r.stats.get("audit_pages") == 4
        assert r.stats.get("audit_mismatches", writer="w", reason="values") == 1
        # pof audit reads the summary from the auditing node's index record.
        wait_for(lambda: "audit" in {n.node_id: n for n in c.index.nodes()}["r"].meta)
        summary = json.loads({n.node_id: n for n in c.index.nodes()}["r"].meta["audit"])
        assert summary["pages"] == 4 and summary["mismatches"] == {"w": {"values": 1}}
        assert main(["audit", "--url", redis_server.url, "--json"]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert shown["nodes"]["r"]["mismatches"] == {"w": {"values": 1}} and shown["totals"]["pages"] == 4
        assert main(["audit", "--url", redis_server.url]) == 0
        table = capsys.readouterr().out
        assert "w: values 1" in table and "pages audited" in table
        assert main(["stats", "--url", redis_server.url]) == 0
        assert "4 pages, 1 mismatched" in capsys.readouterr().out
    finally:
        auditor.close()
        for p in (w, r, c):
            p.close()


def test_a_writer_with_too_many_mismatches_is_not_loaded_until_it_registers_again(
        runtime_dir: str, shm_path: str, redis_server: RedisServer) -> None:
    w, r = (pool(n, runtime_dir, redis_server.url, shm_path) for n in ("w", "r"))
    auditor = Auditor(r, AuditConfig(sample_rate=1.0, quarantine_after=2), "bfloat16", HEADS, DIM)
    try:
        keys = w.keys_for(np.arange(TOKENS * 6))
        w.store([(k, page_kv(keys[-1]) if i in (0, 1) else page_kv(k)) for i, k in enumerate(keys)]).result()
        wait_for(lambda: r.lookup(keys).pages == 6)
        found = r.lookup(keys[:2])
        for i in range(2):
            got = auditor.submit(keys[i], found.sources[i], page_kv(keys[i])).result()
            assert got is not None and got.reason == "values"
        # Pages 2-5 were fine, but their writer is quarantined here: no longer loaded.
        assert r.lookup(keys[2:]).pages == 0
        w.close()
        wait_for(lambda: "w" not in {n.node_id for n in r.finder.refresh_nodes().values()})
        w = pool("w", runtime_dir, redis_server.url, shm_path)
        w.store([(k, page_kv(k)) for k in keys[2:]]).result()
        wait_for(lambda: r.lookup(keys[2:]).pages == 4)
    finally:
        auditor.close()
        for p in (w, r):
            p.close()
