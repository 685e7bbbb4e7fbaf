"""The audit (``audit.sample_rate``) in real vLLM CPU servers: wrong KV that every checksum passes
is caught on a pool hit, withdrawn everywhere, and never reaches the client.

Server ``a`` writes pages; ``POF_TEST_WRITER_FAULTS`` (a test-only hook in the worker's writes,
:mod:`pof_connector.adapters.vllm_faults`) makes it store wrong KV under right keys *before* the
pool sums the page, as a writer bug would. Server ``b`` reads the same CXL region and audits every
hit (``sample_rate: 1.0``). A server without the connector gives the reference answers."""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from pof_connector.adapters.vllm_faults import ENV, FAULTS
from pof_connector.audit.cli import summaries
from pof_connector.bench.vllm_server import VllmServer, build_model, connector_config
from pof_connector.index import redis_index
from pof_connector.index.embedded import embedded_url, stop_embedded
from tests.adapters.test_vllm import DTYPE, Reference, pool_tokens, prompt, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MISMATCHES = "vllm:pof_audit_mismatches_total"
REASON = {"swap_layers": "layers_swapped"}          # what each fault looks like; "values" otherwise


class Fleet:
    def __init__(self, workdir: Path) -> None:
        self.model = build_model("tiny")
        self.rt = workdir / "rt"
        self.region = Path(tempfile.mkdtemp(prefix="pof-audit-", dir="/dev/shm")) / "cxl.region"
        self.faults = workdir / "faults"
        self.faults.write_text("")
        tiers = {"cxl": {"path": str(self.region), "size": "512MiB", "partitions": 4}}

        def server(name: str, audit: float, **kw: Any) -> VllmServer:
            cfg = {"node_id": name, "index_url": "embedded", "runtime_dir": str(self.rt), "tiers": tiers,
                   "audit": {"sample_rate": audit}}
            return VllmServer(self.model, workdir / name, kv_transfer=connector_config(cfg), dtype=DTYPE, **kw)

        self.a = server("a", 0.0, env={ENV: str(self.faults)})
        self.b = server("b", 1.0)
        self.ref = VllmServer(self.model, workdir / "ref", dtype=DTYPE)
        self.reference = Reference(self.ref)
        try:
            with ThreadPoolExecutor(3) as ex:
                list(ex.map(lambda s: s.start(), (self.a, self.b, self.ref)))
        except BaseException:
            self.stop()
            raise

    def audit_summary(self) -> dict[str, Any]:
        index = redis_index(embedded_url(str(self.rt)), None)
        try:
            return summaries(index.nodes())
        finally:
            index.close()

    def stop(self) -> None:
        for s in (self.a, self.b, self.ref):
            s.stop()
        stop_embedded(self.rt)
        shutil.rmtree(self.region.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    workdir = Path(tempfile.mkdtemp(prefix="pof-vllm-audit-", dir="/tmp"))
    f = Fleet(workdir)
    yield f
    f.stop()
    shutil.rmtree(workdir, ignore_errors=True)


def mismatches(fleet: Fleet, reason: str) -> int:
    """b's mismatched pages written by a, from b's node record (published every heartbeat; its
    ``vllm:pof_audit_mismatches_total`` moves only with the engine's next step, and the comparison
    may end after the request's last one)."""
    return int(fleet.audit_summary().get("b", {}).get("mismatches", {}).get("a", {}).get(reason, 0))


def above(summary: dict[str, Any], bound: float) -> int:
    """Audited pages whose error fell in a histogram bucket above ``bound``."""
    return sum(n for b, n in summary.get("buckets", {}).items() if b == "inf" or float(b) > bound)


@pytest.mark.parametrize("fault", FAULTS)
def test_each_fault_checksums_cannot_catch_is_caught_and_the_answer_is_right(fleet: Fleet, fault: str) -> None:
    p = prompt(1000, seed=200 + FAULTS.index(fault))
    a, b = fleet.a, fleet.b
    if fault == "failed_load":        # a's pool hit on the first 640 tokens "loads" nothing; the rest is stored
        a.complete(p[:641])
        time.sleep(1.5)
        a.reset_prefix_cache()
    elif fault == "other_prefix":     # the KV it stores comes from an earlier request's page
        a.complete(prompt(300, seed=999))
    fleet.faults.write_text(fault)
    try:
        a.complete(p)
    finally:
        fleet.faults.write_text("")
    time.sleep(1.5)                   # the pages are published
    reason = REASON.get(fault, "values")
    before = mismatches(fleet, reason)
    assert b.complete(p) == fleet.reference(p)
    wait_for(lambda: mismatches(fleet, reason) > before)
    # Withdrawn everywhere: a, whose own books held the wrong pages, drops them once it reads b's
    # node record (heartbeats of both, a few seconds); it then loads the right copies b stored.
    served_by_b = re.compile(r"from the pool \(cxl: \d+; node [ab,]*b\)")

    def a_answers_from_b() -> bool:
        a.reset_prefix_cache()
        seen = len(served_by_b.findall(a.log.read_text()))
        return a.complete(p) == fleet.reference(p) and len(served_by_b.findall(a.log.read_text())) > seen

    wait_for(a_answers_from_b, timeout=30)


def test_clean_pages_raise_no_alarm(fleet: Fleet) -> None:
    """Pages a wrote cleanly, audited by b alone and in batches: none mismatches, and every error
    is far below the bound."""
    prompts = [prompt(700 + 37 * i, seed=300 + i) for i in range(12)]
    with ThreadPoolExecutor(4) as ex:
        list(ex.map(fleet.a.complete, prompts))
    time.sleep(1.5)
    before = fleet.audit_summary().get("b", {})
    base = sum(mismatches(fleet, r) for r in ("values", "layers_swapped", "unfilled"))
    answers = [fleet.b.complete(prompts[0])]
    with ThreadPoolExecutor(4) as ex:
        answers += list(ex.map(fleet.b.complete, prompts[1:]))
    assert answers == [fleet.reference(q) for q in prompts]
    wait_for(lambda: fleet.audit_summary().get("b", {}).get("pages", 0) - before.get("pages", 0)
             >= sum(pool_tokens(len(q)) // 128 for q in prompts))
    # float32: rounding only. Every new page's error fell in a histogram bucket at most 1e-3.
    assert above(fleet.audit_summary()["b"], 1e-3) == above(before, 1e-3)
    assert sum(mismatches(fleet, r) for r in ("values", "layers_swapped", "unfilled")) == base
    # The engine's own metrics show what the node record does, once the engine steps again.
    total = sum(n for r in fleet.audit_summary()["b"]["mismatches"].values() for n in r.values())

    def exported() -> bool:
        fleet.b.complete(prompts[0], max_tokens=2)
        return fleet.b.metrics([MISMATCHES]).get(MISMATCHES, 0.0) >= total

    wait_for(exported, timeout=30)
