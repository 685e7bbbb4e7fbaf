"""Prefill/decode disaggregation through the pool, on the real connector halves without a server:
a prefill node's scheduler and worker, a decode node's, one shared CXL region and a real
Redis-protocol index, vLLM's own ``Request``. The prefill hands off in ``kv_transfer_params``;
the decode half waits for the named pages, loads them checked, and computes whatever is missing
when the prefill died, the pages went bad, or the index is down."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.request import Request

from pof_connector.adapters.vllm_scheduler import PoFScheduler
from pof_connector.adapters.vllm_worker import PoFWorker
from pof_connector.config import ConfigError, PofConfig
from pof_connector.index.server import RedisServer
from tests.adapters.test_vllm_safety import NO_AUDIT, P, geometry, scheduled, vllm_step, wait_for, worker

pytestmark = pytest.mark.vllm

PROMPT = list(range(500, 500 + 3 * P + 5))       # 3 full pages and a partial one
PREFILL_BLOCKS = list(range(1, 8))               # 7 blocks of P // 2 tokens hold the prompt
DECODE_BLOCKS = list(range(9, 16))


def node(name: str, url: str, region: str, runtime_dir: str, audit: dict[str, Any] = NO_AUDIT,
         **pd: Any) -> tuple[PoFScheduler, PoFWorker, list[torch.Tensor]]:
    cfg = PofConfig.from_mapping({"audit": audit, "node_id": name, "index_url": url,
                                  "runtime_dir": f"{runtime_dir}/{name}", "index_timeout_s": 0.2,
                                  "tiers": {"cxl": {"path": region, "size": "8MiB", "partitions": 2}},
                                  "pd": {"wait_s": 2.0, **pd}})
    w, kv = worker(cfg, geometry())
    return PoFScheduler(cfg, geometry()), w, kv


@pytest.fixture
def index(runtime_dir: str) -> Iterator[RedisServer]:
    server = RedisServer(Path(runtime_dir) / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def pd(index: RedisServer, shm_path: str, runtime_dir: str) -> Iterator[dict[str, Any]]:
    p = node("p", index.url, shm_path, runtime_dir)
    d = node("d", index.url, shm_path, runtime_dir)
    yield {"p": p, "d": d}
    for s, w, _ in (p, d):
        s.close()
        w.close()


def request(req_id: str, params: dict[str, Any] | None, tokens: list[int] = PROMPT) -> Request:
    r = Request(req_id, tokens, SamplingParams(max_tokens=1), None)
    r.kv_transfer_params = params
    return r


def prefill(scheduler: PoFScheduler, w: PoFWorker, req_id: str = "r") -> dict[str, Any]:
    """The prefill half: the whole prompt computed in one step, then vLLM's request_finished."""
    r = request(req_id, {"do_remote_decode": True})
    assert scheduler.matched_tokens(r, 0) == 0
    scheduler.after_alloc(r, PREFILL_BLOCKS, 0)
    assert vllm_step(scheduler, [w], scheduled([(r, PREFILL_BLOCKS, len(PROMPT))], [])) == set()
    handoff = scheduler.handoff(r)
    scheduler.finished(r.request_id)
    assert handoff is not None
    return handoff


def decode_load(scheduler: PoFScheduler, w: PoFWorker, params: dict[str, Any], n: int) -> set[int]:
    """The decode half's first step after get_num_new_matched_tokens answered ``n`` tokens."""
    r = request("r", params)
    scheduler.after_alloc(r, DECODE_BLOCKS, n)
    r.num_computed_tokens = n
    return vllm_step(scheduler, [w], scheduled([(r, DECODE_BLOCKS, len(PROMPT) - n)], []))


def test_prefill_hands_off_its_pool_pages_and_the_decode_loads_exactly_them(pd: dict[str, Any]) -> None:
    (ps, pw, pkv), (ds, dw, dkv) = pd["p"], pd["d"]
    handoff = prefill(ps, pw)
    assert handoff["do_remote_prefill"] is True and handoff["pof_tokens"] == 3 * P
    assert handoff["pof_node"] == "p" and handoff["remote_engine_id"] == "p" and handoff["remote_block_ids"] == []
    assert not ps.has_pending_work()            # nothing held: blocks are free, pages on the store thread
    wait_for(lambda: ds.matched_tokens(request("r", handoff), 0) == 3 * P)
    assert decode_load(ds, dw, handoff, 3 * P) == set()
    for layer in range(len(pkv)):                # the prompt's 6 full blocks, bit for bit
        assert torch.equal(dkv[layer][9:15], pkv[layer][1:7])


def test_a_decode_is_never_audited_though_an_ordinary_hit_on_the_same_pages_is(index: RedisServer, shm_path: str,
                                                                               runtime_dir: str) -> None:
    """An audited request computes its prefix: on a decode server, the whole prompt. With every hit
    audited the decode still loads the prefill's pages; a plain request for the same prompt on the
    same server is audited (0 tokens matched: the engine computes them and compares)."""
    ps, pw, _ = node("p", index.url, shm_path, runtime_dir)
    ds, dw, _ = node("d", index.url, shm_path, runtime_dir, audit={"sample_rate": 1.0})
    try:
        handoff = prefill(ps, pw)
        wait_for(lambda: ds.matched_tokens(request("r", handoff), 0) == 3 * P)
        assert decode_load(ds, dw, handoff, 3 * P) == set()
        ds.finished("r")
        assert ds.matched_tokens(request("plain", None), 0) == 0
    finally:
        for s, w in ((ps, pw), (ds, dw)):
            s.close()
            w.close()


