"""``PoFStoragePlugin``: the pool as an LMCache (0.5.x) storage plugin. In LMCache's config::

    chunk_size: 256
    local_cpu: true
    max_local_cpu_size: 5
    storage_plugins: ["pof"]
    extra_config:
      storage_plugin.pof.module_path: pof_connector.adapters.lmcache
      storage_plugin.pof.class_name: PoFStoragePlugin
      storage_plugin.pof.node_id: host-a
      storage_plugin.pof.index_url: redis://10.0.0.5:6379/0
      storage_plugin.pof.tiers: {cxl: {path: /dev/dax0.0, size: 64GiB}, cpu_dram: {size: 8GiB}}

Every ``storage_plugin.<name>.*`` key other than ``module_path`` / ``class_name`` is pof's
configuration (README, "Configuration"); ``<name>`` is whatever the user listed in
``storage_plugins``. LMCache's launcher only logs a plugin that fails to construct, so a bad pof
key shows up as an error line naming the key, and the plugin is absent.

Translation only: chunks go to :class:`~pof_connector.pool.chunk_store.ChunkStore` (keys, page
layout, validated loads live there). Loads return memory objects from LMCache's own allocator
(its ``LocalCPUBackend``). Nothing raises into LMCache: a pool failure is a miss (``None`` /
``False`` / 0), counted in ``pof_adapter_errors_total`` and logged once.

Chunks shorter than ``chunk_size`` (the tail of a prompt) are not stored: a pof page has one
geometry per namespace. LMCache keeps them in its own tiers; from pof such a tail is a miss.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from pof_connector.config import ConfigError, PofConfig
from pof_connector.pages import PageKey
from pof_connector.pool import ChunkGeometry, ChunkOwner, ChunkStore, Pool, Role, chunk_key

log = logging.getLogger("pof_connector.lmcache")

LAUNCHER_KEYS = ("module_path", "class_name")
"""Keys of a plugin's extra config that belong to LMCache's launcher, not to pof."""


def plugin_config(lmcache_config: Any, cls: type) -> tuple[str, PofConfig]:
    """The name this class was listed under in ``storage_plugins`` and pof's config from that
    name's ``storage_plugin.<name>.*`` keys (the launcher does not pass the name)."""
    extra = dict(lmcache_config.extra_config or {})
    for name in lmcache_config.storage_plugins or []:
        prefix = f"storage_plugin.{name}."
        if (extra.get(prefix + "module_path"), extra.get(prefix + "class_name")) == (cls.__module__, cls.__name__):
            ours = {k[len(prefix):]: v for k, v in extra.items() if k.startswith(prefix)}
            raw = {k: v for k, v in ours.items() if k not in LAUNCHER_KEYS}
            return name, PofConfig.from_mapping(raw, source=f"LMCache extra_config {prefix}*")
    raise ConfigError(f"storage_plugins: no entry names {cls.__module__}.{cls.__name__} in extra_config "
                      "storage_plugin.<name>.module_path / class_name")


def geometry_of(metadata: Any) -> ChunkGeometry:
    """A full chunk's geometry from LMCache's metadata (one KV group only)."""
    shapes, dtypes = metadata.get_shapes(), metadata.get_dtypes()
    if len(shapes) != 1:
        raise ConfigError(f"pof stores chunks of one KV group; this model has {len(shapes)} "
                          "(hybrid attention): remove pof from storage_plugins")
    kv, layers, tokens, hidden = (int(x) for x in shapes[0])
    return ChunkGeometry(kv, layers, tokens, hidden * torch.empty((), dtype=dtypes[0]).element_size())


def owner_of(key: CacheEngineKey, model: str | None = None) -> ChunkOwner:
    """The key's owner; ``model`` (pof's ``model`` setting) replaces LMCache's model name."""
    tags = tuple(sorted((str(k), str(v)) for k, v in (key.tags or ())))
    return ChunkOwner(model or key.model_name, int(key.world_size), int(key.worker_id),
                      str(key.dtype).removeprefix("torch."), tags)


def as_bytes(obj: MemoryObj) -> np.ndarray:
    """The memory object's tensor as ``uint8 [kv, layers, tokens, hidden_bytes]``, no copy."""
    t = obj.tensor
    assert t is not None and t.device.type == "cpu", "LMCache hands storage plugins host memory"
    return t.view(torch.uint8).numpy()


