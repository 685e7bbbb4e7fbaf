"""What both halves of the vLLM connector derive from ``vllm_config`` identically: the pool
config, page geometry and key namespace. Kept in one place so the scheduler process and the worker
process can never disagree on keys (the worker checks its KV tensors against :attr:`VllmGeometry.spec`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import torch

from pof_connector.config import ConfigError, PofConfig
from pof_connector.pages import KIND_MHA, KIND_MLA, Namespace, PageSpec


@dataclass(frozen=True)
class VllmGeometry:
    model: str
    kv_dtype: str
    kv_heads: int
    head_dim: int
    num_layers: int
    is_mla: bool
    block_size: int
    page_tokens: int
    tp_size: int
    layout_tag: str = "canonical"
    """``canonical`` when pages hold real per-token K/V (shareable with any engine); otherwise the
    name of an engine-specific block format, which then keeps those pages in a namespace of their own."""
    pp_size: int = 1
    """Pipeline stages: each stage holds other layers, so a stage's pages live in a namespace of its own."""

    @property
    def blocks_per_page(self) -> int:
        return self.page_tokens // self.block_size

    @property
    def layout(self) -> str:
        kind = "mla" if self.is_mla else "mha"
        tag = "" if self.layout_tag == "canonical" else f":{self.layout_tag}"
        return f"{kind}:kv_heads={self.kv_heads}:head_dim={self.head_dim}:layers={self.num_layers}{tag}"

    @property
    def kv_itemsize(self) -> int:
        """Bytes per element of the KV cache tensors, as vLLM allocates them for :attr:`kv_dtype`."""
        try:
            from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
        except ImportError:     # a harness without vLLM (the GPU check): torch's own dtype names
            STR_DTYPE_TO_TORCH_DTYPE = {}
        dtype = STR_DTYPE_TO_TORCH_DTYPE.get(self.kv_dtype, getattr(torch, self.kv_dtype, None))
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(f"pof does not know vLLM's KV cache dtype {self.kv_dtype!r}")
        return int(dtype.itemsize)

    @property
    def spec(self) -> PageSpec:
        """The pages' geometry, from the model config alone: the scheduler has no KV tensors, and its
        keys must name the pages the worker of rank 0 writes (it checks its tensors against this)."""
        per_token = self.head_dim if self.is_mla else 2 * self.kv_heads * self.head_dim
        return PageSpec(self.num_layers, self.page_tokens * per_token * self.kv_itemsize, self.page_tokens,
                        KIND_MLA if self.is_mla else KIND_MHA)

    def namespace(self, config: PofConfig, tp_rank: int, pp_rank: int = 0) -> bytes:
        """The key namespace of rank (``tp_rank``, ``pp_rank``): the scheduler looks up rank (0, 0)'s."""
        # MLA latents are identical on every TP rank: one namespace for all of them.
        rank, size = (0, 1) if self.is_mla else (tp_rank, self.tp_size)
        # Stages with equal layer counts hold different layers' KV (a single stage keeps the digest).
        return Namespace(self.model, self.kv_dtype, self.layout, self.spec, rank, size,
                         config.namespace, pp_rank=pp_rank, pp_size=self.pp_size).digest

    def node_id(self, config: PofConfig, tp_rank: int, pp_rank: int = 0) -> str:
        """The pool node of one worker: every worker process is a node of its own (its DRAM tier is
        private), named after the first rank's node (``a``, ``a-tp1``, ``a-pp1``, ``a-tp1-pp1``)."""
        suffix = (f"-tp{tp_rank}" if tp_rank else "") + (f"-pp{pp_rank}" if pp_rank else "")
        return config.node_id + suffix


