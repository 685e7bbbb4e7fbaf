"""vLLM 0.32's per-layer KV views, as a GPU backend reads them, on CPU tensors: every
``KVCacheLayout`` x {MHA, MLA} x {bf16, fp16, fp32} round-trips byte-exact through the GPU code
path (``BlockLayout`` gather/scatter/pages_to_blocks, and the real ``PoFWorker`` with a DRAM
tier), kernel blocks map to manager blocks, the HND tie is decided by strides, and anything else
is refused by name.

The caches are vLLM's own: ``get_kv_cache_config_from_groups`` places the layers in one
allocation and ``allocate_kv_cache`` (the model runner's) views it with ``create_kv_cache_views``,
run here on the CPU. Only the config object they read is a stand-in (four fields)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pof_connector.adapters.vllm_geometry import VllmGeometry, cache_spec_problem
from pof_connector.adapters.vllm_layout import LayoutError, view_layout
from pof_connector.adapters.vllm_metadata import LoadJob, PoFConnectorMetadata, SaveJob
from pof_connector.adapters.vllm_views import KV_CACHE_LAYOUTS, engine_views, identify
from pof_connector.adapters.vllm_worker import PoFWorker
from pof_connector.config import PofConfig

pytestmark = pytest.mark.vllm

LAYERS, BLOCKS, HEADS, TOKENS, DIM, LATENT = 3, 10, 2, 16, 8, 40
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
NAMES = list(KV_CACHE_LAYOUTS)


def vllm_cache(layout: str, *, mla: bool, dtype: torch.dtype, heads: int = HEADS, tokens: int = TOKENS,
               blocks: int = BLOCKS, layers: int = LAYERS,
               kernel_tokens: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """vLLM's KV cache for a uniform model: its one int8 allocation and the per-layer views
    ``register_kv_caches`` receives, made by vLLM's own code."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    kind = KVCacheLayout[layout]
    spec = (MLAAttentionSpec(block_size=tokens, num_kv_heads=1, head_size=LATENT, dtype=dtype) if mla
            else FullAttentionSpec(block_size=tokens, num_kv_heads=heads, head_size=DIM, dtype=dtype))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    cache = SimpleNamespace(get_resolved_kv_cache_layout=lambda: kind, num_gpu_blocks_override=None,
                            prefix_cache_retention_interval=None)
    config = SimpleNamespace(cache_config=cache, attention_config=SimpleNamespace(hisparse_config=None))
    kv_config = get_kv_cache_config_from_groups(config, [KVCacheGroupSpec(names, spec)],   # type: ignore[arg-type]
                                                blocks * layers * spec.page_size_bytes)
    assert kv_config.num_blocks == blocks
    views = allocate_kv_cache(kv_config, torch.device("cpu"), kind, None if kernel_tokens is None else [kernel_tokens])
    raw = next(iter(views.values())).untyped_storage()
    return torch.tensor([], dtype=torch.int8).set_(raw), views


