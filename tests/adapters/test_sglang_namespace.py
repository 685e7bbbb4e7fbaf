"""The SGLang adapter's key namespace, without SGLang: :class:`HostPages` names the pages
(``PoFHiCacheStorage.register_mem_pool_host`` takes its namespace and spec as they are) and needs
only a host pool's attributes, so these run in the vLLM venv (SGLang's is ~11 GB). The same
checks through SGLang's real host pools and backend are in test_sglang.py (marked ``sglang``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pof_connector.adapters.sglang_layout import HostPages
from pof_connector.adapters.vllm_geometry import VllmGeometry
from pof_connector.config import PofConfig
from pof_connector.pages.keys import Namespace, keys_from_hex
from pof_connector.pool import Pool

pytestmark = pytest.mark.vllm      # torch, and vLLM's dtype table for the cross-engine check

PS, H, D, L, C = 16, 2, 8, 3, 16


def host_pool(layers: int = L, *, mla: bool = False, dtype: torch.dtype = torch.bfloat16, pages: int = 8) -> Any:
    """The attributes of an SGLang host pool in ``page_first_direct`` layout that HostPages reads."""
    if mla:
        return SimpleNamespace(layout="page_first_direct", page_size=PS, layer_num=layers, kv_lora_rank=C - 4,
                               kv_cache_dim=C, kv_buffer=torch.zeros(pages, layers, PS, 1, C, dtype=dtype))
    return SimpleNamespace(layout="page_first_direct", page_size=PS, layer_num=layers, head_num=H, head_dim=D,
                           kv_buffer=torch.zeros(2, pages, layers, PS, H, D, dtype=dtype))


def namespace(pages: HostPages, tp_rank: int = 0, tp_size: int = 1) -> Namespace:
    return pages.namespace("tests/model", tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, extra="")


def test_an_engine_with_another_layer_count_never_finds_these_pages(runtime_dir: str) -> None:
    """Issue 39, finding 6 (found on LMCache; the rule holds for every adapter): every field a page
    header is checked against is in the key. SGLang's namespace is built from the host pool's page
    spec, so another layer count (or any other geometry field) gives other keys for SGLang's own
    page hashes, and a lookup of those never counts these pages."""
    three, two = HostPages(host_pool(3)), HostPages(host_pool(2))
    for pages in (three, two):
        assert namespace(pages).spec == pages.spec          # the pool's pages are what the key names
    assert (three.spec.num_layers, two.spec.num_layers) == (3, 2)
    assert namespace(three).digest != namespace(two).digest
    hashes = [f"{i:064x}" for i in range(1, 4)]             # SGLang's hex page keys, taken as given
    cfg = PofConfig.from_mapping({"node_id": "s", "index_url": "local", "runtime_dir": runtime_dir,
                                  "tiers": {"cpu_dram": {"size": "4MiB"}}})
    pool = Pool(cfg, three.spec, namespace(three).digest)
    try:
        keys = keys_from_hex(pool.namespace, hashes, [])
        page = [torch.zeros(three.spec.segment_bytes, dtype=torch.uint8).numpy()] * three.spec.num_layers
        assert pool.store([(k, page) for k in keys]).result() == len(keys)
        pool.flush()
        assert pool.lookup(keys).pages == len(keys)
        assert pool.lookup(keys_from_hex(namespace(two).digest, hashes, [])).pages == 0
    finally:
        pool.close()


@pytest.mark.parametrize("mla", [False, True])
def test_sglang_and_vllm_name_the_same_pages_alike(mla: bool) -> None:
    """One key space for both engines (test_sglang_cross.py, with a real vLLM server): the same
    model, dtype and geometry give the same namespace, page spec included, on TP rank 0 and 1."""
    pages = HostPages(host_pool(mla=mla))
    vllm = VllmGeometry(model="tests/model", kv_dtype="bfloat16", kv_heads=1 if mla else H, head_dim=C if mla else D,
                        num_layers=L, is_mla=mla, block_size=PS, page_tokens=PS, tp_size=2)
    cfg = PofConfig.from_mapping({"node_id": "v", "index_url": "local"})
    assert vllm.spec == pages.spec
    for rank in (0, 1):
        assert vllm.namespace(cfg, rank) == namespace(pages, rank, 2).digest
    assert (vllm.namespace(cfg, 0) == vllm.namespace(cfg, 1)) == mla      # MLA latents: one namespace for all ranks
