"""Issue 20's ways for wrong KV to reach vLLM with every check passing, each on the real connector
halves (real workers on vLLM-shaped CPU KV tensors, the real scheduler half, vLLM's own
``Request`` / ``LoRARequest`` / multimodal classes, a real Redis-protocol index). Each test failed
before its fix."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from pof_connector.adapters.vllm_geometry import VllmGeometry
from pof_connector.adapters.vllm_metadata import LoadJob, PoFConnectorMetadata, SaveJob
from pof_connector.adapters.vllm_scheduler import PoFScheduler
from pof_connector.adapters.vllm_worker import PoFWorker
from pof_connector.config import PofConfig
from pof_connector.index import Location
from pof_connector.index.server import RedisServer
from pof_connector.pages.keys import Namespace
from pof_connector.pages.layout import KIND_MHA, PageSpec
from tests.adapters.adversary_world import GpuShapedRegion

NO_AUDIT = {"sample_rate": 0}
"""Every pool hit loads (the audit's sampled recompute is tested in test_vllm_audit.py)."""

pytestmark = pytest.mark.vllm

H, N, D, LAYERS, BLOCKS = 2, 32, 32, 2, 16
P = 2 * N           # page_tokens: two blocks a page


def geometry(tp_size: int = 1, pp_size: int = 1) -> VllmGeometry:
    return VllmGeometry(model="m", kv_dtype="float32", kv_heads=H, head_dim=D, num_layers=LAYERS, is_mla=False,
                        block_size=N, page_tokens=P, tp_size=tp_size, pp_size=pp_size)


def config(runtime_dir: str, url: str, tiers: dict[str, Any]) -> PofConfig:
    return PofConfig.from_mapping({"audit": NO_AUDIT,
                                  "node_id": "a", "index_url": url, "runtime_dir": runtime_dir, "tiers": tiers})


def worker(cfg: PofConfig, geo: VllmGeometry, tp_rank: int = 0,
           pp_rank: int = 0) -> tuple[PoFWorker, list[torch.Tensor]]:
    w = PoFWorker(cfg, geo, tp_rank=tp_rank, pp_rank=pp_rank)
    kv = {f"model.layers.{i}.self_attn.attn": torch.randn(BLOCKS, H, N, 2 * D) for i in range(LAYERS)}
    w.register(kv)
    return w, list(kv.values())


def step(w: PoFWorker, meta: PoFConnectorMetadata) -> set[int]:
    """One forward as vLLM drives the worker half; returns the blocks reported as load errors."""
    w.track(meta)
    w.report_failed_blocks(meta.fail_blocks)
    w.prepare_saves(meta)
    w.start(meta)
    for name in w.layer_index:
        w.wait_layer(name)
        w.save_layer(name)
    w.end_step()
    assert w.pool is not None
    w.pool.flush()
    return w.take_load_errors()


def wait_for(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def request(req_id: str, tokens: list[int], **kw: Any) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=1), None, **kw)


@pytest.fixture
def index(runtime_dir: str) -> Iterator[RedisServer]:
    server = RedisServer(Path(runtime_dir) / "redis").start()
    yield server
    server.stop()


# ---- item 1: tensor parallelism -------------------------------------------------------------------

@pytest.mark.parametrize("medium", ["cxl", "cpu_dram"])
def test_tp_rank_1_loads_its_own_heads_not_rank_0s(medium: str, index: RedisServer, runtime_dir: str,
                                                    shm_path: str) -> None:
    """Two TP ranks of one server, each with its own KV heads. The scheduler plans with rank 0's
    keys and locations; rank 1 must end up with *its* heads — on one shared CXL region rank 1 used
    to receive rank 0's page (same key, every check passing), on private DRAM every load failed."""
    tiers = {"cxl": {"path": shm_path, "size": "8MiB", "partitions": 2}} if medium == "cxl" else \
        {"cpu_dram": {"size": "8MiB"}}
    cfg = config(runtime_dir, index.url, tiers)
    geo = geometry(tp_size=2)
    ranks = [worker(cfg, geo, tp_rank=r) for r in range(2)]
    scheduler = PoFScheduler(cfg, geo)
    try:
        keys = scheduler.pool.keys_for(list(range(2 * P)))        # what the scheduler plans with
        for w, _ in ranks:
            assert step(w, PoFConnectorMetadata(saves=[SaveJob("r1", keys, [[3, 4], [7, 8]])])) == set()
        stored = [[t[[3, 4, 7, 8]].clone() for t in kv] for _, kv in ranks]
        wait_for(lambda: scheduler.pool.lookup(keys).pages == 2)     # both ranks' first heartbeats
        found = scheduler.pool.lookup(keys)
        assert found.pages == 2 and {s.node for s in found.sources} == {"a"}
        for r, (w, kv) in enumerate(ranks):
            for t in kv:
                t.zero_()
            job = LoadJob("r2", keys, found.sources, [[10, 11], [12, 13]])
            assert step(w, PoFConnectorMetadata(loads=[job])) == set(), f"rank {r} failed its loads"
            for layer, t in enumerate(kv):
                assert torch.equal(t[10:14], stored[r][layer]), f"rank {r} got another rank's KV"
            assert w.pool is not None and w.pool.stats.get("lookups") == 0     # hits count once, at the scheduler
    finally:
        scheduler.close()
        for w, _ in ranks:
            w.close()