class PoFStoragePlugin(StoragePluginInterface):  # type: ignore[misc]
    def __init__(self, dst_device: str = "cpu", config: Any = None, metadata: Any = None,
                 local_cpu_backend: Any = None, loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        self.name, pof_config = plugin_config(config, type(self))
        self.geometry = geometry_of(metadata)
        self.fmt = MemoryFormat.KV_MLA_FMT if metadata.use_mla else MemoryFormat.KV_2LTD
        self.extra_ns = pof_config.namespace
        # pof's `model`, when set, replaces LMCache's model name in every key: engines name a model
        # by its path, which differs between hosts that should share chunks.
        self.model = pof_config.model
        if int(metadata.world_size) > 1:        # each LMCache worker is a pool node of its own
            pof_config = replace(pof_config, node_id=f"{pof_config.node_id}-w{int(metadata.worker_id)}")
        # LMCache's scheduler-side instance only asks `contains`: a client pool answers it from the index.
        role: Role = "client" if metadata.role == "scheduler" else "worker"
        own = ChunkOwner(self.model or str(metadata.model_name), int(metadata.world_size), int(metadata.worker_id),
                         str(metadata.kv_dtype).removeprefix("torch."))
        self.pool = Pool(pof_config, self.geometry.spec, own.namespace(self.geometry, self.extra_ns), role=role,
                         meta={"engine": "lmcache", "model": str(metadata.model_name)})
        self.chunks = ChunkStore(self.pool, self.geometry)
        self._namespaces: dict[ChunkOwner, bytes] = {}
        self._putting: set[CacheEngineKey] = set()
        self._lock = threading.Lock()
        self._io = ThreadPoolExecutor(1, thread_name_prefix="pof-lmcache-put")
        log.info("pof: LMCache plugin %r, node %s (%s), chunks of %d tokens = %d KiB", self.name,
                 pof_config.node_id, role, self.geometry.tokens, self.geometry.spec.page_bytes >> 10)

    def __str__(self) -> str:
        return "PoFStoragePlugin"

    # ---- keys --------------------------------------------------------------------------------

    def _key(self, key: CacheEngineKey) -> PageKey:
        owner = owner_of(key, self.model)
        ns = self._namespaces.get(owner)
        if ns is None:
            ns = self._namespaces[owner] = owner.namespace(self.geometry, self.extra_ns)
        return chunk_key(ns, int(key.chunk_hash))

    def _failed(self, hook: str, err: BaseException) -> None:
        self.pool.report_adapter_error(f"lmcache.{hook}", err)

    # ---- lookups (answered from the index: other nodes' chunks count) -------------------------

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        return self.batched_contains([key], pin) == 1

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        try:
            return self.chunks.count_prefix([self._key(k) for k in keys])
        except Exception as e:
            self._failed("batched_contains", e)
            return 0

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False) -> int:
        return await asyncio.to_thread(self.batched_contains, keys, pin)

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        with self._lock:
            return key in self._putting

    # ---- stores ------------------------------------------------------------------------------

    def batched_submit_put_task(self, keys: Sequence[CacheEngineKey], objs: list[MemoryObj], transfer_spec: Any = None,
                                on_complete_callback: Callable[[CacheEngineKey], None] | None = None,
                                ) -> list[Future[Any]] | None:
        full = [(k, o) for k, o in zip(keys, objs, strict=True) if tuple(o.get_shape())[2] == self.geometry.tokens]
        if not full or self.pool.role != "worker":
            return None
        with self._lock:
            full = [(k, o) for k, o in full if k not in self._putting]
            self._putting.update(k for k, _ in full)
        for _, o in full:
            o.ref_count_up()           # LMCache drops its reference when this call returns
        try:
            return [self._io.submit(self._put, full, on_complete_callback)]
        except RuntimeError:           # closed
            self._release(full)
            return None

    def _put(self, items: list[tuple[CacheEngineKey, MemoryObj]],
             on_complete: Callable[[CacheEngineKey], None] | None) -> int:
        try:
            stored = self.chunks.put([(self._key(k), as_bytes(o)) for k, o in items])
        except Exception as e:
            self._failed("put", e)
            return 0
        finally:
            self._release(items)       # ChunkStore.put copied the bytes
        try:
            n = stored.result()
        except Exception as e:
            self._failed("put", e)
            return 0
        if on_complete is not None:
            for k, _ in items:
                try:
                    on_complete(k)
                except Exception as e:
                    self._failed("put_callback", e)
        return n

    def _release(self, items: list[tuple[CacheEngineKey, MemoryObj]]) -> None:
        with self._lock:
            self._putting.difference_update(k for k, _ in items)
        for _, o in items:
            o.ref_count_down()

    # ---- loads (into LMCache's own allocator) ------------------------------------------------

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        return self.batched_get_blocking([key])[0]

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        out: list[MemoryObj | None] = [None] * len(keys)
        if not keys or self.local_cpu_backend is None:
            return out
        objs: list[MemoryObj] = []
        try:
            shape = torch.Size(self.metadata.get_shapes()[0])
            dtype = self.metadata.get_dtypes()[0]
            for _ in keys:
                obj = self.local_cpu_backend.allocate(shape, dtype, fmt=self.fmt, eviction=True, busy_loop=False)
                if obj is None:        # LMCache's buffer is full: load what fits
                    break
                objs.append(obj)
            ok = self.chunks.get([self._key(k) for k in keys[:len(objs)]], [as_bytes(o) for o in objs])
        except Exception as e:
            self._failed("get", e)
            ok = [False] * len(objs)
        for i, obj in enumerate(objs):
            if ok[i]:
                out[i] = obj
            else:
                obj.ref_count_down()   # a miss: give the buffer back, never hand over unchecked bytes
        return out

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey],
                                       transfer_spec: Any = None) -> list[MemoryObj]:
        """The leading chunks that loaded (LMCache's async loader expects a prefix)."""
        got = await asyncio.to_thread(self.batched_get_blocking, keys)
        prefix: list[MemoryObj] = []
        for i, obj in enumerate(got):
            if obj is None:
                for later in got[i + 1:]:
                    if later is not None:
                        later.ref_count_down()
                break
            prefix.append(obj)
        return prefix

    # ---- what pof does not do per key ---------------------------------------------------------

    def pin(self, key: CacheEngineKey) -> bool:
        """Not supported: pof pins a page only while reading it; one evicted between LMCache's
        lookup and its load is a miss then."""
        return False

    def unpin(self, key: CacheEngineKey) -> bool:
        return False

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        """Not supported: pof evicts by its own policy (LRU per tier)."""
        return False

    def touch_cache(self) -> None:
        return None

    def get_allocator_backend(self) -> Any:
        return self.local_cpu_backend

    def close(self) -> None:
        self._io.shutdown(wait=True)
        self.pool.close()
