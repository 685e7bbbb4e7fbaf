"""One LMCache engine with pof as its storage plugin, in a process of its own.

    python -m tests.adapters.lmcache_node '{"config": "lmcache.yaml", "op": "store", ...}'

LMCache's real classes throughout (``LMCacheEngineConfig.from_file``, ``LMCacheEngineBuilder``,
its token database, storage manager, ``LocalCPUBackend`` and plugin launcher). The one stand-in
is :class:`HostKV`, for LMCache's GPU connector (``VLLMPagedMemGPUConnectorV2`` asserts a CUDA
device): it copies chunks between LMCache's memory objects and a host tensor playing the engine's
KV memory, ``[2, layers, tokens, hidden]``.

``op``: ``store`` stores the tokens' KV, prints ``{"stored": chunks}`` and keeps the engine (and
its pool node) alive until stdin closes; ``load`` looks the tokens up and retrieves them into
zeroed KV memory and prints what came back; ``bench`` times put and get (``pof bench lmcache``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.metadata import LMCacheMetadata

MODEL = "tests/lmcache-model"
LAYERS, HEADS, HEAD_DIM, CHUNK = 4, 2, 64, 16
DTYPE = torch.bfloat16


def write_config(path: Path, *, node: str, index_url: str, runtime_dir: str, region: str | None,
                 plugin: bool = True, tags: dict[str, str] | None = None) -> Path:
    """An LMCache YAML config as a user writes it: pof listed in ``storage_plugins``, its
    settings under ``extra_config`` ``storage_plugin.pof.*``."""
    extra: dict[str, Any] = {}
    if plugin:
        tiers = {"cxl": {"path": region, "size": "64MiB"}} if region else {"cpu_dram": {"size": "64MiB"}}
        extra = {"storage_plugin.pof.module_path": "pof_connector.adapters.lmcache",
                 "storage_plugin.pof.class_name": "PoFStoragePlugin",
                 "storage_plugin.pof.node_id": node, "storage_plugin.pof.index_url": index_url,
                 "storage_plugin.pof.runtime_dir": runtime_dir, "storage_plugin.pof.heartbeat_s": 0.2,
                 "storage_plugin.pof.tiers": tiers}
    cfg: dict[str, Any] = {
        "chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.25,
        # Chunk hashes must agree across processes: builtin hash() differs per process.
        "pre_caching_hash_algorithm": "sha256_cbor_64bit",
        "storage_plugins": ["pof"] if plugin else [], "extra_config": extra or None,
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


class HostKV(GPUConnectorInterface):  # type: ignore[misc]
    """Stands in for LMCache's GPU connector (CUDA-only): chunk ``[start, end)`` of every layer
    is copied between a memory object (``[2, layers, tokens, hidden]``) and :attr:`kv`."""

    def __init__(self, tokens: int) -> None:
        self.kv = torch.zeros(2, LAYERS, tokens, HEADS * HEAD_DIM, dtype=DTYPE)

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        memory_obj.tensor.copy_(self.kv[:, :, start:end])

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        self.kv[:, :, start:end].copy_(memory_obj.tensor)

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, s, e in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, s, e)

    def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, s, e in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, s, e)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, LAYERS, num_tokens, HEADS * HEAD_DIM])


def expected_kv(seed: int, tokens: int) -> torch.Tensor:
    """The KV bytes a store writes for ``seed`` (random bytes viewed as bf16)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (2, LAYERS, tokens, HEADS * HEAD_DIM * 2), dtype=torch.uint8, generator=g)
    return raw.view(DTYPE)


def prompt(seed: int, chunks: int) -> torch.Tensor:
    return torch.arange(chunks * CHUNK, dtype=torch.long) * 7 + seed * 100_003


def build(config_path: str, instance: str, tokens: int) -> tuple[LMCacheEngine, HostKV]:
    config = LMCacheEngineConfig.from_file(config_path)
    metadata = LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                               kv_dtype=DTYPE, kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM), role="worker",
                               chunk_size=CHUNK)
    host = HostKV(tokens)
    engine = LMCacheEngineBuilder.get_or_create(instance, config, metadata, host, lambda t, r: None,
                                                lambda o, r: o)
    engine.post_init()
    return engine, host


def plugin_of(engine: LMCacheEngine) -> Any:
    """The pof plugin LMCache's launcher created (``None`` when it failed to load)."""
    assert engine.storage_manager is not None
    return engine.storage_manager.storage_backends.get("pof")


def wait_published(engine: LMCacheEngine, n: int, timeout_s: float = 20.0) -> None:
    plugin = plugin_of(engine)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        plugin.pool.flush()
        if plugin.pool.stats.get("stored_pages") >= n:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{n} chunks not stored in {timeout_s} s")


def op_store(engine: LMCacheEngine, host: HostKV, seed: int, chunks: int) -> dict[str, Any]:
    host.kv.copy_(expected_kv(seed, chunks * CHUNK))
    engine.store(prompt(seed, chunks))
    wait_published(engine, chunks)
    return {"stored": chunks, "plugin": type(plugin_of(engine)).__name__}


def op_load(engine: LMCacheEngine, host: HostKV, seed: int, chunks: int) -> dict[str, Any]:
    tokens = prompt(seed, chunks)
    hit = engine.lookup(tokens)
    mask = engine.retrieve(tokens)
    got = int(mask.sum())
    want = expected_kv(seed, chunks * CHUNK)
    equal = bool(torch.equal(host.kv[:, :, :got].view(torch.uint8), want[:, :, :got].view(torch.uint8)))
    untouched = bool(torch.count_nonzero(host.kv[:, :, got:].view(torch.uint8)) == 0)
    plugin = plugin_of(engine)
    return {"lookup_tokens": int(hit), "retrieved_tokens": got, "bytes_equal": equal, "rest_untouched": untouched,
            "plugin": None if plugin is None else type(plugin).__name__,
            "stats": None if plugin is None else plugin.pool.stats.snapshot()}


def main() -> None:
    args = json.loads(sys.argv[1])
    chunks, seed = int(args.get("chunks", 8)), int(args.get("seed", 1))
    engine, host = build(args["config"], args.get("instance", "pof-test"), chunks * CHUNK)
    try:
        if args["op"] == "store":
            print(json.dumps(op_store(engine, host, seed, chunks)), flush=True)
            sys.stdin.read()        # keep the node alive until the test closes stdin
        elif args["op"] == "load":
            print(json.dumps(op_load(engine, host, seed, chunks)), flush=True)
        else:
            raise SystemExit(f"unknown op {args['op']!r}")
    finally:
        LMCacheEngineBuilder.destroy(args.get("instance", "pof-test"))


if __name__ == "__main__":
    main()