# ---- item 2: nothing computed on top of a failed load is stored ---------------------------------------

def test_pages_computed_on_a_failed_load_are_not_stored_until_vllm_rewinds(runtime_dir: str) -> None:
    cfg = PofConfig.from_mapping({"audit": NO_AUDIT,
                                  "node_id": "w", "index_url": "local", "runtime_dir": runtime_dir,
                                  "tiers": {"cpu_dram": {"size": "8MiB"}}})
    w, _ = worker(cfg, geometry())
    assert w.pool is not None
    try:
        keys = w.pool.keys_for(list(range(4 * P)))
        gone = Location("w", "cpu_dram", 0, 1)                     # a page evicted since the lookup
        load = LoadJob("r", keys[:1], [gone], [[0, 1]])
        # The same forward computes pages 1-2 on top of the failed page 0: wrong KV, right keys.
        saves = SaveJob("r", keys[1:3], [[2, 3], [4, 5]])
        assert step(w, PoFConnectorMetadata(loads=[load], saves=[saves])) == {0, 1}
        assert not any(w.pool.contains(k) for k in keys)
        # Async scheduling: the next step was planned before vLLM saw the failure.
        later = SaveJob("r", keys[3:4], [[6, 7]])
        step(w, PoFConnectorMetadata(saves=[later]))
        assert not w.pool.contains(keys[3])
        # Another request is not affected.
        step(w, PoFConnectorMetadata(saves=[SaveJob("other", keys[3:4], [[6, 7]])]))
        assert w.pool.contains(keys[3])
        # vLLM rewound "r" to the failed block and recomputes: its pages are stored again.
        again = SaveJob("r", keys[:3], [[0, 1], [2, 3], [4, 5]])
        step(w, PoFConnectorMetadata(saves=[again], rewound=["r"]))
        assert all(w.pool.contains(k) for k in keys[:3])
    finally:
        w.close()


def scheduled(new: list[tuple[Request, list[int], int]], cached: list[tuple[Request, int, int]]) -> Any:
    """vLLM's SchedulerOutput, as much of it as the scheduler half reads: ``new`` (request, blocks,
    tokens scheduled) computing from ``num_computed_tokens``, ``cached`` (request, tokens computed,
    tokens scheduled)."""
    num = {r.request_id: n for r, _, n in new}
    num.update({r.request_id: n for r, _, n in cached})
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, block_ids=(b,),
                                            num_computed_tokens=r.num_computed_tokens) for r, b, _ in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r.request_id for r, _, _ in cached],
                                              new_block_ids=[None] * len(cached), resumed_req_ids=set(),
                                              num_computed_tokens=[c for _, c, _ in cached]),
        num_scheduled_tokens=num)


def test_scheduler_saves_again_after_vllm_rewinds_a_failed_load(runtime_dir: str) -> None:
    """vLLM sets ``num_computed_tokens`` back to the first failed block; the pages from there on
    must be planned for saving again (they were dropped), and the worker told so."""
    cfg = PofConfig.from_mapping({"audit": NO_AUDIT,
                                  "node_id": "w", "index_url": "local", "runtime_dir": runtime_dir})
    scheduler = PoFScheduler(cfg, geometry())
    try:
        req = request("r", list(range(3 * P + 5)))
        scheduler.after_alloc(req, list(range(8)), 0)
        meta = scheduler.build_meta(scheduled([(req, list(range(8)), len(req.all_token_ids))], []))
        assert [len(s.keys) for s in meta.saves] == [3] and meta.rewound == []
        # The load of block 2 failed: vLLM rewinds to token 2 * N and schedules the rest again.
        meta = scheduler.build_meta(scheduled([], [(req, 2 * N, 3 * P + 5 - 2 * N)]))
        assert meta.rewound == ["r"]
        assert [k.digest for k in meta.saves[0].keys] == [k.digest for k in scheduler._chain(req).keys[1:3]]
        scheduler.finished("r")
        assert scheduler.build_meta(scheduled([], [])).finished == ["r"]
    finally:
        scheduler.close()


