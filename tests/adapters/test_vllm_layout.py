"""Layout conversions of vLLM's CPU attention caches (GPU backends' views: test_vllm_views.py)."""

from __future__ import annotations

import pytest
import torch

from pof_connector.adapters.vllm_layout import LayoutError, _kt_order, infer_layout

pytestmark = pytest.mark.vllm

B, N, H, D = 12, 16, 2, 8


def test_cpu_blocks_without_a_probe_move_as_opaque_bytes() -> None:
    kv = torch.randn(B, H, N, 2 * D).to(torch.bfloat16)
    lay = infer_layout(kv, block_size=N, kv_heads=H, head_dim=D, is_mla=False)
    assert lay.name == "cpu_opaque" and lay.segment_bytes(N) == 2 * N * H * D * 2
    c = lay.gather(kv, torch.tensor([4, 0]))
    assert c.shape == (2, *lay.block_shape())
    out = torch.zeros_like(kv)
    lay.scatter(out, torch.tensor([4, 0]), c)
    assert torch.equal(out[4], kv[4]) and torch.equal(out[0], kv[0]) and torch.count_nonzero(out[1]) == 0


def test_mla_and_unknown_shapes_on_the_cpu_backend_are_refused() -> None:
    """vLLM's CPU attention: MLA's block order is not verified, and a cache that is not the
    contiguous ``[B, H, N, 2D]`` its kernel writes is not that kernel's (GPU backends' views:
    test_vllm_views.py)."""
    with pytest.raises(LayoutError, match="MLA on vLLM's CPU attention"):
        infer_layout(torch.randn(B, 1, N, 40), block_size=N, kv_heads=1, head_dim=40, is_mla=True)
    with pytest.raises(LayoutError, match="allowed: vLLM's CPU backend"):
        infer_layout(torch.zeros(B, N, H, D), block_size=N, kv_heads=H, head_dim=D, is_mla=False)
    with pytest.raises(LayoutError, match="allowed: vLLM's CPU backend"):
        infer_layout(torch.zeros(B, N, H, 2 * D).transpose(1, 2), block_size=N, kv_heads=H, head_dim=D, is_mla=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_blocks_convert_to_real_per_token_kv(dtype: torch.dtype) -> None:
    """Write K/V with the CPU backend's own kernel; the probed layout must give them back per token."""
    from vllm import _custom_ops as ops

    from pof_connector.adapters.vllm_geometry import _cpu_isa
    from pof_connector.adapters.vllm_layout import probe_cpu_block

    h, n, d, blocks = 2, 32, 32, 5
    isa = _cpu_isa(dtype, n, d)
    order = probe_cpu_block(h, n, d, dtype, isa)
    assert order is not None
    kv = torch.zeros(blocks, h, n, 2 * d, dtype=dtype)
    lay = infer_layout(kv, block_size=n, kv_heads=h, head_dim=d, is_mla=False, cpu_order=order)
    assert lay.name == {"vec": "cpu_kt", "amx": "cpu_vnni"}.get(str(isa), "cpu_probed")
    key, value = torch.randn(2 * n, h, d).to(dtype), torch.randn(2 * n, h, d).to(dtype)
    slots = torch.cat([torch.arange(3 * n, 4 * n), torch.arange(1 * n, 2 * n)])      # blocks 3 then 1
    kc, vc = kv.view(blocks, h, 2 * n, d).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa)
    c = lay.gather(kv, torch.tensor([3, 1]))                            # [2 blocks, K|V, N, H, D]
    assert torch.equal(c[:, 0].reshape(2 * n, h, d), key)              # true K and V, token by token
    assert torch.equal(c[:, 1].reshape(2 * n, h, d), value)
    out = torch.zeros_like(kv)
    lay.scatter(out, torch.tensor([3, 1]), c)
    assert torch.equal(out, kv)                                         # and back, byte for byte
    generic = infer_layout(kv, block_size=n, kv_heads=h, head_dim=d, is_mla=False, cpu_order=order,
                           structured=False)
    assert generic.name == "cpu_probed" and torch.equal(generic.gather(kv, torch.tensor([3, 1])), c)
    out2 = torch.zeros_like(kv)
    generic.scatter(out2, torch.tensor([3, 1]), c)
    assert torch.equal(out2, kv)
    out3 = torch.zeros_like(kv)
    lay.write_blocks(out3, [3, 1], c)                                   # the per-page path
    assert torch.equal(out3, kv)


def test_pages_of_several_blocks() -> None:
    kv = torch.randn(B, H, N, 2 * D)
    lay = infer_layout(kv, block_size=N, kv_heads=H, head_dim=D, is_mla=False, cpu_order=_kt_order(H, N, D))
    blocks = lay.gather(kv, torch.tensor([1, 2, 3, 4]))
    pages = lay.blocks_to_pages(blocks, 2)                  # 2 pages of 2 blocks: [2, 2, 2N, H, D]
    assert pages.shape == (2, *lay.canonical_shape(2 * N))
    assert torch.equal(pages[1, 0, N:], blocks[3, 0]) and torch.equal(pages[0, 1, :N], blocks[0, 1])
    assert torch.equal(lay.pages_to_blocks(pages, 2), blocks)


@pytest.mark.parametrize(("layout", "dtype", "bpp", "skip"),
                         [("cpu_kt", torch.float32, 1, 0), ("cpu_kt", torch.bfloat16, 3, 1),
                          ("cpu_kt", torch.float16, 2, 0), ("cpu_vnni", torch.bfloat16, 3, 1),
                          ("cpu_vnni", torch.bfloat16, 1, 0)])
def test_fused_cpu_copy_matches_the_torch_copy_and_sums_the_segment(layout: str, dtype: torch.dtype, bpp: int,
                                                                    skip: int) -> None:
    """The one-pass native load (layout conversion + copy + format-v3 checksum) writes the very
    bytes the strided torch copies write, K^T and the amx ISA's VNNI tiles alike, and its checksum
    is the segment's."""
    from pof_connector.adapters.vllm_layout import _kt_order, _vnni_order
    from pof_connector.pages import page_sum

    n, d = (N, D) if layout == "cpu_kt" else (16, 32)      # VNNI tiles: 16-token, 16-dimension steps
    order = _kt_order(H, n, d) if layout == "cpu_kt" else _vnni_order(H, n, d)
    lay = infer_layout(torch.zeros(B, H, n, 2 * d, dtype=dtype), block_size=n, kv_heads=H, head_dim=d,
                       is_mla=False, cpu_order=order)
    assert lay.name == layout
    kv = torch.zeros(B, H, n, 2 * d, dtype=dtype)
    if not lay.can_copy_checked(kv):
        pytest.skip("the native kernel was not built here")
    segment = torch.randn(2 * bpp * n * H * d).to(dtype).view(torch.uint8).numpy()
    blocks = [9, 4, 6][:bpp - skip]
    want = kv.clone()
    page = torch.from_numpy(segment).view(dtype).view(1, *lay.canonical_shape(n * bpp))
    lay.write_blocks(want, blocks, lay.pages_to_blocks(page, bpp)[skip:])
    got = lay.copy_checked(lay.cache_bytes(kv), [(segment, blocks, skip, 0x5EED)])
    assert torch.equal(kv.view(torch.uint8), want.view(torch.uint8))
    assert got == [page_sum.checksum(segment, 0x5EED)]
    assert bool(kv[blocks].any()) and not bool(kv[[0, 1, 2]].any())       # only the page's blocks changed
