"""``python -m pof_connector.bench.vllm_load``: the worker's load path runs both ways and restores
the saved blocks byte for byte (the bench raises otherwise)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize(("dtype", "page_bytes"), [("float32", 2 << 20), ("bfloat16", 1 << 20)])
def test_the_load_bench_runs_both_paths_and_checks_the_blocks(dtype: str, page_bytes: int) -> None:
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from pof_connector.bench.vllm_load import run
    from pof_connector.pages import page_sum

    result = run(pages=2, repeat=1, dtype=dtype, threads=2)
    assert result["copy_threads"] == (2 if page_sum.NATIVE else 1)     # as many as torch computes with
    # the engine's own kernel decides the block order: K^T with the vec ISA, VNNI tiles with AMX
    # (bf16 on AMX CPUs); both take the fused native path, any other probed order torch copies
    isa = str(_get_attn_isa(getattr(torch, dtype), 128, 64, "auto"))
    fast = isa in ("vec", "amx")
    assert result["layout"] == {"vec": "cpu_kt", "amx": "cpu_vnni"}.get(isa, "cpu_probed")
    assert result["loaded_bytes"] == 2 * (page_bytes + 192)                          # KV + header
    assert result["dtype"] == f"torch.{dtype}"
    assert result["fused_s"] > 0 and result["torch_s"] > 0 and result["memcpy_s"] > 0
    assert result["fused_one_thread_s"] > 0 and result["memcpy_threads_s"] > 0
    assert result["fused_available"] is fast


@pytest.mark.parametrize(("dtype", "layout", "fused"), [("bfloat16", "cpu_vnni", True), ("bfloat16", "cpu_kt", True),
                                                        ("float32", "cpu_kt", True), ("float32", "cpu_vnni", False)])
def test_a_forced_layout_is_loaded_both_ways(dtype: str, layout: str, fused: bool) -> None:
    """The block order forced (what another host's kernel would give): the fused native load (VNNI
    tiles: 16-bit items only) and the torch copies restore the blocks (the bench checks them byte
    for byte)."""
    from pof_connector.bench.vllm_load import run

    result = run(pages=2, repeat=1, dtype=dtype, layout=layout)
    assert result["layout"] == layout and result["fused_available"] is fused
    assert result["fused_s"] > 0 and result["torch_s"] > 0

