"""End to end on a GPU host: two vLLM servers with LMCache's ``LMCacheConnectorV1``, pof as
LMCache's storage plugin. Server A answers a prompt (LMCache stores its chunks, pof keeps them in
a CXL region shared with B and publishes them in the index); server B, whose own caches are empty,
gets the prompt's KV as external hits through LMCache + pof, and answers with the same greedy tokens.

Does not run on a CPU host: LMCache's GPU-connector factory has no CPU branch
(``RuntimeError: No supported cpu connector found.``, docs/engines/lmcache-0.5.6-storage-plugin.md §5).
Run by ci/gpu_check.sh when its Python has vLLM and LMCache.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

from pof_connector.bench.lmcache_node import Shape, write_config
from pof_connector.bench.vllm_server import VllmServer, build_model
from pof_connector.index.embedded import stop_embedded


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


pytestmark = [
    pytest.mark.lmcache, pytest.mark.gpu, pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None or not _cuda(),
                       reason="needs vLLM on a CUDA GPU (LMCacheConnectorV1 has no CPU path)"),
]

CHUNK = 64
PROMPT = [(i * 7919) % 1500 + 10 for i in range(8 * CHUNK)]


def _server(model: Path, work: Path, name: str, config: Path) -> VllmServer:
    env = {"LMCACHE_CONFIG_FILE": str(config), "LMCACHE_TRACK_USAGE": "false", "PYTHONHASHSEED": "0"}
    return VllmServer(model, work / name, kv_transfer={"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"},
                      max_model_len=2048, extra_args=["--gpu-memory-utilization", "0.3"], env=env)


def test_a_prompt_stored_by_one_server_is_an_external_hit_on_another(tmp_path: Path, runtime_dir: str,
                                                                      shm_path: str) -> None:
    model = build_model("tiny")
    shape = Shape(chunk=CHUNK)
    configs = {n: write_config(tmp_path / f"{n}.yaml", node=n, index_url="embedded", runtime_dir=runtime_dir,
                               region=shm_path, shape=shape, local_cpu_gb=1.0, region_size="1GiB")
               for n in ("a", "b")}
    a = _server(model, tmp_path, "a", configs["a"]).start()
    b = None
    try:
        want = a.complete(PROMPT, max_tokens=16)
        time.sleep(3)                                   # pof publishes in the background
        b = _server(model, tmp_path, "b", configs["b"]).start()
        got = b.complete(PROMPT, max_tokens=16)
        assert got == want
        assert b.metrics().get("vllm:external_prefix_cache_hits_total", 0) >= len(PROMPT) - CHUNK
    finally:
        if b is not None:
            b.stop()
        a.stop()
        stop_embedded(runtime_dir)
