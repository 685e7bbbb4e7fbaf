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

    result = run(pages=2, repeat=1, dtype=dtype)
    # the engine's own kernel decides the block order: K^T with the vec ISA (the fused native
    # path), VNNI tiles with AMX (bf16 on AMX CPUs: strided torch copies)
    isa = str(_get_attn_isa(getattr(torch, dtype), 128, 64, "auto"))
    fast = isa == "vec"
    assert result["layout"] == {"vec": "cpu_kt", "amx": "cpu_vnni"}.get(isa, "cpu_probed")
    assert result["loaded_bytes"] == 2 * (page_bytes + 192)                          # KV + header
    assert result["dtype"] == f"torch.{dtype}"
    assert result["fused_s"] > 0 and result["torch_s"] > 0 and result["memcpy_s"] > 0
    assert result["fused_available"] is fast
