"""``PoFHiCacheStorage``: the pool as a HiCache storage backend of a stock SGLang server::

    --enable-hierarchical-cache --page-size 64 --hicache-mem-layout page_first_direct \\
    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name":"pof","module_path":"pof_connector.adapters.sglang","class_name":"PoFHiCacheStorage",
        "interface_v1":1,"node_id":"s1","index_url":"redis://127.0.0.1:6379/0","tiers":{"cpu_dram":{"size":"4GiB"}}}'

The extra config is pof's config (README, "Configuration") plus SGLang's own keys. SGLang hands
over its page keys (chained sha256 hex digests of the page tokens, seeded by ``cache_salt`` /
``extra_key``): they are taken as given and put in pof's namespace (model, dtype, page geometry,
TP rank, and PP stage when there are several), which is the one vLLM's adapter uses — so a prefix
one engine stored is found and loaded by the other when both run the same model and dtype with
the same page size (SGLang ``--page-size`` = vLLM ``--block-size`` × n with pof ``page_tokens``
equal to it) and the same ``model`` string in pof's config.

Every SGLang scheduler process (TP rank, PP stage, attention-DP rank) is a pool node of its own
(:func:`rank_node_id`). Context parallelism (``attn_cp_size``, ``dcp_size`` > 1) is refused at
start-up: its ranks hold different slices of a page under one key. MLA ranks share keys (the
latent is the same on every rank) and SGLang lets only TP rank 0 store; the other ranks load
rank 0's pages only from a tier they share with it (one CXL region) or over the fabric. With
private DRAM tiers and no fabric they find nothing, and SGLang, which takes the minimum hit over
the TP group, then loads nothing on any rank: a miss, never wrong KV.

Every batch call runs on SGLang's storage threads, is thread-safe, never raises and never
returns ``None``: a failure is logged once, counted, and answered as a miss. A store copies the
pages into a staging buffer and waits up to ``STORE_TIMEOUT_S`` for the pool; one that takes
longer answers ``False`` but stays queued, and its buffer is reused only once the pool wrote it.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from pof_connector.adapters.sglang_layout import HostPages
from pof_connector.config import ConfigError, PofConfig
from pof_connector.pages import PageKey, keys_from_hex
from pof_connector.pool import Pool, StagingPool

log = logging.getLogger("pof_connector.sglang")

SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "hicache_storage_pass_prefix_keys",
               "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token")
"""Keys of the extra config that belong to SGLang's loader, not to pof."""
STORE_TIMEOUT_S = 30.0
"""How long ``batch_set`` waits for the pool's store thread before answering ``False``."""


def rank_node_id(node_id: str, storage_config: Any) -> str:
    """``node_id`` made unique per SGLang scheduler process (processes sharing a node id would
    take turns claiming it in the index): ``-tp{r}`` and ``-pp{r}`` for each of TP and PP larger
    than one, and ``-dp{r}`` for attention-DP ranks other than 0 (with attention DP, ``tp_rank``
    is the rank inside a DP group; SGLang 0.5.23 passes ``dp_rank`` but no DP size)."""
    sc = storage_config
    for tag, rank, size in (("tp", sc.tp_rank, sc.tp_size), ("pp", sc.pp_rank, sc.pp_size)):
        if int(size) > 1:
            node_id += f"-{tag}{int(rank)}"
    dp_rank = int(getattr(sc, "dp_rank", 0))
    return f"{node_id}-dp{dp_rank}" if dp_rank else node_id


class PoFHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        extra = {k: v for k, v in (storage_config.extra_config or {}).items() if k not in SGLANG_KEYS}
        self.config = PofConfig.from_mapping(extra, source="hicache-storage-backend-extra-config")
        self.storage_config = storage_config
        self.pool: Pool | None = None
        self.pages: HostPages | None = None
        self.namespace = b""
        self.staging = StagingPool(keep_bytes=256 << 20)
        self._overdue = 0               # stores that timed out and are still queued in the pool
        self._overdue_lock = threading.Lock()
        self._told_prefix = False

    # ---- set-up (errors here fail SGLang's start-up, with the key named) --------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        pages = HostPages(mem_pool_host)
        if self.config.page_tokens not in (None, pages.page_size):
            raise ConfigError(f"page_tokens: {self.config.page_tokens} differs from SGLang's --page-size "
                              f"{pages.page_size}; allowed: {pages.page_size} (or unset)")
        sc = self.storage_config
        for field in ("attn_cp_size", "dcp_size"):
            # Each (decode) context-parallel rank holds its own slice of every page, under the same
            # page key (SGLang's file backend adds the CP rank or DCP shard to its keys): pof's
            # namespace does not, so one rank could load another's slice with every check passing.
            if int(getattr(sc, field, 1)) > 1:
                raise ConfigError(f"pof does not support (decode) context parallelism: {field} is "
                                  f"{getattr(sc, field)}; allowed: 1")
        model = self.config.model or str(sc.model_name)
        self.namespace = pages.namespace(model, tp_rank=int(sc.tp_rank), tp_size=int(sc.tp_size),
                                         pp_rank=int(sc.pp_rank), pp_size=int(sc.pp_size),
                                         extra=self.config.namespace).digest
        spec = pages.spec
        config = replace(self.config, node_id=rank_node_id(self.config.node_id, sc))
        self.pages = pages
        self.pool = Pool(config, spec, self.namespace, meta={"engine": "sglang", "model": model})
        log.info("pof: SGLang host pool %s, %d layers, pages of %d tokens = %d KiB, model %s", pages.layout,
                 pages.num_layers, pages.page_size, spec.page_bytes >> 10, model)

    def _keys(self, keys: list[str], extra_info: Any, *, reading: bool) -> list[PageKey]:
        """pof keys for SGLang's, placed in their chain where SGLang says what comes before them
        (``extra_info.prefix_keys``, passed with ``hicache_storage_pass_prefix_keys``): the index
        keeps placed pages in segments (how vLLM publishes), placeless ones in per-page fields.
        Without it, a read takes the keys as the chain's first pages, the one place SGLang asks
        from when its host memory holds none of the prefix: a wrong guess is a miss (the index
        checks each page's digest, the load its header), never a wrong page. A store is never
        guessed: a page published in the wrong segment is lost to the engines that place it."""
        prefix = getattr(extra_info, "prefix_keys", None)
        if prefix is None and not self._told_prefix:
            self._told_prefix = True
            log.info("pof: SGLang does not pass prefix keys: pages vLLM (or SGLang with them) published "
                     "are found only from a prompt's start; set \"hicache_storage_pass_prefix_keys\": true "
                     "in --hicache-storage-backend-extra-config to find them anywhere")
        if prefix is None and reading:
            prefix = []
        return keys_from_hex(self.namespace, keys, prefix)

    def _failed(self, hook: str, err: Exception) -> None:
        if self.pool is not None:
            self.pool.report_adapter_error(hook, err)
        else:
            log.exception("pof: %s called before register_mem_pool_host", hook)

    # ---- the zero-copy (v1) interface ----------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages the pool can load (this node's tiers and what it can read)."""
        try:
            assert self.pool is not None
            return int(self.pool.lookup(self._keys(list(keys), extra_info, reading=True)).pages)
        except Exception as e:
            self._failed("batch_exists", e)
            return 0

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        try:
            ps = self._pages().page_size
            return self._store([(k, int(host_indices[i * ps])) for i, k in enumerate(keys)], None, extra_info)
        except Exception as e:
            self._failed("batch_set_v1", e)
            return [False] * len(keys)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        try:
            pages = self._pages()
            ps = pages.page_size
            starts = [int(host_indices[i * ps]) for i in range(len(keys))]
            return self._load(list(keys), lambda i, layer: pages.layer(starts[i], layer), extra_info)
        except Exception as e:
            self._failed("batch_get_v1", e)
            return [False] * len(keys)

    # ---- the legacy interface (flat pages) ------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        try:
            return all(self._store([(k, 0) for k in keys], list(values or []), None))
        except Exception as e:
            self._failed("batch_set", e)
            return False

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        try:
            pages = self._pages()
            targets = [t if t is not None else self.mem_pool_host.get_dummy_flat_data_page()
                       for t in (target_locations or [None] * len(keys))]
            ok = self._load(list(keys), lambda i, layer: pages.flat_layer(targets[i], layer), None)
            return [t if good else None for t, good in zip(targets, ok, strict=True)]
        except Exception as e:
            self._failed("batch_get", e)
            return [None] * len(keys)

    def clear(self) -> None:
        """Pages belong to the cluster pool, not to this server: nothing is deleted."""
        log.info("pof: clear() ignored: the pool is shared; pages age out by LRU")

    def get_stats(self) -> None:
        return None       # pof's counters are Prometheus metrics (pof_*), not SGLang StorageMetrics

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    # ---- translation ----------------------------------------------------------------------------

    def _pages(self) -> HostPages:
        if self.pages is None or self.pool is None:
            raise RuntimeError("register_mem_pool_host was not called")
        return self.pages

    def _store(self, pages_at: list[tuple[str, int]], flat: list[Any] | None, extra_info: Any) -> list[bool]:
        """Copy pages (host pool page starts, or legacy flat pages) into canonical staging, then
        into the pool; a page this node already stores counts as stored. ``False`` for a page not
        stored within ``STORE_TIMEOUT_S`` (it may still be written later) and, while such a store
        is queued, for every new one: nothing piles up behind a stalled store thread."""
        pages, pool = self._pages(), self.pool
        assert pool is not None
        keys = self._keys([k for k, _ in pages_at], extra_info, reading=False)
        todo = [i for i, k in enumerate(keys) if not pool.contains(k)]
        if not todo:
            return [True] * len(keys)
        with self._overdue_lock:
            if self._overdue:
                return [False] * len(keys)
        L, seg = pages.num_layers, pages.segment_bytes
        buf = self.staging.take(len(todo) * L * seg).reshape(len(todo), L, seg)
        try:
            items = []
            for j, i in enumerate(todo):
                for layer in range(L):
                    src = pages.flat_layer(flat[i], layer) if flat is not None else pages.layer(pages_at[i][1], layer)
                    torch.from_numpy(buf[j, layer]).view(pages.dtype).view(pages.canonical_shape).copy_(src)
                items.append((keys[i], [buf[j, layer] for layer in range(L)]))
            stored = pool.store(items)
        except BaseException:
            self.staging.give(buf.reshape(-1))      # nothing was queued: the buffer is ours again
            raise
        # The queued write reads the buffer until the future is done, even after we stop waiting:
        # handing it back earlier would let the next store overwrite a page while it is copied
        # (and checksummed) into the tier, publishing a mixed page that passes every check.
        stored.add_done_callback(lambda _: self.staging.give(buf.reshape(-1)))
        try:
            stored.result(timeout=STORE_TIMEOUT_S)
        except FutureTimeout:
            self._wait_in_background(stored)
            return [False] * len(keys)
        return [pool.contains(k) for k in keys]

    def _wait_in_background(self, stored: Future[int]) -> None:
        """Count ``stored`` as overdue until it is done (see :meth:`_store`)."""
        def done(_: object) -> None:
            with self._overdue_lock:
                self._overdue -= 1

        with self._overdue_lock:
            self._overdue += 1
        stored.add_done_callback(done)       # runs at once if it finished meanwhile
        log.warning("pof: a store took over %g s; SGLang is told it failed, later stores are refused until "
                    "it is written", STORE_TIMEOUT_S)

    def _load_layer(self, reader: Any, i: int, layer: int, dst: Any) -> bool:
        """Layer ``layer`` of page ``i`` into ``dst`` (a canonical view into SGLang's memory),
        checked as it landed there: summed as it is copied where ``dst`` is contiguous, else
        summed from ``dst`` after the copy."""
        if dst.is_contiguous() and dst.device.type == "cpu":
            return bool(reader.copy_into(i, layer, dst))
        seg = reader.segment(i, layer)
        if seg is None:
            return False
        pages = self._pages()
        dst.copy_(torch.from_numpy(seg).view(pages.dtype).view(pages.canonical_shape))
        landed = dst.contiguous().cpu().view(-1).view(torch.uint8).numpy()
        return bool(reader.check(i, layer, reader.landed_sum(i, landed)))

    def _load(self, hex_keys: list[str], dest: Any, extra_info: Any) -> list[bool]:
        """Copy the leading pages the pool has, layer by layer, straight from tier memory into
        ``dest(page, layer)`` (a canonical view into SGLang's memory), checking each copy."""
        pages, pool = self._pages(), self.pool
        assert pool is not None
        keys = self._keys(hex_keys, extra_info, reading=True)
        found = pool.lookup(keys)
        ok = [False] * len(keys)
        reader = pool.open_read(keys[:found.pages], found.sources)
        try:
            for i in range(found.pages):
                good = True
                for layer in range(pages.num_layers):
                    if not self._load_layer(reader, i, layer, dest(i, layer)):
                        good = False
                        break
                ok[i] = good
        finally:
            reader.close()
        return ok
