"""The worker half of the vLLM connector (Worker process): moves bytes, keeps no books.

Loads: ``start`` asks the pool to copy pages into host staging buffers; ``wait_layer(l)`` waits
for layer ``l`` only and scatters it into vLLM's blocks, so layer 0 computes while later layers
are still being copied. Pages the pool rejects are reported through
``get_block_ids_with_load_errors`` and vLLM recomputes them (``kv_load_failure_policy:
recompute``). Saves: ``save_layer(l)`` gathers the step's newly full pages of layer ``l`` into
staging right after attention wrote them; ``end_step`` hands the staged pages to the pool,
which writes them on its own thread — the forward never waits for a tier.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from pof_connector.adapters.vllm_geometry import VllmGeometry, cpu_block_order
from pof_connector.adapters.vllm_layout import BlockLayout, infer_layout
from pof_connector.adapters.vllm_metadata import LoadJob, PoFConnectorMetadata
from pof_connector.config import PofConfig
from pof_connector.keys import PageKey
from pof_connector.pages import KIND_MHA, KIND_MLA, PageSpec
from pof_connector.pool import LoadHandle, PageViews, Pool
from pof_connector.staging import StagingPool

log = logging.getLogger("pof_connector.vllm")


@dataclass
class _ActiveLoad:
    job: LoadJob
    buffer: np.ndarray                # from the staging pool; segments and headers are views of it
    segments: np.ndarray              # [layers, pages, segment_bytes]: layer l of all pages side by side
    handle: LoadHandle
    failed: set[int] = field(default_factory=set)
    started: float = field(default_factory=time.perf_counter)


@dataclass
class _PendingSave:
    keys: list[PageKey]
    block_ids: torch.Tensor           # every block of these pages, page after page
    segments: np.ndarray              # [layers, pages, segment_bytes]


class PoFWorker:
    def __init__(self, config: PofConfig, geo: VllmGeometry, tp_rank: int, hnd_preferred: bool = False) -> None:
        self.config = config
        self.geo = geo
        self.tp_rank = tp_rank
        self.hnd_preferred = hnd_preferred
        self.pool: Pool | None = None
        self.layout: BlockLayout | None = None
        self.kv: list[torch.Tensor] = []
        self.layer_index: dict[str, int] = {}
        self._loads: list[_ActiveLoad] = []
        self._saves: list[_PendingSave] = []
        self._load_errors: set[int] = set()
        self.staging = StagingPool()
        self.load_latencies: list[float] = []

    # ---- register_kv_caches --------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = list(kv_caches)
        self.kv = [kv_caches[n] for n in names]
        self.layer_index = {n: i for i, n in enumerate(names)}
        geo = self.geo
        order = None
        if self.kv[0].device.type == "cpu" and geo.layout_tag == "canonical" and self.kv[0].dim() == 4:
            order = cpu_block_order(geo.kv_heads, geo.block_size, geo.head_dim, self.kv[0].dtype)
        self.layout = infer_layout(self.kv[0], block_size=geo.block_size, kv_heads=geo.kv_heads,
                                   head_dim=geo.head_dim, is_mla=geo.is_mla, hnd_preferred=self.hnd_preferred,
                                   cpu_order=order)
        if (self.layout.name == "cpu_opaque") != geo.layout_tag.startswith("opaque"):
            raise ValueError(f"pof: the worker's KV layout {self.layout.name} disagrees with the scheduler's "
                             f"{geo.layout_tag}; keys would not match")
        if any(t.shape != self.kv[0].shape or t.dtype != self.kv[0].dtype for t in self.kv):
            raise ValueError("pof: all attention layers must share one KV shape and dtype (hybrid models are "
                             "not supported)")
        spec = PageSpec(len(names), self.layout.segment_bytes(geo.page_tokens), geo.page_tokens,
                        KIND_MLA if geo.is_mla else KIND_MHA)
        config = self.config
        if geo.tp_size > 1:    # each rank stores its own heads; the scheduler looks up rank 0's pages
            config = replace(config, node_id=f"{config.node_id}-tp{self.tp_rank}" if self.tp_rank else config.node_id)
        self.pool = Pool(config, spec, geo.namespace(config, self.tp_rank),
                         meta={"engine": "vllm", "model": geo.model})
        log.info("pof: %d layers, layout %s %s, pages of %d tokens = %d KiB, tiers %s", len(names),
                 self.layout.name, list(self.kv[0].shape), geo.page_tokens, spec.page_bytes >> 10,
                 ", ".join(f"{t.medium}" for t in self.pool.tiers))

    # ---- loads ----------------------------------------------------------------------------------

    def start(self, meta: PoFConnectorMetadata) -> None:
        assert self.pool is not None
        spec = self.pool.spec
        for job in meta.loads:
            n = len(job.keys)
            seg_bytes = spec.num_layers * n * spec.segment_bytes
            buffer = self.staging.take(seg_bytes + n * spec.header_bytes)
            segments = buffer[:seg_bytes].reshape(spec.num_layers, n, spec.segment_bytes)
            headers = buffer[seg_bytes:].reshape(n, spec.header_bytes)
            views = [PageViews(headers[i], [segments[layer, i] for layer in range(spec.num_layers)])
                     for i in range(n)]
            handle = self.pool.load(job.keys, job.sources, views)
            self._loads.append(_ActiveLoad(job, buffer, segments, handle))

    def wait_layer(self, layer_name: str) -> None:
        layer = self.layer_index.get(layer_name)
        if not self._loads or layer is None:      # not a layer whose KV the pool holds
            return
        for active in self._loads:
            if not active.handle.wait_layer(layer, self.config.load_timeout_s):
                active.failed.update(range(len(active.job.keys)))
            active.failed.update(active.handle.failed)
            self._scatter(active, layer)

    def _scatter(self, active: _ActiveLoad, layer: int) -> None:
        """Copy layer ``layer`` of every page that arrived into vLLM's blocks: one engine-side
        copy for all pages (their segments are contiguous in staging)."""
        assert self.layout is not None
        job, lay, bpp = active.job, self.layout, self.geo.blocks_per_page
        n = len(job.keys)
        pages = torch.from_numpy(active.segments[layer]).view(lay.dtype).view(n, *lay.canonical_shape(
            self.geo.page_tokens))
        ok = [i for i in range(n) if i not in active.failed]
        if not ok:
            return
        if len(ok) < n:
            pages = pages[ok]
        blocks = lay.pages_to_blocks(pages, bpp)
        ids = [b for i in ok for b in job.block_ids[i]]
        skip = job.skip_blocks if ok[0] == 0 else 0      # the first page's head is the engine's own
        if skip:
            blocks, ids = blocks[skip:], ids[skip:]
        kv = self.kv[layer]
        lay.scatter(kv, torch.tensor(ids, dtype=torch.long, device=kv.device), blocks)

    def _finish_loads(self) -> None:
        """After the forward: every layer was waited for; report failed pages' blocks."""
        for active in self._loads:
            if not active.handle.wait(self.config.load_timeout_s):
                active.failed.update(range(len(active.job.keys)))
            active.failed.update(active.handle.failed)
            for i in active.failed:
                self._load_errors.update(active.job.block_ids[i][active.job.skip_blocks if i == 0 else 0:])
            self.load_latencies.append(time.perf_counter() - active.started)
            if active.failed:
                log.warning("pof: request %s: %d of %d pages failed to load; vLLM recomputes them",
                            active.job.req_id, len(active.failed), len(active.job.keys))
            if active.handle.done:       # a load that timed out may still write: never reuse its buffer
                self.staging.give(active.buffer)
        self._loads = []

    def fail_jobs(self, jobs: list[LoadJob]) -> None:
        """Report every block these loads promised as a load error (vLLM recomputes them)."""
        for job in jobs:
            for i, blocks in enumerate(job.block_ids):
                self._load_errors.update(blocks[job.skip_blocks if i == 0 else 0:])

    def report_failed_blocks(self, blocks: list[int]) -> None:
        self._load_errors.update(blocks)

    def abort_loads(self) -> None:
        """Give up on this step's loads after an unexpected error: all their blocks are recomputed."""
        self.fail_jobs([a.job for a in self._loads])
        self._loads = []           # their buffers are not reused: a copy may still be under way

    def drop_saves(self) -> None:
        self._saves = []

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- saves ----------------------------------------------------------------------------------

    def prepare_saves(self, meta: PoFConnectorMetadata) -> None:
        """Pick the pages to save this step (skipping those this node stores already)."""
        assert self.pool is not None
        spec = self.pool.spec
        for job in meta.saves:
            keep = [i for i, k in enumerate(job.keys) if not self.pool.contains(k)]
            if not keep:
                continue
            blocks = [b for i in keep for b in job.block_ids[i]]
            buffer = self.staging.take(spec.num_layers * len(keep) * spec.segment_bytes)
            self._saves.append(_PendingSave([job.keys[i] for i in keep],
                                            torch.tensor(blocks, dtype=torch.long, device=self.kv[0].device),
                                            buffer.reshape(spec.num_layers, len(keep), spec.segment_bytes)))

    def save_layer(self, layer_name: str) -> None:
        layer = self.layer_index.get(layer_name)
        if not self._saves or layer is None:
            return
        assert self.layout is not None and self.pool is not None
        lay, P = self.layout, self.geo.page_tokens
        for save in self._saves:
            pages = lay.blocks_to_pages(lay.gather(self.kv[layer], save.block_ids), self.geo.blocks_per_page)
            dst = torch.from_numpy(save.segments[layer]).view(lay.dtype).view(len(save.keys), *lay.canonical_shape(P))
            dst.copy_(pages)

    def end_step(self) -> None:
        """After the forward: report loads, hand staged pages to the pool's store thread."""
        self._finish_loads()
        if not self._saves:
            return
        assert self.pool is not None
        layers = self.pool.spec.num_layers
        items: list[tuple[PageKey, list[np.ndarray]]] = []
        buffers: list[np.ndarray] = []
        for save in self._saves:
            for i, key in enumerate(save.keys):
                items.append((key, [save.segments[layer, i] for layer in range(layers)]))
            buffers.append(save.segments)
        self._saves = []
        def release(_: object) -> None:      # the buffers are reusable once the pool wrote them
            for b in buffers:
                self.staging.give(b)

        self.pool.store(items).add_done_callback(release)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
