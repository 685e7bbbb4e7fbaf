"""PoFHiCacheStorage through SGLang's real factory, config and host KV pools (on the CPU).

SGLang cannot serve a model on this CPU machine (its kernels need CUDA), so its HiCache
controller is what these tests stand in for: they call the backend the way the controller does
(batch_exists with all page keys, batch_set_v1 / batch_get_v1 with token-level host indices).
Everything else is real: sglang's classes, its page keys, pof's pool and a Redis-protocol index.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo as Info
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str, get_storage_hash_str

from pof_connector.adapters import sglang as sglang_adapter
from pof_connector.adapters.sglang import PoFHiCacheStorage
from pof_connector.index.redis import flat_key, loc_key, segment_key
from pof_connector.index.server import RedisServer
from pof_connector.pages.keys import Namespace

pytestmark = pytest.mark.sglang

PS, L, H, D = 4, 3, 2, 8


def host_pool(kind: str, layout: str, dtype: torch.dtype = torch.bfloat16, ps: int = PS, layers: int = L,
              heads: int = H, dim: int = D, tokens: int = 64) -> Any:
    """A real SGLang host pool on the CPU (ENGINES.md recipe)."""
    with host_memory_budget_scope(1 << 30):
        if kind == "mha":
            dev = MHATokenToKVPool(size=tokens, page_size=ps, dtype=dtype, head_num=heads, head_dim=dim,
                                   layer_num=layers, device="cpu", enable_memory_saver=False)
            return MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, ps, layout,
                                        pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                                        start_layer=dev.start_layer, end_layer=dev.end_layer)
        dev = MLATokenToKVPool(size=tokens, page_size=ps, dtype=dtype, kv_lora_rank=12, qk_rope_head_dim=4,
                               layer_num=layers, device="cpu", enable_memory_saver=False)
        return MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, ps, layout,
                                    pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                                    start_layer=dev.start_layer, end_layer=dev.end_layer, target_layer_num=layers)


def storage_config(extra: dict[str, Any], *, mla: bool = False, tp_rank: int = 0, tp_size: int = 1,
                   pp_rank: int = 0, pp_size: int = 1, cp_size: int = 1,
                   layout: str = "page_first_direct", model: str = "tests/model", **more: Any) -> HiCacheStorageConfig:
    cfg = {"backend_name": "pof", "module_path": "pof_connector.adapters.sglang",
           "class_name": "PoFHiCacheStorage", "interface_v1": 1, **extra}
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, attn_cp_rank=0,
                                attn_cp_size=cp_size, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=layout == "page_first", model_name=model, extra_config=cfg,
                                **more)


def backend(pool: Any, extra: dict[str, Any], **kw: Any) -> PoFHiCacheStorage:
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra, **kw), pool)
    b.register_mem_pool_host(pool)
    b.on_host_pools_registered()
    assert isinstance(b, PoFHiCacheStorage)
    return b


def page_keys(tokens: list[int], ps: int = PS, salt: str | None = None) -> list[str]:
    class Key:     # what SGLang passes: token ids with optional extra_key / cache_salt
        def __init__(self) -> None:
            self.token_ids, self.extra_key, self.cache_salt = tokens, None, salt

        def __len__(self) -> int:
            return len(tokens)

    if salt is None:
        return list(get_hash_str(tokens, None, page_size=ps))
    return list(get_storage_hash_str(Key(), None, page_size=ps))


def indices(pages: list[int], ps: int = PS) -> torch.Tensor:
    return torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in pages]).to(torch.int64)


def fill(pool: Any, pages: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in pages:
        flat = pool.get_data_page(p * pool.page_size, flat=True)
        pool.set_from_flat_data_page(p * pool.page_size, torch.randn(flat.shape, generator=g).to(flat.dtype))


def same_pages(pool: Any, a: list[int], b: list[int]) -> bool:
    return all(torch.equal(pool.get_data_page(x * pool.page_size, flat=True),
                           pool.get_data_page(y * pool.page_size, flat=True)) for x, y in zip(a, b, strict=True))


@pytest.fixture
def extra(runtime_dir: str, redis_server: RedisServer) -> dict[str, Any]:
    return {"node_id": "s1", "index_url": redis_server.url, "runtime_dir": runtime_dir,
            "tiers": {"cpu_dram": {"size": "64MiB"}}}


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_v1_round_trip_through_the_factory(kind: str, layout: str, extra: dict[str, Any]) -> None:
    pool = host_pool(kind, layout)
    b = backend(pool, extra, mla=kind == "mla", layout=layout)
    try:
        keys = page_keys(list(range(100, 100 + 3 * PS)))
        fill(pool, [2, 3, 4], seed=1)
        assert b.batch_exists(keys) == 0
        assert b.batch_set_v1(keys, indices([2, 3, 4])) == [True, True, True]
        assert b.batch_exists(keys) == 3 and b.batch_exists([*keys[:2], "00" * 32]) == 2
        assert b.batch_get_v1(keys, indices([9, 10, 11])) == [True, True, True]
        assert same_pages(pool, [2, 3, 4], [9, 10, 11])
        # The legacy interface reads and writes the same canonical pages.
        got = b.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
        assert all(g is not None and torch.equal(g, pool.get_data_page(p * PS, flat=True))
                   for g, p in zip(got, [2, 3, 4], strict=True))
        other = page_keys(list(range(500, 500 + PS)))
        fill(pool, [5], seed=2)
        assert b.batch_set(other, [pool.get_data_page(5 * PS, flat=True)])
        assert b.batch_get_v1(other, indices([12])) == [True] and same_pages(pool, [5], [12])
        assert b.get_stats() is None
    finally:
        b.close()


def test_keys_are_sglangs_own_and_salted(extra: dict[str, Any]) -> None:
    pool = host_pool("mha", "page_first")
    b = backend(pool, extra, layout="page_first")
    try:
        tokens = list(range(7, 7 + 2 * PS))
        fill(pool, [1, 2], seed=3)
        assert b.batch_set_v1(page_keys(tokens, salt="tenant-a"), indices([1, 2])) == [True, True]
        assert b.batch_exists(page_keys(tokens, salt="tenant-a")) == 2
        assert b.batch_exists(page_keys(tokens, salt="tenant-b")) == 0       # another salt: no hit
        assert b.batch_exists(page_keys(tokens)) == 0
    finally:
        b.close()


def test_tp_ranks_keep_distinct_keys_and_mla_shares(extra: dict[str, Any]) -> None:
    keys = page_keys(list(range(40, 40 + PS)))
    pools = [host_pool("mha", "page_first_direct") for _ in range(2)]
    ranks = [backend(p, extra, tp_rank=r, tp_size=2) for r, p in enumerate(pools)]
    try:
        fill(pools[0], [1], seed=4)
        assert ranks[0].batch_set_v1(keys, indices([1])) == [True]
        assert ranks[0].batch_exists(keys) == 1 and ranks[1].batch_exists(keys) == 0   # rank 1's heads differ
    finally:
        for r in ranks:
            r.close()
    mla_pools = [host_pool("mla", "page_first_direct") for _ in range(2)]
    mla = [backend(p, {**extra, "node_id": f"m{r}"}, mla=True, tp_rank=r, tp_size=2)
           for r, p in enumerate(mla_pools)]
    try:
        fill(mla_pools[0], [1], seed=5)
        assert mla[0].batch_set_v1(keys, indices([1])) == [True]                 # only the writer rank stores
        assert mla[1].batch_exists(keys) == 0       # m0's DRAM is not m1's: found in the index, not readable
    finally:
        for m in mla:
            m.close()


def test_mla_ranks_are_nodes_of_their_own_and_read_rank_0_from_a_shared_region(extra: dict[str, Any],
                                                                             shm_path: str) -> None:
    """Issue 20, items 4 and 7: MLA ranks of one server (one extra config, one node_id) shared a pool
    node id, so rank 1 took rank 0's pages for its own, offered them and failed every load. Each rank
    is now a node: rank 1 reads what rank 0 stored from a tier both map, and offers nothing it
    cannot read (private DRAM, no fabric: SGLang's minimum over the TP group is then 0 on all ranks)."""
    keys = page_keys(list(range(80, 80 + 2 * PS)))
    cxl = {**extra, "tiers": {"cxl": {"path": shm_path, "size": "16MiB", "partitions": 2}}}
    for tiers, readable in ((cxl, True), (extra, False)):
        pools = [host_pool("mla", "page_first_direct") for _ in range(2)]
        ranks = [backend(p, tiers, mla=True, tp_rank=r, tp_size=2) for r, p in enumerate(pools)]
        try:
            fill(pools[0], [1, 2], seed=9)
            assert ranks[0].batch_set_v1(keys, indices([1, 2])) == [True, True]    # SGLang: only rank 0 stores
            if readable:
                assert ranks[1].batch_exists(keys) == 2
                assert ranks[1].batch_get_v1(keys, indices([6, 7])) == [True, True]
                assert all(torch.equal(pools[0].get_data_page(a * PS, flat=True),
                                       pools[1].get_data_page(b * PS, flat=True)) for a, b in ((1, 6), (2, 7)))
            else:
                assert ranks[1].batch_exists(keys) == 0
                assert ranks[1].pool is not None and ranks[1].pool.stats.get("load_failures", reason="evicted") == 0
            assert [r.pool.node_id for r in ranks if r.pool is not None] == ["s1-tp0", "s1-tp1"]
            assert ranks[0].namespace == ranks[1].namespace         # the latent is the same on every rank
        finally:
            for r in ranks:
                r.close()


def test_pp_stages_keep_distinct_keys_and_node_ids(extra: dict[str, Any], shm_path: str) -> None:
    """Issue 20, item 4: PP stages with equal layer counts hold different layers' KV for the same
    tokens. Neither the namespace nor the node id had the stage: two hosts' stage 0 and stage 1
    sharing a CXL region served stage 0's page to stage 1 with every check passing."""
    keys = page_keys(list(range(70, 70 + PS)))
    cxl = {**extra, "tiers": {"cxl": {"path": shm_path, "size": "16MiB", "partitions": 2}}}
    pools = [host_pool("mha", "page_first_direct") for _ in range(2)]
    stages = [backend(p, {**cxl, "node_id": f"h{r}"}, pp_rank=r, pp_size=2) for r, p in enumerate(pools)]
    try:
        fill(pools[0], [1], seed=8)
        fill(pools[1], [5], seed=10)
        assert stages[0].batch_set_v1(keys, indices([1])) == [True]
        assert stages[1].batch_exists(keys) == 0
        assert stages[1].batch_get_v1(keys, indices([5])) == [False]
        assert not torch.equal(pools[0].get_data_page(1 * PS, flat=True), pools[1].get_data_page(5 * PS, flat=True))
        assert [s.pool.node_id for s in stages if s.pool is not None] == ["h0-pp0", "h1-pp1"]
        assert stages[0].namespace != stages[1].namespace
    finally:
        for s in stages:
            s.close()
    one = host_pool("mha", "page_first_direct")
    b = backend(one, extra, tp_rank=1, tp_size=2, pp_rank=1, pp_size=2)
    try:
        assert b.pool is not None and b.pool.node_id == "s1-tp1-pp1"
    finally:
        b.close()


def test_an_engine_with_another_layer_count_finds_nothing(extra: dict[str, Any], shm_path: str) -> None:
    """Issue 39, finding 6 (found on LMCache; the rule holds for every adapter): every field a page
    header is checked against is in the key. Two hosts sharing a CXL region, same model, dtype and
    page size, one layer apart: the second neither counts nor loads the first's pages."""
    keys = page_keys(list(range(90, 90 + 2 * PS)))
    cxl = {**extra, "tiers": {"cxl": {"path": shm_path, "size": "16MiB", "partitions": 2}}}
    pools = [host_pool("mha", "page_first_direct", layers=layers) for layers in (L, L - 1)]
    engines = [backend(p, {**cxl, "node_id": f"h{i}"}) for i, p in enumerate(pools)]
    try:
        fill(pools[0], [1, 2], seed=11)
        assert engines[0].batch_set_v1(keys, indices([1, 2])) == [True, True]
        assert engines[0].batch_exists(keys) == 2
        assert engines[1].batch_exists(keys) == 0
        assert engines[1].batch_get_v1(keys, indices([5, 6])) == [False, False]
        for e in engines:           # the namespace is built from the pages' own spec
            assert e.pool is not None and e.pages is not None and e.pool.spec == e.pages.spec
            assert e.namespace == Namespace("tests/model", "bfloat16", e.pages.layout_name, e.pool.spec).digest
    finally:
        for e in engines:
            e.close()


def test_prefix_keys_place_pages_in_segments_as_vllm_does(extra: dict[str, Any], shm_path: str,
                                                          redis_server: RedisServer) -> None:
    """With ``hicache_storage_pass_prefix_keys`` SGLang tells each call the chain's pages before its
    keys: pof places the keys, so the index keeps SGLang's pages in segments where vLLM's lookups
    (placed) find them, and SGLang finds vLLM's (or its own) anywhere in a chain, not only from its
    start. Two nodes share a CXL region: the reader finds the writer's pages through the index."""
    keys = page_keys(list(range(10, 10 + 40 * PS)))
    cxl = {**extra, "tiers": {"cxl": {"path": shm_path, "size": "16MiB", "partitions": 2}}}
    pools = [host_pool("mha", "page_first_direct", tokens=256) for _ in range(2)]
    writer, reader = (backend(p, {**cxl, "node_id": f"h{r}"}) for r, p in enumerate(pools))
    raw = redis.Redis(unix_socket_path=str(redis_server.socket))
    try:
        fill(pools[0], list(range(1, 41)), seed=12)
        assert writer.batch_set_v1(keys[:20], indices(list(range(1, 21))), Info(prefix_keys=[])) == [True] * 20
        assert writer.batch_set_v1(keys[20:], indices(list(range(21, 41))), Info(prefix_keys=keys[:20])) == [True] * 20
        deadline = time.monotonic() + 10
        while reader.batch_exists(keys, Info(prefix_keys=[])) < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
        ns = writer.namespace
        assert raw.hlen(segment_key(ns)) == 3 and raw.hlen(loc_key(ns)) == 0      # segments 0, 16, 32
        assert not raw.exists(flat_key(loc_key(ns)))
        assert reader.batch_exists(keys[20:], Info(prefix_keys=keys[:20])) == 20
        assert reader.batch_get_v1(keys[20:], indices(list(range(50, 70))), Info(prefix_keys=keys[:20])) == [True] * 20
        assert all(torch.equal(pools[0].get_data_page(a * PS, flat=True), pools[1].get_data_page(b * PS, flat=True))
                   for a, b in zip(range(21, 41), range(50, 70), strict=True))
        # Without prefix keys a read takes its keys as the chain's start: here a wrong guess, a miss.
        assert reader.batch_exists(keys[20:]) == 0
        assert reader.batch_exists(keys) == 40
        # A store without them is never guessed: its pages go to per-page fields, flagged.
        other = page_keys(list(range(3000, 3000 + 2 * PS)))
        assert writer.batch_set_v1(other, indices([1, 2])) == [True, True]
        deadline = time.monotonic() + 10
        while reader.batch_exists(other) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert raw.hlen(loc_key(ns)) == 2 and raw.exists(flat_key(loc_key(ns)))
        assert reader.batch_exists(other) == 2
    finally:
        writer.close()
        reader.close()


def test_the_example_config_goes_through_sglangs_parser(runtime_dir: str, shm_path: str,
                                                         redis_server: RedisServer) -> None:
    """examples/sglang/pof-hicache.json as SGLang reads it (``--hicache-storage-backend-extra-config
    @FILE``): SGLang takes its own keys (prefix keys on) and the rest starts pof."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    example = Path(__file__).resolve().parents[2] / "examples/sglang/pof-hicache.json"
    cfg, threshold, _, _, pass_prefix_keys = HybridCacheController.parse_storage_backend_extra_config(f"@{example}")
    assert pass_prefix_keys is True and threshold == 64
    cfg = {**cfg, "index_url": redis_server.url, "runtime_dir": runtime_dir,
           "tiers": {"cxl": {**cfg["tiers"]["cxl"], "path": shm_path, "size": "16MiB"}, "cpu_dram": {"size": "16MiB"}}}
    b = backend(host_pool("mha", "page_first_direct"), cfg)     # SGLang's loader keys too, as it passes them
    try:
        assert b.pool is not None and b.pool.node_id == "sglang-a"
    finally:
        b.close()


def test_a_timed_out_store_keeps_its_staging_buffer(extra: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 20, item 3: a store that timed out gave its staging buffer back while the write was
    still queued; the next store filled the buffer with its page, and the late write stored and
    checksummed that page under the first key. The buffer now goes back only when the write is done."""
    monkeypatch.setattr(sglang_adapter, "STORE_TIMEOUT_S", 0.2)
    pool = host_pool("mha", "page_first_direct")
    b = backend(pool, extra)
    stall = threading.Event()
    try:
        assert b.pool is not None
        b.pool.placement.submit(stall.wait, 30)     # the store thread is stuck (as behind a spill to a cut peer)
        k1, k2 = page_keys(list(range(1, 1 + PS))), page_keys(list(range(900, 900 + PS)))
        fill(pool, [1, 2], seed=7)
        assert b.batch_set_v1(k1, indices([1])) == [False]        # timed out: SGLang hears it failed
        assert b.batch_set_v1(k2, indices([2])) == [False]        # wants staging of the same size
        stall.set()
        b.pool.flush()
        got = b.batch_get_v1(k1, indices([9]))
        assert got == [False] or same_pages(pool, [1], [9])       # k1's own bytes or a miss, never k2's
        assert got == [True]                                      # the late write landed, from its own buffer
        assert b.batch_set_v1(k2, indices([2])) == [True]         # the stall is over: stores go through again
        assert b.batch_get_v1(k2, indices([10])) == [True] and same_pages(pool, [2], [10])
        assert b.staging.idle_bytes > 0                           # and every buffer came back
    finally:
        stall.set()
        b.close()


def test_context_parallelism_is_refused(extra: dict[str, Any]) -> None:
    """CP and DCP ranks hold different slices of a page under one SGLang key (issue 20, item 4)."""
    from pof_connector.config import ConfigError

    with pytest.raises(ConfigError, match="attn_cp_size is 2"):
        backend(host_pool("mla", "page_first_direct"), extra, mla=True, cp_size=2)
    with pytest.raises(ConfigError, match="dcp_size is 2"):
        backend(host_pool("mla", "page_first_direct"), extra, mla=True, tp_rank=1, tp_size=2,
                dcp_size=2, dcp_rank=1, logical_page_size=PS)


def test_attention_dp_ranks_are_nodes_of_their_own(extra: dict[str, Any]) -> None:
    pools = [host_pool("mha", "page_first_direct") for _ in range(2)]
    ranks = [backend(p, extra, dp_rank=r) for r, p in enumerate(pools)]     # attention TP 1 in each DP group
    try:
        assert [r.pool.node_id for r in ranks if r.pool is not None] == ["s1", "s1-dp1"]
        assert ranks[0].namespace == ranks[1].namespace          # same heads: they share pages
    finally:
        for r in ranks:
            r.close()


def test_failures_are_misses_never_exceptions(runtime_dir: str, shm_path: str) -> None:
    region = shm_path
    extra = {"node_id": "s1", "index_url": f"unix://{runtime_dir}/nothing.sock", "runtime_dir": runtime_dir,
             "tiers": {"cxl": {"path": region, "size": "16MiB", "partitions": 2}}}
    pool = host_pool("mha", "page_first_direct")
    b = backend(pool, extra)
    try:
        keys = page_keys(list(range(60, 60 + 2 * PS)))
        fill(pool, [1, 2], seed=6)
        assert b.batch_set_v1(keys, indices([1, 2])) == [True, True]       # the index is down: local books
        assert b.batch_exists(keys) == 2
        assert b.pool is not None
        deadline = time.monotonic() + 5      # the failing index calls run on the pool's own threads
        while b.pool.stats.get("index_errors") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b.pool.stats.get("index_errors") >= 1
        tier = b.pool.tiers[0]                                              # corrupt page 2 in the region
        ref = tier.find(b._keys(keys, None, reading=False)[1])
        assert ref is not None
        tier.region[tier.slot_offset(ref.slot) + b.pool.spec.segment_offset(1) + 5] ^= 0xFF
        assert b.batch_get_v1(keys, indices([5, 6])) == [True, False]
        assert b.pool.stats.get("load_failures", reason="bad_checksum") == 1
        assert b.batch_exists(keys) == 1                                    # the corrupt page was dropped
        os.unlink(region)                                                   # the tier's file disappears
        b.pool.heartbeat()
        assert b.batch_exists(keys) == 0 and b.pool.stats.get("tier_errors", tier="cxl") == 1
        assert b.batch_get_v1(keys, indices([5, 6])) == [False, False]
        assert b.batch_set_v1(["zz"], indices([7])) == [False]              # a malformed key: a miss
        assert b.pool.stats.get("adapter_errors", hook="batch_set_v1") == 1
    finally:
        b.close()
    unregistered = StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool)
    assert unregistered.batch_exists(["00" * 32]) == 0                      # called too early: still no raise
    assert unregistered.batch_get_v1(["00" * 32], indices([1])) == [False]


def test_bad_config_fails_at_start_up(runtime_dir: str) -> None:
    from pof_connector.config import ConfigError

    with pytest.raises(ConfigError, match="tiers"):
        StorageBackendFactory.create_backend("dynamic", storage_config({"tiers": {"gpu": {}}}),
                                             host_pool("mha", "page_first"))
    pool = host_pool("mha", "page_first")
    with pytest.raises(ConfigError, match="page_tokens"):
        backend(pool, {"index_url": "local", "runtime_dir": runtime_dir, "page_tokens": 8})


@pytest.fixture
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="pof-sgl-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)