# ---- item 4: every input that changes KV is in the key ----------------------------------------------

@pytest.fixture
def stored_prompt(runtime_dir: str, index: RedisServer) -> Iterator[tuple[PoFScheduler, list[int]]]:
    """A base-model prompt of 4 pages whose pages sit in the pool, and the scheduler half."""
    cfg = config(runtime_dir, index.url, {"cpu_dram": {"size": "8MiB"}})
    w, _ = worker(cfg, geometry())
    scheduler = PoFScheduler(cfg, geometry())
    tokens = list(range(1000, 1000 + 4 * P + 1))
    keys = scheduler.pool.keys_for(tokens)
    step(w, PoFConnectorMetadata(saves=[SaveJob("base", keys, [[0, 1], [2, 3], [4, 5], [6, 7]])]))
    wait_for(lambda: scheduler.matched_tokens(request("base", tokens), 0) == 4 * P)   # w's first heartbeat
    yield scheduler, tokens
    scheduler.close()
    w.close()


def test_a_lora_request_does_not_hit_the_base_models_pages(stored_prompt: Any) -> None:
    scheduler, tokens = stored_prompt
    lora = LoRARequest("adapter", 1, "/adapters/a")
    assert scheduler.matched_tokens(request("l", tokens, lora_request=lora), 0) == 0
    salted = request("s", tokens, cache_salt="tenant")
    assert scheduler.matched_tokens(salted, 0) == 0
    assert scheduler.matched_tokens(request("b2", tokens), 0) == 4 * P


def test_pages_of_another_layer_count_are_never_found(stored_prompt: Any, runtime_dir: str,
                                                     index: RedisServer) -> None:
    """Issue 39, finding 6 (found on LMCache; the rule holds for every adapter): every field a page
    header is checked against is in the key, so no lookup finds a page its engine's loads refuse.
    The scheduler has only the model config: its keys name the geometry that config gives, and a
    worker whose KV tensors make pages of another (a layer the config does not count) is refused at
    start-up. It used to register, store pages of its own layer count under those keys, and have
    its scheduler find the other engine's pages, each load then refused by the header."""
    scheduler, tokens = stored_prompt
    other = PofConfig.from_mapping({"audit": NO_AUDIT,
                                  "node_id": "b", "index_url": index.url, "runtime_dir": runtime_dir,
                                    "tiers": {"cpu_dram": {"size": "8MiB"}}})
    extra_layer = PoFWorker(other, geometry(), tp_rank=0)
    kv = {f"model.layers.{i}.self_attn.attn": torch.randn(BLOCKS, H, N, 2 * D) for i in range(LAYERS + 1)}
    with pytest.raises(ValueError, match="keys would not match"):
        extra_layer.register(kv)
    extra_layer.close()
    # The scheduler's keys name the pages rank 0's worker writes (layers, segment bytes, tokens, kind).
    written = PageSpec(LAYERS, P * 2 * H * D * 4, P, KIND_MHA)
    assert scheduler.pool.spec == written
    assert scheduler.pool.namespace == Namespace("m", "float32", geometry().layout, written).digest
    deeper = PoFScheduler(config(runtime_dir, index.url, {"cpu_dram": {"size": "8MiB"}}),
                          replace(geometry(), num_layers=LAYERS + 1))
    try:
        assert deeper.matched_tokens(request("deeper", tokens), 0) == 0     # same node, model, dtype, tokens
    finally:
        deeper.close()
    assert scheduler.matched_tokens(request("same", tokens), 0) == 4 * P


