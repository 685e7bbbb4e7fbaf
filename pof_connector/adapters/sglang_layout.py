"""SGLang host KV pools ⇄ canonical page segments.

A HiCache host pool keeps every page in one ``kv_buffer`` tensor; its layout decides where a
page's layer lives (H KV heads of this rank, D head dim, ps tokens per page, S tokens, P pages,
L layers; MLA has one latent of width C instead of K and V):

====================  ======================  =================================================
layout                MHA ``kv_buffer``       MLA ``kv_buffer``
====================  ======================  =================================================
``layer_first``       ``[2, L, S, H, D]``     ``[L, S, 1, C]``
``page_first``        ``[2, S, L, H, D]``     ``[S, L, 1, C]``
``page_first_direct`` ``[2, P, L, ps, H, D]`` ``[P, L, ps, 1, C]``
====================  ======================  =================================================

:meth:`HostPages.layer` returns layer ``l`` of the page starting at host token ``t0`` as a view in
the canonical order ``[2, ps, H, D]`` (MLA ``[1, ps, 1, C]``) — the same segment vLLM's adapter
writes, so both engines read each other's pages. Other layouts (``page_head``,
``page_first_kv_split``, ``page_unified``) and asymmetric K/V head sizes are refused at start-up.
"""

from __future__ import annotations

from typing import Any

import torch

from pof_connector.pages import KIND_MHA, KIND_MLA, Namespace, PageSpec

LAYOUTS = ("layer_first", "page_first", "page_first_direct")


class HostPages:
    def __init__(self, host_pool: Any) -> None:
        layout = str(getattr(host_pool, "layout", ""))
        if layout not in LAYOUTS:
            raise ValueError(f"pof supports --hicache-mem-layout {', '.join(LAYOUTS)}; this host pool uses {layout!r}")
        self.layout = layout
        self.kv: torch.Tensor = host_pool.kv_buffer
        self.page_size = int(host_pool.page_size)
        self.num_layers = int(host_pool.layer_num)
        self.dtype: torch.dtype = self.kv.dtype
        self.is_mla = hasattr(host_pool, "kv_lora_rank")
        if self.is_mla:
            self.kv_heads, self.head_dim = 1, int(host_pool.kv_cache_dim)
        else:
            self.kv_heads, self.head_dim = int(host_pool.head_num), int(host_pool.head_dim)
            if int(getattr(host_pool, "v_head_dim", self.head_dim)) != self.head_dim:
                raise ValueError("pof does not support K and V of different head sizes (asymmetric MHA)")

    @property
    def canonical_shape(self) -> tuple[int, int, int, int]:
        ps = self.page_size
        return (1, ps, 1, self.head_dim) if self.is_mla else (2, ps, self.kv_heads, self.head_dim)

    @property
    def segment_bytes(self) -> int:
        k, ps, h, d = self.canonical_shape
        return k * ps * h * d * self.dtype.itemsize

    @property
    def layout_name(self) -> str:
        """The page geometry as vLLM's adapter names it (part of the key namespace)."""
        kind = "mla" if self.is_mla else "mha"
        return f"{kind}:kv_heads={self.kv_heads}:head_dim={self.head_dim}:layers={self.num_layers}"

    @property
    def spec(self) -> PageSpec:
        return PageSpec(self.num_layers, self.segment_bytes, self.page_size, KIND_MLA if self.is_mla else KIND_MHA)

    def namespace(self, model: str, *, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int,
                  extra: str) -> Namespace:
        """The key namespace of these pages: vLLM's adapter computes the same one for the same model,
        dtype and geometry (:meth:`~pof_connector.adapters.vllm_geometry.VllmGeometry.namespace`)."""
        # MLA latents are identical on every TP rank: one namespace for all of them.
        if self.is_mla:
            tp_rank, tp_size = 0, 1
        # The PP stage: stages hold different layers, equal in number when the model divides evenly.
        return Namespace(model, str(self.dtype).removeprefix("torch."), self.layout_name, self.spec, tp_rank,
                         tp_size, extra, pp_rank=pp_rank, pp_size=pp_size)

    def layer(self, t0: int, layer: int) -> torch.Tensor:
        """Layer ``layer`` of the page whose first host token is ``t0``, canonical order, a view."""
        ps, kv = self.page_size, self.kv
        if self.is_mla:
            if self.layout == "layer_first":
                x = kv[layer, t0:t0 + ps]
            elif self.layout == "page_first":
                x = kv[t0:t0 + ps, layer]
            else:
                x = kv[t0 // ps, layer]
            return x.unsqueeze(0)                                   # [1, ps, 1, C]
        if self.layout == "layer_first":
            return kv[:, layer, t0:t0 + ps]
        if self.layout == "page_first":
            return kv[:, t0:t0 + ps, layer]
        return kv[:, t0 // ps, layer]

    def flat_layer(self, flat: torch.Tensor, layer: int) -> torch.Tensor:
        """Layer ``layer`` inside a flat page of the legacy API (``get_data_page(flat=True)``,
        whose order is the page's own view in this layout), canonical order, a view."""
        ps, h, d, L = self.page_size, self.kv_heads, self.head_dim, self.num_layers
        if self.is_mla:
            shape = (ps, L, 1, d) if self.layout == "page_first" else (L, ps, 1, d)
            page = flat.view(self.dtype).view(shape)
            x = page[:, layer] if self.layout == "page_first" else page[layer]
            return x.unsqueeze(0)
        if self.layout == "page_first":
            return flat.view(self.dtype).view(2, ps, L, h, d)[:, :, layer]
        return flat.view(self.dtype).view(2, L, ps, h, d)[:, layer]