def pof_config(vllm_config: Any) -> PofConfig:
    """The pool config from ``kv_connector_extra_config`` (raises :class:`ConfigError`)."""
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    return PofConfig.from_mapping(extra, source="kv_connector_extra_config")


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``; strings pass through."""
    return str(dtype).removeprefix("torch.")


def geometry(vllm_config: Any, config: PofConfig) -> VllmGeometry:
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    block_size = int(cache.block_size)
    page_tokens = config.page_tokens or block_size
    if page_tokens % block_size:
        raise ConfigError(
            f"page_tokens: {page_tokens} is not a multiple of vLLM's block size {block_size}; allowed: "
            f"{block_size}, {2 * block_size}, {4 * block_size}, … (or leave page_tokens unset to use "
            f"{block_size})")
    cache_dtype = str(cache.cache_dtype)
    kv_dtype = dtype_name(model_config.dtype) if cache_dtype == "auto" else cache_dtype
    geo = VllmGeometry(
        model=config.model or str(model_config.model),
        kv_dtype=kv_dtype,
        kv_heads=int(model_config.get_num_kv_heads(parallel)),
        head_dim=int(model_config.get_head_size()),
        num_layers=int(model_config.get_num_layers(parallel)),
        is_mla=bool(model_config.use_mla),
        block_size=block_size,
        page_tokens=page_tokens,
        tp_size=int(parallel.tensor_parallel_size),
        pp_size=int(parallel.pipeline_parallel_size),
    )
    if cache_dtype == "auto" and on_cpu():
        order = cpu_block_order(geo.kv_heads, block_size, geo.head_dim, model_config.dtype)
        if order is None:
            geo = replace(geo, layout_tag=f"opaque-cpu-{_cpu_isa(model_config.dtype, block_size, geo.head_dim)}")
    elif on_cpu():
        geo = replace(geo, layout_tag=f"opaque-cpu-{cache_dtype}")
    return geo


def on_cpu() -> bool:
    """Whether vLLM runs on its CPU platform (its CPU attention kernels write the KV cache)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _cpu_isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # the backend's own choice

    return str(_get_attn_isa(dtype, block_size, head_dim, "auto"))


@functools.lru_cache(maxsize=8)
def cpu_block_order(kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The CPU backend's in-block order (see ``vllm_layout.probe_cpu_block``), probed once per
    process; the scheduler and the worker both run it, so they agree on ``layout_tag``."""
    from pof_connector.adapters.vllm_layout import probe_cpu_block

    return probe_cpu_block(kv_heads, block_size, head_dim, dtype, _cpu_isa(dtype, block_size, head_dim))


_KNOWN_QUANT = ("NONE", "FP8_PER_TENSOR")
"""vLLM ``KVQuantMode`` values whose cache holds K|V (or the latent) per token and head only: the
per-tensor fp8 scale lives in the layer, not in the blocks."""


def cache_spec_problem(kv_cache_config: Any) -> str | None:
    """Why the engine's KV cache, as vLLM's ``KVCacheConfig`` describes it, cannot be moved as
    pof pages; ``None``: it can (or no config was given). The views' shapes and strides are
    checked again at registration; this catches what they cannot show: a backend that stores K
    and V as two head groups (``num_head_slots``) has the shape of K|V per head when there are
    two KV heads."""
    if kv_cache_config is None:
        return None
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) > 1:
        return (f"{len(groups)} KV cache groups (the hybrid KV cache manager): pof plans one block table; allowed: "
                "one group (drop --no-disable-hybrid-kv-cache-manager)")
    for group in groups:
        spec = group.kv_cache_spec
        for layer_spec in getattr(spec, "kv_cache_specs", {}).values() or [spec]:
            kind = type(layer_spec).__name__
            for name in ("num_head_slots", "state_content_bytes"):
                if getattr(layer_spec, name, None) is not None:
                    return (f"{kind}.{name}={getattr(layer_spec, name)}: the attention backend packs its blocks in "
                            "its own way (e.g. K and V as separate head groups); allowed: backends that store K|V "
                            "(or MLA's latent) per token and head, e.g. FlashAttention, FlashInfer, Triton, FlashMLA")
            if getattr(layer_spec, "tokens_per_state", 1) != 1:
                return (f"{kind}.tokens_per_state={layer_spec.tokens_per_state}: compressed KV; allowed: one state "
                        "per token")
            quant = getattr(getattr(layer_spec, "kv_quant_mode", None), "name", "NONE")
            if quant not in _KNOWN_QUANT:
                return f"{kind}.kv_quant_mode={quant}: scales inside the blocks; allowed: {', '.join(_KNOWN_QUANT)}"
    return None