def fill(raw: torch.Tensor, seed: int = 0) -> None:
    """Random bytes everywhere (any bit pattern: the moves must be bit-exact, NaNs included)."""
    g = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(-128, 128, raw.shape, dtype=torch.int8, generator=g))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def splits(layout: str, mla: bool) -> list[int | None]:
    """Kernel block sizes vLLM accepts for this layout (it refuses to split blocks that are not
    dense pages: block-outermost layouts, and LHBNC with more than one head)."""
    dense = layout in ("LBHNC", "LBNHC") or (mla and layout == "LHBNC")
    return [None, TOKENS // 2] if dense else [None]


CASES = [pytest.param(name, mla, dtype, kt, id=f"{name}-{'mla' if mla else 'mha'}-{str(dtype)[6:]}-k{kt or TOKENS}")
         for name in NAMES for mla in (False, True) for dtype in DTYPES for kt in splits(name, mla)]


def test_the_mirror_builds_the_views_vllm_builds() -> None:
    """``engine_views`` (for the GPU harness and benches, where vLLM cannot be installed) gives
    the shapes, strides and offsets vLLM's own allocation gives, for every layout."""
    for name in NAMES:
        for mla in (False, True):
            for kt in splits(name, mla):
                _, theirs = vllm_cache(name, mla=mla, dtype=torch.bfloat16, kernel_tokens=kt)
                ours = engine_views(name, layers=LAYERS, blocks=BLOCKS, heads=1 if mla else HEADS, tokens=TOKENS,
                                    content=LATENT if mla else 2 * DIM, dtype=torch.bfloat16, kernel_tokens=kt)
                for a, b in zip(theirs.values(), ours, strict=True):
                    assert (a.shape, a.stride(), a.storage_offset()) == (b.shape, b.stride(), b.storage_offset())


def test_the_layout_names_are_vllms() -> None:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    assert {m.name: m.value for m in KVCacheLayout} == KV_CACHE_LAYOUTS


@pytest.mark.parametrize("name", NAMES)
def test_the_strides_name_the_layout(name: str) -> None:
    _, views = vllm_cache(name, mla=False, dtype=torch.float16)
    found = identify(list(views.values()), block_size=TOKENS, kv_heads=HEADS, head_dim=DIM, is_mla=False)
    assert found.layouts == (name,) and found.kernel_blocks == 1
    # MLA has one head: the orders that differ only in where H sits are the same memory
    _, views = vllm_cache(name, mla=True, dtype=torch.float16)
    found = identify(list(views.values()), block_size=TOKENS, kv_heads=1, head_dim=LATENT, is_mla=True)
    assert name in found.layouts and len(found.layouts) == 3
    assert identify(list(views.values()), block_size=TOKENS, kv_heads=1, head_dim=LATENT, is_mla=True,
                    configured=name).layouts == (name,)


@pytest.mark.parametrize(("name", "mla", "dtype", "kernel_tokens"), CASES)
def test_blocks_round_trip_byte_exact_as_canonical_pages(name: str, mla: bool, dtype: torch.dtype,
                                                         kernel_tokens: int | None) -> None:
    """gather gives canonical pages (K then V of each token and head, or the latent) read by
    index from the view; scatter writes exactly those blocks back; pages of two manager blocks
    convert both ways."""
    raw, views = vllm_cache(name, mla=mla, dtype=dtype, kernel_tokens=kernel_tokens)
    fill(raw)
    kv = list(views.values())
    heads, dim = (1, LATENT) if mla else (HEADS, DIM)
    lay = view_layout(kv, block_size=TOKENS, kv_heads=heads, head_dim=dim, is_mla=mla, configured=name)
    assert lay.name == ("mla" if mla else "kv_split") and lay.kernel_blocks == (TOKENS // (kernel_tokens or TOKENS))
    ids = torch.tensor([7, 2, 5, 3])
    k = lay.kernel_blocks
    n = TOKENS // k
    for layer in (0, LAYERS - 1):
        c = lay.gather(kv[layer], ids)
        assert c.shape == (4, *lay.block_shape())
        for j, b in enumerate(ids.tolist()):
            for t in (0, n - 1, TOKENS - 1):
                cell = kv[layer][b * k + t // n, :, t % n]           # [H, C] of token t: a kernel block each n
                if mla:
                    assert torch.equal(bits(c[j, 0, t, 0]), bits(cell[0]))
                else:
                    assert torch.equal(bits(c[j, 0, t]), bits(cell[:, :dim]))     # K of every head
                    assert torch.equal(bits(c[j, 1, t]), bits(cell[:, dim:]))     # then V
        pages = lay.blocks_to_pages(c, 2)
        assert pages.shape == (2, *lay.canonical_shape(2 * TOKENS))
        assert torch.equal(bits(lay.pages_to_blocks(pages, 2)), bits(c))
    before = raw.clone()
    source = lay.gather(kv[1], ids)
    target = torch.tensor([1, 9, 4, 6])
    lay.scatter(kv[0], target, source)
    assert torch.equal(bits(lay.gather(kv[0], target)), bits(source))
    # the other bytes are untouched: the null block 0, the other blocks, the other layers
    expect_raw, expect_views = vllm_cache(name, mla=mla, dtype=dtype, kernel_tokens=kernel_tokens)
    expect_raw.copy_(before)
    expected = next(iter(expect_views.values())).unflatten(0, (-1, k))
    expected[target] = list(expect_views.values())[1].unflatten(0, (-1, k))[ids]   # torch's own strided copy
    assert torch.equal(raw, expect_raw)


@pytest.mark.parametrize("name", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
def test_the_hnd_tie_is_decided_by_strides(name: str) -> None:
    """``block_size == kv_heads``: NHD and HND orders have equal shapes; the strides say which,
    and every page holds token t's head h where the engine's kernels put it."""
    _, views = vllm_cache(name, mla=False, dtype=torch.bfloat16, heads=TOKENS)
    kv = list(views.values())
    other = {"LBHNC": "LBNHC", "LBNHC": "LBHNC", "BLHNC": "BLNHC", "BLNHC": "BLHNC"}[name]
    _, twin = vllm_cache(other, mla=False, dtype=torch.bfloat16, heads=TOKENS)
    assert kv[0].shape == next(iter(twin.values())).shape and kv[0].stride() != next(iter(twin.values())).stride()
    found = identify(kv, block_size=TOKENS, kv_heads=TOKENS, head_dim=DIM, is_mla=False)
    assert found.layouts == (name,)
    for h in range(TOKENS):
        for t in range(TOKENS):
            kv[0][3, h, t, :DIM] = 16 * h + t            # K of head h, token t (exact in bf16: below 256)
    lay = view_layout(kv, block_size=TOKENS, kv_heads=TOKENS, head_dim=DIM, is_mla=False)
    page = lay.gather(kv[0], torch.tensor([3]))[0]
    assert torch.equal(page[0], kv[0][3].transpose(0, 1)[:, :, :DIM])          # [N, H, D]: token-major
    assert page[0, 5, 2, 0] == kv[0][3, 2, 5, 0] and page[0, 2, 5, 0] == kv[0][3, 5, 2, 0]
    with pytest.raises(LayoutError, match=f"resolved the KV cache layout {other}"):
        identify(kv, block_size=TOKENS, kv_heads=TOKENS, head_dim=DIM, is_mla=False, configured=other)


def test_an_unknown_layout_is_refused_by_name() -> None:
    """Strides of no ``KVCacheLayout`` (here L, N, B, H, C), an unknown layout name, and a cache
    packed another way (K and V as head groups; a content size that is not K|V) are refused with
    what was found and what is allowed."""
    raw = torch.zeros(LAYERS * BLOCKS * HEADS * TOKENS * 2 * DIM, dtype=torch.float16)
    c = 2 * DIM
    lnbhc = torch.as_strided(raw, (LAYERS, BLOCKS, HEADS, TOKENS, c),
                             (TOKENS * BLOCKS * HEADS * c, HEADS * c, c, BLOCKS * HEADS * c, 1))
    views = [lnbhc[i] for i in range(LAYERS)]
    with pytest.raises(LayoutError, match="match no KV cache layout") as e:
        view_layout(views, block_size=TOKENS, kv_heads=HEADS, head_dim=DIM, is_mla=False)
    assert "LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC" in str(e.value) and "VLLM_KV_CACHE_LAYOUT" in str(e.value)
    assert f"strides {list(views[0].stride())}" in str(e.value)
    _, good = vllm_cache("LBNHC", mla=False, dtype=torch.float16)
    with pytest.raises(LayoutError, match="'LBXNC' is not one pof knows"):
        view_layout(list(good.values()), block_size=TOKENS, kv_heads=HEADS, head_dim=DIM, is_mla=False,
                    configured="LBXNC")
    with pytest.raises(LayoutError, match="does not hold K\\|V of 4 head"):
        view_layout(list(good.values()), block_size=TOKENS, kv_heads=4, head_dim=DIM // 2, is_mla=False)
    with pytest.raises(LayoutError, match="4-D"):
        view_layout([torch.zeros(2, BLOCKS, TOKENS, HEADS, DIM)], block_size=TOKENS, kv_heads=HEADS, head_dim=DIM,
                    is_mla=False)


def test_a_backend_that_packs_k_and_v_as_head_groups_is_refused_at_start() -> None:
    """ROCm's and b12x's backends store K and V as two head groups (``num_head_slots=2``): with
    two KV heads their views have the shape of K|V per head, so the spec must say it."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    plain = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    grouped = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16, num_head_slots=2,
                                state_content_bytes=2 * 8 * 2)
    assert plain.page_size_bytes == grouped.page_size_bytes
    ok = KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["a"], plain)])
    assert cache_spec_problem(ok) is None and cache_spec_problem(None) is None
    bad = KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["a"], grouped)])
    assert "num_head_slots=2" in (cache_spec_problem(bad) or "")
    two = KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["a"], plain),
                                                                           KVCacheGroupSpec(["b"], plain)])
    assert "2 KV cache groups" in (cache_spec_problem(two) or "")


# ---- the real worker on these views ----------------------------------------------------------------


@pytest.fixture
def make_worker(runtime_dir: str) -> Iterator[Any]:
    made: list[PoFWorker] = []

    def make(name: str, mla: bool, dtype: torch.dtype, kernel_tokens: int | None = None
             ) -> tuple[PoFWorker, torch.Tensor, dict[str, torch.Tensor]]:
        raw, views = vllm_cache(name, mla=mla, dtype=dtype, kernel_tokens=kernel_tokens)
        geo = VllmGeometry(model="m", kv_dtype=str(dtype)[6:], kv_heads=1 if mla else HEADS,
                           head_dim=LATENT if mla else DIM, num_layers=LAYERS, is_mla=mla, block_size=TOKENS,
                           page_tokens=2 * TOKENS, tp_size=1)
        cfg = PofConfig.from_mapping({"node_id": "g", "index_url": "local", "runtime_dir": runtime_dir,
                                      "tiers": {"cpu_dram": {"size": "4MiB"}}})
        worker = PoFWorker(cfg, geo, tp_rank=0, overlap=False, cpu_attention=False)
        worker.register(views, layout=name)
        made.append(worker)
        return worker, raw, views

    yield make
    for w in made:
        w.close()


def step(worker: PoFWorker, names: list[str], meta: PoFConnectorMetadata) -> set[int]:
    """One forward as vLLM drives it; returns the blocks reported as load errors."""
    worker.prepare_saves(meta)
    worker.start(meta)
    for name in names:
        worker.wait_layer(name)
        worker.save_layer(name)
    worker.end_step()
    return worker.take_load_errors()


@pytest.mark.parametrize(("name", "mla", "dtype", "kernel_tokens"), CASES)
def test_the_worker_saves_and_loads_byte_exact(make_worker: Any, name: str, mla: bool, dtype: torch.dtype,
                                               kernel_tokens: int | None) -> None:
    """Two pages of two blocks saved from blocks 1-4, loaded into 5-8 (the first block skipped: the
    engine's own): every layer's blocks are the saved bytes, and nothing else changed (the null
    block 0 and every other block of every layer)."""
    worker, raw, views = make_worker(name, mla, dtype, kernel_tokens)
    assert worker.layout is not None and name in worker.layout.physical
    fill(raw, seed=1)
    names = list(views)
    keys = worker.pool.keys_for(list(range(4 * TOKENS)))
    assert step(worker, names, PoFConnectorMetadata(saves=[SaveJob("s", keys, [[1, 2], [3, 4]])])) == set()
    worker.pool.flush()
    before = raw.clone()
    lookup = worker.pool.lookup(keys)
    assert lookup.pages == 2
    load = LoadJob("l", keys, lookup.sources, [[5, 6], [7, 8]], skip_blocks=1)
    assert step(worker, names, PoFConnectorMetadata(loads=[load])) == set()
    expect_raw, expect_views = vllm_cache(name, mla=mla, dtype=dtype, kernel_tokens=kernel_tokens)
    expect_raw.copy_(before)
    k = worker.layout.kernel_blocks
    for view in expect_views.values():
        grouped = view.unflatten(0, (-1, k))
        grouped[[6, 7, 8]] = grouped[[2, 3, 4]].clone()
    assert torch.equal(raw, expect_raw)
