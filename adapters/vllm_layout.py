"""vLLM KV-cache tensors ⇄ canonical page segments (one layer of one page).

The canonical MHA segment is K then V, each ``[page_tokens, kv_heads, head_dim]``; MLA is the
latent ``[page_tokens, 1, dim]``. vLLM's per-layer tensors come in several layouts; the layout
is derived from the tensor's shape and the model's geometry, never assumed:

=================  ===============================  =================================
name               shape                            backends
=================  ===============================  =================================
``cpu_probed``     ``[B, H, N, 2D]``                CPU attention (order probed, see below)
``cpu_opaque``     ``[B, H, N, 2D]``                CPU attention when probing is impossible
``kv_first_nhd``   ``[2, B, N, H, D]``              FlashAttention, Triton
``kv_first_hnd``   ``[2, B, H, N, D]``              FlashAttention with HND
``blocks_first``   ``[B, 2, N, H, D]``              FlashInfer
``blocks_first_hnd`` ``[B, 2, H, N, D]``            FlashInfer with HND
``mla``            ``[B, N, C]``                    MLA backends
=================  ===============================  =================================

(B blocks, N tokens per block, H KV heads of this rank, D head size.) All conversions are torch
ops on the tensor's device, so the same code runs on CPU tensors in CI and on a GPU.

The CPU backend's ``[B, H, N, 2D]`` is not "K and V side by side per token": the kernel that
writes the cache stores each block in an ISA-specific order (with the ``vec`` ISA, K transposed as
``[D, N]`` then V as ``[N, D]``). Rather than hard-code that order, :func:`probe_cpu_block` asks the
engine's own kernel (``cpu_attn_reshape_and_cache``) to write a block of marked values and reads
back where each (K|V, token, head, dim) landed. When that is impossible (fp8 KV, a kernel that
fails), blocks are moved as opaque bytes and the layout name enters the key namespace, so such
pages are shared only between identical engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

LAYOUTS = ("cpu_probed", "cpu_opaque", "kv_first_nhd", "kv_first_hnd", "blocks_first", "blocks_first_hnd", "mla")


@dataclass(frozen=True)
class BlockLayout:
    """How one layer's KV tensor stores blocks, and the canonical geometry of its pages."""

    name: str
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    cpu_order: torch.Tensor | None = field(default=None, compare=False)
    """``cpu_probed`` only: flat position in a block of each canonical element (see probe_cpu_block)."""

    @property
    def is_mla(self) -> bool:
        return self.name == "mla"

    def segment_bytes(self, page_tokens: int) -> int:
        per_token = self.head_dim if self.is_mla else 2 * self.kv_heads * self.head_dim
        return page_tokens * per_token * self.dtype.itemsize

    def canonical_shape(self, tokens: int) -> tuple[int, int, int, int]:
        if self.is_mla:
            return (1, tokens, 1, self.head_dim)
        if self.name == "cpu_opaque":        # raw block bytes, grouped per token only by size
            return (1, tokens, 1, 2 * self.kv_heads * self.head_dim)
        return (2, tokens, self.kv_heads, self.head_dim)

    def gather(self, kv: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """Blocks ``block_ids`` of ``kv`` in canonical order ``[2|1, nb*N, H|1, D]`` (a new tensor)."""
        nb, n = len(block_ids), self.block_size
        if self.name == "cpu_probed":
            assert self.cpu_order is not None
            x = kv.index_select(0, block_ids).reshape(nb, -1)[:, self.cpu_order]   # [nb, 2*N*H*D] canonical
            return x.view(nb, 2, n, self.kv_heads, self.head_dim).transpose(0, 1).reshape(
                2, nb * n, self.kv_heads, self.head_dim)
        if self.name == "cpu_opaque":
            return kv.index_select(0, block_ids).reshape(1, nb * n, 1, -1)
        if self.name == "kv_first_nhd":
            return kv.index_select(1, block_ids).reshape(2, nb * n, self.kv_heads, self.head_dim)
        if self.name == "kv_first_hnd":
            x = kv.index_select(1, block_ids)                                  # [2, nb, H, N, D]
            return x.transpose(2, 3).reshape(2, nb * n, self.kv_heads, self.head_dim)
        if self.name == "blocks_first":
            x = kv.index_select(0, block_ids)                                  # [nb, 2, N, H, D]
            return x.transpose(0, 1).reshape(2, nb * n, self.kv_heads, self.head_dim)
        if self.name == "blocks_first_hnd":
            x = kv.index_select(0, block_ids)                                  # [nb, 2, H, N, D]
            return x.permute(1, 0, 3, 2, 4).reshape(2, nb * n, self.kv_heads, self.head_dim)
        return kv.index_select(0, block_ids).reshape(1, nb * n, 1, self.head_dim)

    def scatter(self, kv: torch.Tensor, block_ids: torch.Tensor, canonical: torch.Tensor) -> None:
        """Write canonical ``[2|1, nb*N, H|1, D]`` into blocks ``block_ids`` of ``kv``."""
        nb, n, h, d = len(block_ids), self.block_size, self.kv_heads, self.head_dim
        c = canonical.to(kv.device, non_blocking=True)
        if self.name == "cpu_probed":
            assert self.cpu_order is not None
            x = torch.empty((nb, 2 * n * h * d), dtype=kv.dtype, device=kv.device)
            x[:, self.cpu_order] = c.reshape(2, nb, n, h, d).transpose(0, 1).reshape(nb, -1)
            kv.index_copy_(0, block_ids, x.view(nb, *kv.shape[1:]))
        elif self.name == "cpu_opaque":
            kv.index_copy_(0, block_ids, c.reshape(nb, *kv.shape[1:]))
        elif self.name == "kv_first_nhd":
            kv.index_copy_(1, block_ids, c.reshape(2, nb, n, h, d))
        elif self.name == "kv_first_hnd":
            kv.index_copy_(1, block_ids, c.reshape(2, nb, n, h, d).transpose(2, 3))
        elif self.name == "blocks_first":
            kv.index_copy_(0, block_ids, c.reshape(2, nb, n, h, d).transpose(0, 1))
        elif self.name == "blocks_first_hnd":
            kv.index_copy_(0, block_ids, c.reshape(2, nb, n, h, d).permute(1, 0, 3, 2, 4))
        else:
            kv.index_copy_(0, block_ids, c.reshape(nb, n, d))


class LayoutError(ValueError):
    """The KV tensor's shape matches no layout pof knows."""


def infer_layout(kv: torch.Tensor, *, block_size: int, kv_heads: int, head_dim: int, is_mla: bool,
                 hnd_preferred: bool = False, cpu_order: torch.Tensor | None = None) -> BlockLayout:
    """Identify ``kv``'s layout from its shape and the model's geometry.

    ``hnd_preferred`` breaks the tie when ``block_size == kv_heads`` makes NHD and HND shapes
    equal (vLLM's ``get_kv_cache_layout()`` says which one the backend uses). ``cpu_order`` is
    :func:`probe_cpu_block`'s answer for a CPU cache (``None``: move blocks as opaque bytes).
    """
    s = tuple(kv.shape)
    n, h, d = block_size, kv_heads, head_dim

    def make(name: str, dim: int = d) -> BlockLayout:
        return BlockLayout(name, n, h if name != "mla" else 1, dim, kv.dtype)

    if is_mla:
        if len(s) == 3 and s[1] == n:
            return make("mla", s[2])
    elif len(s) == 4 and s[1] == h and s[2] == n and s[3] == 2 * d:
        if cpu_order is None:
            return make("cpu_opaque")
        return BlockLayout("cpu_probed", n, h, d, kv.dtype, cpu_order.to(kv.device))
    elif len(s) == 5:
        nhd, hnd = (n, h, d), (h, n, d)
        if s[0] == 2 and s[2:] in (nhd, hnd):
            return make("kv_first_hnd" if s[2:] == hnd and (s[2:] != nhd or hnd_preferred) else "kv_first_nhd")
        if s[1] == 2 and s[2:] in (nhd, hnd):
            return make("blocks_first_hnd" if s[2:] == hnd and (s[2:] != nhd or hnd_preferred) else "blocks_first")
    raise LayoutError(
        f"pof cannot map a KV cache tensor of shape {list(s)} (block_size={n}, kv_heads={h}, head_dim={d}, "
        f"mla={is_mla}); supported layouts: {', '.join(LAYOUTS)}")


def probe_cpu_block(kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype, isa: str,
                    write_block: object = None) -> torch.Tensor | None:
    """Where the CPU attention kernel stores each canonical element of a block.

    Returns ``order`` with ``order[c]`` = the flat position, in one ``[H, N, 2D]`` block, of
    canonical element ``c`` of ``[2 (K|V), N, H, D]``; ``None`` when the kernel's order cannot be
    read back (the caller then moves opaque blocks). Every index is written in base-64 digits
    valued 1..64, which bf16, fp16 and fp32 all hold exactly.
    """
    H, N, D = kv_heads, block_size, head_dim
    if write_block is None:
        from vllm import _custom_ops as ops

        def write_block(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor) -> None:
            kc, vc = cache.view(2, H, 2 * N, D).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(key, value, kc, vc, torch.arange(N, 2 * N), isa)

    t = torch.arange(N).view(N, 1, 1).expand(N, H, D)
    hh = torch.arange(H).view(1, H, 1).expand(N, H, D)
    dd = torch.arange(D).view(1, 1, D).expand(N, H, D)
    passes = {"t_hi": (t // 64, t // 64), "t_lo": (t % 64, t % 64), "h_hi": (hh // 64, hh // 64),
              "h_lo": (hh % 64, hh % 64), "d_hi": (dd // 64, dd // 64), "d_lo": (dd % 64, dd % 64),
              "kv": (torch.zeros_like(t), torch.ones_like(t))}
    seen: dict[str, torch.Tensor] = {}
    for name, (k, v) in passes.items():
        cache = torch.zeros(2, H, N, 2 * D, dtype=dtype)          # block 0 is vLLM's null block
        try:
            write_block((k + 1).to(dtype).contiguous(), (v + 1).to(dtype).contiguous(), cache)  # type: ignore[operator]
        except (RuntimeError, TypeError, AttributeError):
            return None
        seen[name] = cache[1].reshape(-1).to(torch.int64) - 1
    if any(bool((x < 0).any()) or bool((x > 63).any()) for x in seen.values()):
        return None
    tok, head, dim = (seen["t_hi"] * 64 + seen["t_lo"], seen["h_hi"] * 64 + seen["h_lo"],
                      seen["d_hi"] * 64 + seen["d_lo"])
    if (tok >= N).any() or (head >= H).any() or (dim >= D).any() or (seen["kv"] > 1).any():
        return None
    canonical = ((seen["kv"] * N + tok) * H + head) * D + dim
    size = 2 * N * H * D
    if not torch.equal(torch.sort(canonical).values, torch.arange(size)):
        return None        # not a permutation: some element was lost or duplicated
    order = torch.empty(size, dtype=torch.int64)
    order[canonical] = torch.arange(size)
    return order