def test_a_request_vllm_cannot_schedule_yet_is_not_looked_up_every_step(stored_prompt: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM asks again each step for the request at the head of a queue blocked on KV memory."""
    from pof_connector.adapters import vllm_scheduler

    scheduler, tokens = stored_prompt
    calls: list[int] = []
    real = scheduler.pool.lookup
    monkeypatch.setattr(scheduler.pool, "lookup", lambda keys, **kw: calls.append(len(keys)) or real(keys, **kw))
    waiting = request("waiting", tokens)
    assert [scheduler.matched_tokens(waiting, 0) for _ in range(5)] == [4 * P] * 5
    assert calls == [4]
    assert scheduler.matched_tokens(waiting, P) == 3 * P        # more tokens cached locally: a new question
    assert calls == [4, 3]
    monkeypatch.setattr(vllm_scheduler, "LOOKUP_REUSE_S", 0.0)  # the answer aged out
    assert scheduler.matched_tokens(waiting, P) == 3 * P and calls == [4, 3, 3]
    scheduler.finished("waiting")
    assert "waiting" not in scheduler._looked


def test_multimodal_pages_from_the_first_placeholder_on_are_never_shared(stored_prompt: Any) -> None:
    """Two prompts with the same placeholder ids but different images have the same tokens; only
    the pages before the first placeholder hold KV that the tokens alone determine."""
    scheduler, tokens = stored_prompt
    image = MultiModalFeatureSpec(data=None, modality="image", identifier="img-a",
                                  mm_position=PlaceholderRange(offset=2 * P + 10, length=50))
    assert scheduler.matched_tokens(request("mm", tokens, mm_features=[image]), 0) == 2 * P
    embeds = request("e", tokens, prompt_embeds=torch.zeros(len(tokens), 8))
    assert scheduler.matched_tokens(embeds, 0) == 0


def test_pipeline_stages_have_keys_and_nodes_of_their_own(runtime_dir: str) -> None:
    cfg = PofConfig.from_mapping({"audit": NO_AUDIT,
                                  "node_id": "a", "index_url": "local", "runtime_dir": runtime_dir})
    one, two = geometry(), geometry(pp_size=2)
    # A single stage keeps the namespace every other engine computes (cross-engine sharing).
    assert one.namespace(cfg, 0) == Namespace("m", "float32", one.layout, one.spec).digest
    assert two.namespace(cfg, 0, 0) != two.namespace(cfg, 0, 1)
    assert len({two.namespace(cfg, t, p) for t in (0, 1) for p in (0, 1)}) == 4
    assert [two.node_id(cfg, t, p) for t in (0, 1) for p in (0, 1)] == ["a", "a-pp1", "a-tp1", "a-tp1-pp1"]


# ---- issue 39: a page is published only when no rank and no sharer computed on a failed load ---------

def vllm_step(scheduler: PoFScheduler, workers: list[PoFWorker], so: Any) -> set[int]:
    """One engine step as vLLM drives both halves: the plan, every rank's forward, then the
    aggregated output handed back to the scheduler half. (vLLM's base connector answers ``None``
    for the worker's report and ignores the output: so does a connector without these hooks.)"""
    meta = scheduler.build_meta(so)
    invalid: set[int] = set()
    reports = []
    for w in workers:
        invalid |= step(w, meta)
        reports.append(getattr(w, "report", lambda: None)())
    report = reports[0]
    for more in reports[1:]:
        report = report.aggregate(more) if report is not None and more is not None else report
    update = getattr(scheduler, "update_output", None)
    if update is not None:
        update(KVConnectorOutput(invalid_block_ids=invalid, kv_connector_worker_meta=report))
    return invalid


def test_a_page_rank_0_computed_while_rank_1_failed_a_load_is_never_published(runtime_dir: str,
                                                                              index: RedisServer) -> None:
    """TP = 2: rank 1 lacks a page rank 0 has. Both compute the step's new pages (attention's
    all-reduce mixes rank 1's garbage into every rank's tokens), so rank 0's new page is wrong
    under its right key: it must not reach the pool, on any rank."""
    cfg = config(runtime_dir, index.url, {"cpu_dram": {"size": "8MiB"}})
    geo = geometry(tp_size=2)
    ranks = [worker(cfg, geo, tp_rank=r)[0] for r in range(2)]
    scheduler = PoFScheduler(cfg, geo)
    try:
        tokens = list(range(3 * P + 7))
        keys = scheduler.pool.keys_for(tokens)
        for w in ranks:          # pages 0 and 1 stored by both ranks, published
            step(w, PoFConnectorMetadata(saves=[SaveJob("first", keys[:2], [[0, 1], [2, 3]])]))
        wait_for(lambda: scheduler.pool.lookup(keys[:2]).pages == 2)
        assert ranks[1].pool is not None and ranks[1].pool.tiers[0].remove(ranks[1]._own_keys(keys)[1])
        req = request("r", tokens)
        blocks = list(range(4, 12))
        assert scheduler.matched_tokens(req, 0) == 2 * P
        scheduler.after_alloc(req, blocks, 2 * P)
        req.num_computed_tokens = 2 * P
        invalid = vllm_step(scheduler, ranks, scheduled([(req, blocks, len(tokens) - 2 * P)], []))
        assert invalid == {6, 7}                                  # rank 1's page 1
        vllm_step(scheduler, ranks, scheduled([], []))            # the next plan carries the verdict
        for r, w in enumerate(ranks):
            assert w.pool is not None
            own = w._own_keys(keys)
            w.pool.flush()
            assert not w.pool.contains(own[2]), f"rank {r} stored a page computed on rank 1's failed load"
            assert w.pool.lookup(own[2:3], count=False).pages == 0
        assert ranks[0].pool is not None and ranks[0].pool.stats.get("dropped_pages") == 1
    finally:
        scheduler.close()
        for w in ranks:
            w.close()


def test_a_request_sharing_a_block_whose_load_failed_publishes_nothing_computed_on_it(
        runtime_dir: str, index: RedisServer) -> None:
    """R1 loads pages 0-1; R2, scheduled in the same step, shares page 1's blocks through vLLM's
    prefix cache and computes its own page 2 on top of them. R1's load of page 1 fails: vLLM
    rewinds both (``_update_requests_with_invalid_blocks`` scans shared blocks); R2's page 2 is
    wrong under its right key and must not be published."""
    cfg = config(runtime_dir, index.url, {"cpu_dram": {"size": "8MiB"}})
    w, _ = worker(cfg, geometry())
    scheduler = PoFScheduler(cfg, geometry())
    try:
        shared = list(range(2 * P))
        first = scheduler.pool.keys_for(shared)
        step(w, PoFConnectorMetadata(saves=[SaveJob("first", first, [[0, 1], [2, 3]])]))
        wait_for(lambda: scheduler.pool.lookup(first).pages == 2)
        r1 = request("r1", shared + list(range(5000, 5000 + P + 3)))
        r2 = request("r2", shared + list(range(7000, 7000 + P + 3)))
        b1 = [4, 5, 6, 7, 8, 9]
        assert scheduler.matched_tokens(r1, 0) == 2 * P
        scheduler.after_alloc(r1, b1, 2 * P)
        r1.num_computed_tokens = 2 * P
        b2 = [*b1[:4], 10, 11]                 # vLLM's prefix cache: r1's blocks of pages 0-1
        assert scheduler.matched_tokens(r2, 2 * P) == 0
        scheduler.after_alloc(r2, b2, 0)
        r2.num_computed_tokens = 2 * P
        assert w.pool is not None and w.pool.tiers[0].remove(first[1])     # evicted after the lookup
        so = scheduled([(r1, b1, P + 3), (r2, b2, P + 3)], [])
        assert vllm_step(scheduler, [w], so) == {6, 7}
        vllm_step(scheduler, [w], scheduled([], []))
        w.pool.flush()
        r2_page = scheduler.pool.keys_for(r2.all_token_ids)[2]
        assert not w.pool.contains(r2_page), "r2's page computed on the failed block was stored"
        assert scheduler.pool.lookup([*first[:2], r2_page]).pages < 3      # (page 1 is still indexed)
    finally:
        scheduler.close()
        w.close()


def test_held_pages_of_a_clean_step_are_published_and_readable_in_the_next_step(
        runtime_dir: str, index: RedisServer) -> None:
    """The price of holding: nothing. A step that loads stores its new pages held; the verdict
    in the next plan publishes them, and the scheduler may plan that same step's loads from them
    (the engine went idle in between: no third step came to publish them)."""
    cfg = config(runtime_dir, index.url, {"cpu_dram": {"size": "8MiB"}})
    w, _ = worker(cfg, geometry())
    scheduler = PoFScheduler(cfg, geometry())
    try:
        head = list(range(2 * P))
        first = scheduler.pool.keys_for(head)
        step(w, PoFConnectorMetadata(saves=[SaveJob("first", first[:1], [[0, 1]])]))
        wait_for(lambda: scheduler.pool.lookup(first[:1]).pages == 1)
        r1 = request("r1", head + [9] * 3)
        b1 = [2, 3, 4, 5, 6]
        assert scheduler.matched_tokens(r1, 0) == P
        scheduler.after_alloc(r1, b1, P)
        r1.num_computed_tokens = P
        assert vllm_step(scheduler, [w], scheduled([(r1, b1, P + 3)], [])) == set()
        assert w.pool is not None and not w.pool.finder.lookup(first[1:2], count=False).pages   # held
        scheduler.finished("r1")
        r2 = request("r2", head + [8] * 5)
        assert scheduler.matched_tokens(r2, 0) == 2 * P            # page 1 approved, not yet published
        b2 = [7, 8, 9, 10, 11]
        scheduler.after_alloc(r2, b2, 2 * P)
        r2.num_computed_tokens = 2 * P
        assert vllm_step(scheduler, [w], scheduled([(r2, b2, 5)], [])) == set()
        wait_for(lambda: scheduler.pool.lookup(first).pages == 2)   # and the index has it now
    finally:
        scheduler.close()
        w.close()


# ---- issue 39, finding 1: a check verifies the bytes copied into the engine -----------------------------

@pytest.mark.parametrize("copy", ["fused", "strided"])
def test_each_page_of_a_multi_page_load_through_a_copied_region_lands_in_its_own_blocks(
        copy: str, runtime_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three pages loaded from a region read through a host copy (a GPU peer region's shape): each
    page's blocks must hold that page, every page must pass, and none of this node's good pages may
    be dropped. Before the fix the layer's views aliased one scratch buffer: the strided copy put
    page 2 into page 0's blocks with every check passing (the check re-read the source); the fused
    copy failed pages 0-1 as corrupt and withdrew them."""
    from pof_connector.adapters.vllm_layout import BlockLayout
    from pof_connector.tiers import peer_hbm

    monkeypatch.setattr(peer_hbm, "PeerHbmTier", GpuShapedRegion)
    if copy == "strided":
        monkeypatch.setattr(BlockLayout, "can_copy_checked", lambda self, kv: False)
    cfg = PofConfig.from_mapping({"audit": NO_AUDIT,
                                  "node_id": "g", "index_url": "local", "runtime_dir": runtime_dir,
                                  "tiers": {"peer_hbm": {"device": "cpu", "size": "8MiB"}}})
    w, kv = worker(cfg, geometry())
    assert w.pool is not None and isinstance(w.pool.tiers[0], GpuShapedRegion)
    try:
        keys = w.pool.keys_for(list(range(3 * P)))
        step(w, PoFConnectorMetadata(saves=[SaveJob("s", keys, [[0, 1], [2, 3], [4, 5]])]))
        stored = [t[:6].clone() for t in kv]
        for t in kv:
            t[6:12] = 0
        load = LoadJob("r", keys, w.pool.lookup(keys).sources, [[6, 7], [8, 9], [10, 11]])
        assert step(w, PoFConnectorMetadata(loads=[load])) == set()
        for layer, t in enumerate(kv):
            for page in range(3):
                got, want = t[6 + 2 * page:8 + 2 * page], stored[layer][2 * page:2 * page + 2]
                assert torch.equal(got, want), f"layer {layer}: page {page}'s blocks hold another page"
        assert w.pool.lookup(keys).pages == 3, "good pages were dropped as corrupt"
    finally:
        w.close()


# ---- issue 39, finding 2: nothing writes into an accepted block ------------------------------------------

def test_no_late_copy_helper_writes_into_blocks_after_their_check(runtime_dir: str, shm_path: str) -> None:
    """Another node's pages in a shared CXL region, loaded with the native copy crew while a
    helper is stalled after claiming a page (``POF_CREW_STALL_US``); the owner rewrites its slots
    once the forward read the blocks. Before the fix the helper woke and copied the new bytes into
    blocks that had passed every check (4 blocks in 3 rounds, 2 pages copied again for late
    helpers); now a helper never writes a page the caller took over."""
    import json
    import subprocess
    import sys

    from pof_connector.pages import page_sum

    assert page_sum.NATIVE is not None, "the native kernel must be built (pip install -e .)"
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "tests.adapters.late_helper_case", "--shm", shm_path,
                          "--runtime", runtime_dir], cwd=root, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "POF_CREW_STALL_US": "200000", "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["differing_blocks"] == 0, got
