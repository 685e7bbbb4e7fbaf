"""vLLM 0.32's per-layer KV-cache views, recognised by their strides.

Every attention backend of vLLM 0.32 gets, per layer, a logical 4-D view ``[B, H, N, C]`` of one
allocation shared by all layers (``vllm.v1.kv_cache_interface.create_kv_cache_views``): B blocks,
H KV heads (1 for MLA), N tokens per block, C the content of one token and head in the cache
dtype. The GPU backends store K then V in C (FlashAttention splits it with
``kv_cache.transpose(1, 2).split(head_size, dim=-1)``); MLA stores the latent. The *physical*
order is one of ``vllm.v1.kv_cache_layout.KVCacheLayout``'s stride permutations of the logical
``[L, B, H, N, C]`` (L: the layers), chosen by vLLM or by ``VLLM_KV_CACHE_LAYOUT``.

Because the view is logical, a page is read and written by index, whatever the permutation:
the strides decide where the bytes are, the shape only what they mean. What this module does is
refuse what pof has not verified: :func:`identify` names the layouts the strides match (several
when a dimension of size 1 makes them the same memory) and raises :class:`LayoutError` for any
other pattern, before a byte moves. It never decides by shape: ``block_size == kv_heads`` (the
"HND tie") has equal shapes for NHD and HND orders and different strides.

Kernel blocks: a backend whose kernels take smaller blocks than the KV manager's gets its view
split (``compute_layer_kv_cache_shape_bytes``): ``k = block_size // N`` kernel blocks per manager
block, manager block ``m`` being kernel blocks ``m * k .. m * k + k - 1``
(``group_kernel_blocks``, ``AttentionGroup.map_to_kernel_block_table``). The scheduler plans in
manager blocks; :class:`~pof_connector.adapters.vllm_layout.BlockLayout` maps them.

The permutations are mirrored here, not imported: the worker runs where vLLM cannot be installed
(the GPU check). ``tests/adapters/test_vllm_views.py`` checks the mirror against vLLM's enum.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

KV_CACHE_LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
"""``KVCacheLayout`` of vLLM 0.32: name -> physical order (outermost first) of the logical axes
``L, B, H, N, C`` (0..4)."""

_L, _B = 0, 1
_DIM_NAMES = "LBHNC"


class LayoutError(ValueError):
    """The KV tensors match no layout pof knows."""


@dataclass(frozen=True)
class ViewLayout:
    """What :func:`identify` found."""

    layouts: tuple[str, ...]
    """The ``KVCacheLayout`` names whose stride pattern the views have, in vLLM's enum order
    (several when a dimension of size 1, or a single layer, makes them the same memory)."""
    kernel_blocks: int
    """Kernel blocks per manager block (1: not split)."""

    @property
    def name(self) -> str:
        return "|".join(self.layouts)


def identify(views: Sequence[torch.Tensor], *, block_size: int, kv_heads: int, head_dim: int, is_mla: bool,
             configured: str | None = None) -> ViewLayout:
    """The layout of one model's per-layer views (layers in model order), from their strides.

    ``block_size``: the KV manager's (vLLM's ``cache_config.block_size``); ``kv_heads`` and
    ``head_dim``: this rank's (MLA: 1 and the latent's width). ``configured``: the layout vLLM
    resolved (``cache_config.kv_cache_layout``), which the strides must confirm; ``None``: the
    strides alone decide. Raises :class:`LayoutError` naming what was found.
    """
    if not views:
        raise LayoutError("pof: no KV cache tensors were registered")
    first = views[0]
    shape, strides = tuple(first.shape), tuple(first.stride())
    found = (f"layer view of shape {list(shape)}, strides {list(strides)} (elements of {first.dtype}), "
             f"{len(views)} layers")
    if configured is not None and configured not in KV_CACHE_LAYOUTS:
        raise LayoutError(f"pof: vLLM's KV cache layout {configured!r} is not one pof knows ({found}); "
                          f"{_allowed()}")
    if first.dim() != 4:
        raise LayoutError(f"pof: expected vLLM 0.32's 4-D [blocks, heads, tokens, content] KV views, found a {found}; "
                          f"{_allowed()}")
    for t in views[1:]:
        if (tuple(t.shape), tuple(t.stride()), t.dtype, t.device) != (shape, strides, first.dtype, first.device):
            raise LayoutError(f"pof: the layers' KV views differ (first: {found}; another: shape {list(t.shape)}, "
                              f"strides {list(t.stride())}, {t.dtype} on {t.device}); hybrid models are not supported")
    blocks, heads, tokens, content = shape
    want_heads, want_content = (1, head_dim) if is_mla else (kv_heads, 2 * head_dim)
    if heads != want_heads or content != want_content or tokens < 1 or block_size % tokens or blocks % (
            block_size // tokens):
        what = "latent" if is_mla else "K|V"
        raise LayoutError(
            f"pof: a {found} does not hold {what} of {want_heads} head(s) x {want_content} per token in blocks of "
            f"{block_size} tokens (or kernel blocks dividing them); the attention backend packs its cache in a way "
            f"pof does not know (e.g. K and V as separate head groups, quantization scales); {_allowed()}")
    layer_stride = _layer_stride(views)
    sizes = (len(views), blocks, heads, tokens, content)
    matched = tuple(name for name, order in KV_CACHE_LAYOUTS.items()
                    if _matches(order, sizes, (layer_stride, *strides)))
    if not matched:
        where = "unknown (layers not evenly spaced)" if layer_stride is None else str(layer_stride)
        raise LayoutError(f"pof: the strides of a {found}, layer stride {where}, match no KV cache layout pof knows; "
                          f"{_allowed()}")
    if configured is not None:
        if configured not in matched:
            raise LayoutError(f"pof: vLLM resolved the KV cache layout {configured}, but the strides of a {found} "
                              f"are those of {'/'.join(matched)}; {_allowed()}")
        matched = (configured,)
    return ViewLayout(matched, block_size // tokens)


def _allowed() -> str:
    return (f"allowed: vLLM's KVCacheLayout {', '.join(KV_CACHE_LAYOUTS)} (VLLM_KV_CACHE_LAYOUT selects one) with "
            "K|V (MHA) or the latent (MLA) per token and head")


def _layer_stride(views: Sequence[torch.Tensor]) -> int | None:
    """Elements from one layer's view to the next, when the layers are evenly spaced in one
    allocation (as ``create_kv_cache_views`` makes them); ``None`` otherwise (one layer: any)."""
    if len(views) == 1:
        return 0
    size = views[0].element_size()
    gaps = {b.data_ptr() - a.data_ptr() for a, b in itertools.pairwise(views)}
    if len(gaps) != 1 or any(t.untyped_storage().data_ptr() != views[0].untyped_storage().data_ptr() for t in views):
        return None
    gap = gaps.pop()
    return gap // size if gap > 0 and gap % size == 0 else None


def _matches(order: tuple[int, ...], sizes: tuple[int, ...], strides: tuple[int | None, ...]) -> bool:
    """Whether strides (logical ``L, B, H, N, C``; L ``None``: unknown) are what
    ``compute_layout_strides`` gives for the physical ``order``: innermost first, each axis spans
    the ones inside it exactly, except L and B, whose strides vLLM may fix larger (padded pages,
    blocks of all layers' pages). An axis of size 1 has no stride to check. With L unknown, the
    axes outside it are only checked not to overlap what is inside."""
    extent, exact = 1, True
    for axis in reversed(order):
        size, stride = sizes[axis], strides[axis]
        if size == 1:
            continue
        if stride is None:          # L, unknown: nothing outside it can be checked exactly
            exact = False
            continue
        if axis == _DIM_NAMES.index("C") and stride != 1:
            return False
        fixed = axis in (_L, _B) or not exact
        if stride < extent or (not fixed and stride != extent):
            return False
        extent = stride * size
    return True


def engine_views(layout: str, *, layers: int, blocks: int, heads: int, tokens: int, content: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu",
                 kernel_tokens: int | None = None) -> list[torch.Tensor]:
    """Per-layer views laid out as vLLM 0.32 lays out a uniform model's KV cache, for benches and
    the GPU harness where vLLM cannot be installed: one zeroed allocation for all layers
    (``KVCacheTensor`` as ``get_kv_cache_config_from_groups`` places it: block-outermost layouts
    pack every layer's page into each block), viewed by ``create_kv_cache_views`` for ``layout``.
    ``tokens``: the manager block size; ``kernel_tokens``: the kernel block size when a backend
    splits blocks (``None``: not split); ``content``: C in elements of ``dtype``. A mirror of
    vLLM's code; ``tests/adapters/test_vllm_views.py`` checks it against vLLM's own."""
    order = KV_CACHE_LAYOUTS[layout]
    page = heads * tokens * content * dtype.itemsize
    outer_block = order[0] == _B
    layer_stride, block_stride = _strides(order, (layers, blocks, heads, tokens, content * dtype.itemsize),
                                          (None, layers * page if outer_block else None))[:2]
    ratio = 1 if kernel_tokens is None else tokens // kernel_tokens
    if ratio > 1:
        if block_stride != page:
            raise LayoutError(f"vLLM refuses kernel blocks of {kernel_tokens} tokens under {layout}: its blocks "
                              "are not dense pages")
        block_stride //= ratio
    shape = (layers, blocks * ratio, heads, tokens // ratio, content * dtype.itemsize)
    raw = torch.zeros(layers * blocks * page, dtype=torch.int8, device=device)
    view = torch.as_strided(raw, shape, _strides(order, shape, (layer_stride, block_stride)))
    return [view[i].view(dtype) for i in range(layers)]


def _strides(order: tuple[int, ...], shape: tuple[int, ...], fixed: tuple[int | None, int | None]) -> tuple[int, ...]:
    """``compute_layout_strides`` without padding: byte strides in logical order, L and B fixed
    where given."""
    strides = [0] * 5
    current = 1
    for axis in reversed(order):
        given = fixed[axis] if axis < 2 else None
        strides[axis] = given or current
        current = strides[axis] * shape[axis]
    return tuple(strides)