def test_the_decode_waits_for_pages_the_prefill_has_not_published_yet(pd: dict[str, Any]) -> None:
    (ps, pw, _), (ds, dw, _) = pd["p"], pd["d"]
    early = {"do_remote_prefill": True, "pof_tokens": 3 * P}
    r = request("r", early)
    assert ds.matched_tokens(r, 0) is None           # "ask again next step": nothing in the index yet
    prefill(ps, pw)
    t0 = time.monotonic()
    while (n := ds.matched_tokens(r, 0)) is None:
        time.sleep(0.005)
    assert n == 3 * P and time.monotonic() - t0 < 1.5
    assert decode_load(ds, dw, early, n) == set()


def test_a_prefill_that_died_costs_the_wait_then_the_decode_computes(pd: dict[str, Any]) -> None:
    _, (ds, _, _) = pd["p"], pd["d"]
    r = request("r", {"do_remote_prefill": True, "pof_tokens": 3 * P, "pof_node": "p"})
    t0 = time.monotonic()
    while (n := ds.matched_tokens(r, 0)) is None:
        time.sleep(0.01)
        assert time.monotonic() - t0 < 5, "the decode half never stopped waiting"
    assert n == 0 and 2.0 <= time.monotonic() - t0 < 3.0      # pd.wait_s, then all computed here
    assert ds.matched_tokens(r, 0) == 0                        # asked again (preemption): no second wait


def test_pages_that_went_bad_before_the_decode_read_them_are_recomputed(pd: dict[str, Any]) -> None:
    """A page's slot reused (here: its bytes overwritten) between the decode's lookup and its read:
    the load's checks reject it and vLLM is told to recompute those blocks, never handed them."""
    (ps, pw, pkv), (ds, dw, dkv) = pd["p"], pd["d"]
    handoff = prefill(ps, pw)
    wait_for(lambda: ds.matched_tokens(request("r", handoff), 0) == 3 * P)
    assert pw.pool is not None
    tier = pw.pool.tiers[0]
    key = ps.pool.keys_for(PROMPT)[1]
    ref = tier.find(key, touch=False)
    assert ref is not None
    start = tier.slot_offset(ref.slot) + tier.spec.page_bytes - 64
    tier.region[start:start + 64] ^= 0x5A
    errors = decode_load(ds, dw, handoff, 3 * P)
    assert errors and errors <= set(range(11, 15))            # page 1 (blocks 11, 12) and what follows it
    assert not errors & {9, 10} and torch.equal(dkv[0][9:11], pkv[0][1:3])             # page 0 is good


def test_index_down_the_decode_computes_after_the_wait(pd: dict[str, Any], index: RedisServer) -> None:
    (ps, pw, _), (ds, _, _) = pd["p"], pd["d"]
    handoff = prefill(ps, pw)
    index.stop()
    r = request("r", handoff)
    t0 = time.monotonic()
    while (n := ds.matched_tokens(r, 0)) is None:
        time.sleep(0.01)
        assert time.monotonic() - t0 < 6, "the decode half never stopped waiting"
    assert n == 0


def test_a_held_prefill_keeps_vllm_stepping_until_its_pages_are_published(pd: dict[str, Any]) -> None:
    """A prefill that loaded part of its prompt from the pool holds its new pages for the verdict
    that comes with the next step: the connector asks vLLM for that step even when idle."""
    (ps, pw, _), _ = pd["p"], pd["d"]
    prefill(ps, pw, "first")
    wait_for(lambda: ps.matched_tokens(request("x", None), 0) == 3 * P)
    longer = PROMPT + list(range(9000, 9000 + P))
    r = Request("second", longer, SamplingParams(max_tokens=1), None)
    r.kv_transfer_params = {"do_remote_decode": True}
    assert ps.matched_tokens(r, 0) == 3 * P
    blocks = list(range(1, 10))
    ps.after_alloc(r, blocks, 3 * P)
    r.num_computed_tokens = 3 * P
    assert vllm_step(ps, [pw], scheduled([(r, blocks, len(longer) - 3 * P)], [])) == set()
    assert ps.handoff(r) is not None and ps.handoff(r)["pof_tokens"] == 4 * P  # type: ignore[index]
    ps.finished("second")
    assert ps.has_pending_work()                      # page 3 waits for its verdict
    vllm_step(ps, [pw], scheduled([], []))            # the empty step vLLM runs for it
    assert not ps.has_pending_work()
    keys = ps.pool.keys_for(longer)
    wait_for(lambda: ps.pool.lookup(keys).pages == 4)


def test_decode_saves_off_stores_nothing_of_a_decode_request(index: RedisServer, shm_path: str,
                                                             runtime_dir: str) -> None:
    ds, dw, _ = node("d", index.url, shm_path, runtime_dir, decode_saves=False)
    try:
        params = {"do_remote_prefill": True, "pof_tokens": P}
        r = request("r", params)
        t0 = time.monotonic()
        while ds.matched_tokens(r, 0) is None:
            assert time.monotonic() - t0 < 5
        ds.after_alloc(r, DECODE_BLOCKS, 0)
        meta = ds.build_meta(scheduled([(r, DECODE_BLOCKS, len(PROMPT))], []))
        assert meta.saves == []
    finally:
        ds.close()
        dw.close()


@pytest.mark.parametrize(("raw", "named"), [({"wait": 1}, "pd: unknown option 'wait'"),
                                            ({"wait_s": -1}, "pd.wait_s"), ({"decode_saves": 1}, "pd.decode_saves")])
def test_pd_config_errors_name_the_key(raw: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        PofConfig.from_mapping({"pd": raw})
