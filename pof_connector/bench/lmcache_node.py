"""One LMCache engine with pof as its storage plugin, in a process of its own.

    python -m pof_connector.bench.lmcache_node '{"config": "lmcache.yaml", "op": "store", ...}'

Used by the tests (tests/adapters/test_lmcache.py) and ``pof bench lmcache``; needs the LMCache
venv (ci/lmcache_venv.sh).

LMCache's real classes throughout (``LMCacheEngineConfig.from_file``, ``LMCacheEngineBuilder``,
its token database, storage manager, ``LocalCPUBackend`` and plugin launcher). The one stand-in
is :class:`HostKV`, for LMCache's GPU connector (``VLLMPagedMemGPUConnectorV2`` asserts a CUDA
device): it copies chunks between LMCache's memory objects and a host tensor playing the engine's
KV memory, ``[2, layers, tokens, hidden]``.

``op``: ``store`` stores the tokens' KV, prints ``{"stored": chunks}`` and keeps the engine (and
its pool node) alive until stdin closes; ``load`` looks the tokens up and retrieves them into
zeroed KV memory and prints what came back. ``rounds`` > 1 (the bench) repeats either with seeds
``seed .. seed + rounds - 1`` and reports each round's seconds.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.metadata import LMCacheMetadata

MODEL = "pof/lmcache-bench-model"
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Shape:
    """The model LMCache is told about: its KV geometry and LMCache's chunk size."""

    layers: int = 4
    heads: int = 2
    head_dim: int = 64
    chunk: int = 16

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    @property
    def chunk_bytes(self) -> int:
        return 2 * self.layers * self.chunk * self.hidden * int(DTYPE.itemsize)


def write_config(path: Path, *, node: str, index_url: str, runtime_dir: str, region: str | None,
                 plugin: bool = True, shape: Shape = Shape(), local_cpu_gb: float = 0.25,
                 region_size: str = "64MiB") -> Path:
    """An LMCache YAML config as a user writes it: pof listed in ``storage_plugins``, its
    settings under ``extra_config`` ``storage_plugin.pof.*``. ``region``: the CXL region file
    (``None``: a DRAM tier)."""
    extra: dict[str, Any] = {}
    if plugin:
        tiers = {"cxl": {"path": region, "size": region_size}} if region else {"cpu_dram": {"size": region_size}}
        extra = {"storage_plugin.pof.module_path": "pof_connector.adapters.lmcache",
                 "storage_plugin.pof.class_name": "PoFStoragePlugin",
                 "storage_plugin.pof.node_id": node, "storage_plugin.pof.index_url": index_url,
                 "storage_plugin.pof.runtime_dir": runtime_dir, "storage_plugin.pof.heartbeat_s": 0.2,
                 "storage_plugin.pof.tiers": tiers}
    cfg: dict[str, Any] = {
        "chunk_size": shape.chunk, "local_cpu": True, "max_local_cpu_size": local_cpu_gb,
        # Without vLLM installed LMCache falls back to Python's hash() for every algorithm named
        # here: the processes must share PYTHONHASHSEED (the callers set it).
        "pre_caching_hash_algorithm": "sha256_cbor_64bit",
        "storage_plugins": ["pof"] if plugin else [], "extra_config": extra or None,
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


class HostKV(GPUConnectorInterface):  # type: ignore[misc]
    """Stands in for LMCache's GPU connector (CUDA-only): chunk ``[start, end)`` of every layer
    is copied between a memory object (``[2, layers, tokens, hidden]``) and :attr:`kv`."""

    def __init__(self, shape: Shape, tokens: int) -> None:
        self.shape = shape
        self.kv = torch.zeros(2, shape.layers, tokens, shape.hidden, dtype=DTYPE)

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
        return torch.Size([2, self.shape.layers, num_tokens, self.shape.hidden])


def expected_kv(seed: int, shape: Shape, tokens: int) -> torch.Tensor:
    """The KV bytes a store writes for ``seed`` (random bytes viewed as bf16)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (2, shape.layers, tokens, shape.hidden * DTYPE.itemsize), dtype=torch.uint8,
                        generator=g)
    return raw.view(DTYPE)


def prompt(seed: int, shape: Shape, chunks: int) -> torch.Tensor:
    return torch.arange(chunks * shape.chunk, dtype=torch.long) * 7 + seed * 100_003


def build(config_path: str, instance: str, shape: Shape, tokens: int,
          role: str = "worker") -> tuple[LMCacheEngine, HostKV]:
    """``role``: LMCache's ``worker`` (stores, retrieves) or ``scheduler`` (lookups only)."""
    config = LMCacheEngineConfig.from_file(config_path)
    metadata = LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                               kv_dtype=DTYPE, kv_shape=(shape.layers, 2, shape.chunk, shape.heads, shape.head_dim),
                               role=role, chunk_size=shape.chunk)
    host = HostKV(shape, tokens)
    engine = LMCacheEngineBuilder.get_or_create(instance, config, metadata, host, lambda t, r: None,
                                                lambda o, r: o)
    engine.post_init()
    return engine, host


def plugin_of(engine: LMCacheEngine) -> Any:
    """The pof plugin LMCache's launcher created (``None`` when it failed to load)."""
    assert engine.storage_manager is not None
    return engine.storage_manager.storage_backends.get("pof")


