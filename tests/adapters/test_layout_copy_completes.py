"""Issue 20, item 5: a load copies tier bytes into the engine's blocks and only then checks their
checksum. On a GPU the copy is a DMA from pinned host memory: if it were still in flight when
``scatter`` returned, the check could pass on bytes a writer (or the next use of a scratch
buffer) replaces before the DMA reads them. ``scatter`` must return with the engine's copy done.

Runs on every device torch sees: CPU in CI (the torch stage), CUDA in ``ci/gpu_check.sh``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pof_connector.adapters.vllm_layout import view_layout  # noqa: E402
from pof_connector.adapters.vllm_views import engine_views  # noqa: E402

pytestmark = pytest.mark.torch

DEVICES = ["cpu"] + [pytest.param(f"cuda:{i}", marks=pytest.mark.gpu)
                     for i in range(torch.cuda.device_count())]


@pytest.mark.parametrize("device", DEVICES)
def test_the_source_may_change_as_soon_as_scatter_returns(device: str) -> None:
    blocks, n, h, d = 256, 16, 8, 128                  # 256 blocks of 64 KiB: a DMA of 16 MiB
    kv = engine_views("LBNHC", layers=1, blocks=blocks, heads=h, tokens=n, content=2 * d, dtype=torch.float16,
                      device=device)[0]                 # FlashAttention's default layout in vLLM 0.32
    lay = view_layout([kv], block_size=n, kv_heads=h, head_dim=d, is_mla=False)
    source = torch.randn(blocks, 2, n, h, d).to(torch.float16)
    if device.startswith("cuda"):
        source = source.pin_memory()           # as the DRAM tier's region and peer-HBM's scratch are
    expected = source.clone()
    ids = torch.arange(blocks, device=device)
    for _ in range(5):
        kv.zero_()
        lay.scatter(kv, ids, source)
        source.fill_(7.0)                      # a writer reuses the slot right after the check
        got = lay.gather(kv, ids).cpu()
        assert torch.equal(got, expected), "the engine received bytes written after scatter returned"
        source.copy_(expected)