def wait_stored(engine: LMCacheEngine, n: int, timeout_s: float = 60.0) -> None:
    """Wait until pof wrote and published ``n`` chunks in all (a no-op without the plugin)."""
    plugin = plugin_of(engine)
    if plugin is None:
        return
    deadline = time.monotonic() + timeout_s
    while plugin.pool.stats.get("stored_pages") < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{n} chunks not stored in {timeout_s} s")
        time.sleep(0.002)
    plugin.pool.flush()


def _request_configs(tags: dict[str, str] | None) -> dict[str, str] | None:
    """LMCache's per-request tags (a tenant, …): ``lmcache.tag.<name>`` entries of ``request_configs``."""
    return {f"lmcache.tag.{k}": v for k, v in tags.items()} if tags else None


def _contains(engine: LMCacheEngine, tokens: torch.Tensor, tags: dict[str, str] | None) -> int | None:
    """How many of the prompt's chunks the pof plugin says it holds, asked one key at a time as
    LMCache's storage manager does (``None``: no plugin)."""
    plugin = plugin_of(engine)
    if plugin is None:
        return None
    chunks = engine.token_database.process_tokens(tokens, request_configs=_request_configs(tags))
    return sum(bool(plugin.contains(key)) for _, _, key in chunks)


def op_store(engine: LMCacheEngine, host: HostKV, seeds: range, chunks: int,
             tags: dict[str, str] | None = None) -> dict[str, Any]:
    put_s, durable_s = [], []
    for r, seed in enumerate(seeds):
        host.kv.copy_(expected_kv(seed, host.shape, chunks * host.shape.chunk))
        t0 = time.perf_counter()
        engine.store(prompt(seed, host.shape, chunks), request_configs=_request_configs(tags))
        put_s.append(time.perf_counter() - t0)
        wait_stored(engine, chunks * (r + 1))
        durable_s.append(time.perf_counter() - t0)
    plugin = plugin_of(engine)
    return {"stored": chunks, "plugin": None if plugin is None else type(plugin).__name__,
            "put_s": put_s, "in_pof_s": durable_s if plugin is not None else None}


def op_load(engine: LMCacheEngine, host: HostKV, seeds: range, chunks: int,
            tags: dict[str, str] | None = None) -> dict[str, Any]:
    shape = host.shape
    get_s: list[float] = []
    out: dict[str, Any] = {}
    for seed in seeds:
        tokens = prompt(seed, shape, chunks)
        host.kv.zero_()
        t0 = time.perf_counter()
        hit = engine.lookup(tokens, request_configs=_request_configs(tags))
        mask = engine.retrieve(tokens, request_configs=_request_configs(tags))
        get_s.append(time.perf_counter() - t0)
        contains = _contains(engine, tokens, tags)      # the plugin asked directly, outside the timing
        got = int(mask.sum())
        want = expected_kv(seed, shape, chunks * shape.chunk)
        equal = bool(torch.equal(host.kv[:, :, :got].view(torch.uint8), want[:, :, :got].view(torch.uint8)))
        untouched = bool(torch.count_nonzero(host.kv[:, :, got:].view(torch.uint8)) == 0)
        equal = equal and out.get("bytes_equal", True)
        out = {"lookup_tokens": int(hit), "contains": contains, "retrieved_tokens": got, "bytes_equal": equal,
               "rest_untouched": untouched}
    plugin = plugin_of(engine)
    return {**out, "get_s": get_s, "plugin": None if plugin is None else type(plugin).__name__,
            "stats": None if plugin is None else plugin.pool.stats.snapshot()}


def main() -> None:
    args = json.loads(sys.argv[1])
    shape = Shape(**args.get("shape", {}))
    chunks, seed, rounds = int(args.get("chunks", 8)), int(args.get("seed", 1)), int(args.get("rounds", 1))
    instance = args.get("instance", "pof-node")
    tags = args.get("tags")
    engine, host = build(args["config"], instance, shape, chunks * shape.chunk, args.get("role", "worker"))
    seeds = range(seed, seed + rounds)
    try:
        if args["op"] == "store":
            print(json.dumps(op_store(engine, host, seeds, chunks, tags)), flush=True)
            sys.stdin.read()        # keep the node alive until the caller closes stdin
        elif args["op"] == "load":
            print(json.dumps(op_load(engine, host, seeds, chunks, tags)), flush=True)
        elif args["op"] == "lookup":
            tokens = prompt(seed, shape, chunks)
            hit = engine.lookup(tokens, request_configs=_request_configs(tags))
            plugin = plugin_of(engine)
            print(json.dumps({"lookup_tokens": int(hit), "plugin": None if plugin is None else type(plugin).__name__,
                              "pool_role": None if plugin is None else plugin.pool.role}), flush=True)
        elif args["op"] == "both":  # store, then retrieve from the same engine (LMCache's local_cpu)
            stored = op_store(engine, host, seeds, chunks)
            print(json.dumps({**stored, **op_load(engine, host, seeds, chunks)}), flush=True)
        else:
            raise SystemExit(f"unknown op {args['op']!r}")
    finally:
        LMCacheEngineBuilder.destroy(instance)


if __name__ == "__main__":
    main()
