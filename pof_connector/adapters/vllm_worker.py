"""The worker half of the vLLM connector (Worker process): moves bytes, keeps no books.

Loads: ``start`` opens a zero-copy read of the pages (headers checked, slots pinned) and starts
a :class:`LayerLoader`: layer after layer in model order, it copies each layer of every page
straight from tier memory into vLLM's blocks (converting the layout on the way) and checks the
copied bytes' checksum and the slot's generation. ``wait_layer(l)``, called right before layer
``l``'s attention, waits only for that layer. Where a core is free for it (a GPU engine, or a CPU
engine whose threads leave a core idle) the loader runs on a thread of its own, so layer
``l + 1`` is copied while the engine computes layer ``l``; where the forward keeps every core
busy (vLLM on the CPU, by default), it copies each layer right before the engine reads it, on
the forward's thread and the native kernel's helper threads on the cores torch's threads leave
idle meanwhile (one native call per layer copies its pages side by side: one core does not fill
the memory bandwidth) — measured, a copy overlapping the forward there stalls the engine's
OpenMP threads for longer than the copy takes. The CPU layouts with a native kernel copy once
per byte; every other cache (a GPU's above all) goes through :mod:`.vllm_device`: batched torch
copies on pof's own CUDA streams, ordered with the engine's by events, the landed bytes summed
on the device. Pages that fail are reported through ``get_block_ids_with_load_errors`` after the
forward, in the same step (the loader is joined first), and vLLM recomputes them
(``kv_load_failure_policy: recompute``).

Saves: ``save_layer(l)`` gathers the step's newly full pages of layer ``l`` into staging right
after attention wrote them; ``end_step`` hands the staged pages to the pool,
which writes them on its own thread — the forward never waits for a tier. They are the methods of
:class:`~pof_connector.adapters.vllm_worker_saves.WorkerSaves`, a base of :class:`PoFWorker`.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from pof_connector.adapters.layer_loader import LayerLoader, copy_threads, core_to_spare
from pof_connector.adapters.vllm_audits import WorkerAudits
from pof_connector.adapters.vllm_device import HostPins, Lane, PlannedPage, StepLoads, StepSaves, pinned_buffer
from pof_connector.adapters.vllm_faults import WriterFaults
from pof_connector.adapters.vllm_geometry import VllmGeometry, cpu_block_order
from pof_connector.adapters.vllm_layout import BlockLayout, infer_layout, view_layout
from pof_connector.adapters.vllm_metadata import LoadJob, PoFConnectorMetadata, PoFWorkerMeta
from pof_connector.adapters.vllm_worker_saves import WorkerSaves, _PendingSave
from pof_connector.audit.auditor import Auditor
from pof_connector.config import PofConfig
from pof_connector.pages import KIND_MHA, KIND_MLA, PageKey, PageSpec, page_sum
from pof_connector.pool import PageReader, Pool, StagingPool

log = logging.getLogger("pof_connector.vllm")


@dataclass
class _ActiveLoad:
    job: LoadJob
    reader: PageReader
    started: float = field(default_factory=time.perf_counter)
    targets: list[tuple[list[int], int]] = field(init=False)
    """Per page: the blocks it writes and how many of its leading blocks it skips (the engine's own)."""
    seeds: list[int | None] = field(init=False)
    """Per page, once its first segment was read: its checksum seed (it holds for the whole read)."""

    def __post_init__(self) -> None:
        self.targets = [(self.job.blocks_to_load(i), self.job.first_block(i)) for i in range(self.readable)]
        self.seeds = [None] * self.readable

    @property
    def readable(self) -> int:
        """The job's leading pages the reader covers (those with a source); the rest this rank's
        pool does not hold, and they fail."""
        return len(self.job.sources)


class PoFWorker(WorkerSaves):
    def __init__(self, config: PofConfig, geo: VllmGeometry, tp_rank: int, pp_rank: int = 0,
                 overlap: bool | None = None, cpu_attention: bool | None = None) -> None:
        """``overlap``: copy loads on a thread of their own while the engine computes (``True``)
        or on the engine's thread, each layer right before it is read (``False``); ``None``:
        decided at :meth:`register` by :func:`core_to_spare`. ``cpu_attention``: whether vLLM's
        CPU attention kernel writes the KV blocks (its own block order, probed) or a GPU backend
        (K|V or MLA's latent per token, any ``KVCacheLayout``); ``None``: by the tensors' device
        (the GPU harness runs the GPU path on CPU tensors with ``False``)."""
        self.config = config
        self.geo = geo
        self.tp_rank = tp_rank
        self.pp_rank = pp_rank
        self.cpu_attention = cpu_attention
        self.pool: Pool | None = None
        self.layout: BlockLayout | None = None
        self.kv: list[torch.Tensor] = []
        self.layer_index: dict[str, int] = {}
        self._loads: list[_ActiveLoad] = []
        self._loader: LayerLoader | None = None      # copying this step's loads
        self._load_thread: ThreadPoolExecutor | None = None
        self.overlap = overlap
        self.copy_threads = 1       # threads copying a layer's pages side by side (set by register)
        self._saves: list[_PendingSave] = []
        self._strided: StepLoads | None = None     # this step's loads by torch copies (a GPU, or no fused kernel)
        self._step_saves: StepSaves | None = None
        self._load_lane = self._save_lane = Lane(torch.device("cpu"))    # pof's streams (register: the engine's device)
        self._load_errors: set[int] = set()
        self._tainted: set[str] = set()   # requests computing on top of a failed load: store nothing of them
        self._step = 0                    # the scheduler's number of the step being run
        self._hold = False                # this step's saves wait for the scheduler's verdict
        # step -> (request, its held store, the digests of its pages)
        self._held: dict[int, list[tuple[str, Future[int], frozenset[bytes]]]] = {}
        self._report = PoFWorkerMeta(0)   # what this step tells the scheduler half
        self._publishing: dict[bytes, Future[int]] = {}   # digest -> its release queued on the store thread
        self._lost_verdict_logged = False
        self.staging = StagingPool()
        self._pins = HostPins()           # the pool's host memory page-locked for the engine's GPU
        self.audits: WorkerAudits | None = None     # None: audit.sample_rate 0
        self._faults = WriterFaults.from_env()       # tests only: wrong KV the audit must catch
        self.load_latencies: list[float] = []
        self.wait_seconds: list[float] = []   # per step that loaded: how long the forward's thread spent in pof
        self._waited = 0.0                    # ... so far in this step
        # Layers whose per-layer hook has not run yet this step: a full CUDA graph replay skips
        # wait_for_layer_load and save_kv_layer (see PoFConnector.requires_piecewise_for_cudagraph).
        self._unwaited: set[int] = set()
        self._unsaved: set[int] = set()
        self._skip_logged: set[str] = set()

    # ---- register_kv_caches --------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor], layout: str | None = None) -> None:
        """Learn the engine's KV tensors (layer name -> vLLM's per-layer view, in model order).
        ``layout``: the ``KVCacheLayout`` vLLM resolved (``None``: unknown; the strides decide)."""
        names = list(kv_caches)
        self.kv = [kv_caches[n] for n in names]
        self.layer_index = {n: i for i, n in enumerate(names)}
        geo = self.geo
        cpu_attention = self.kv[0].device.type == "cpu" if self.cpu_attention is None else self.cpu_attention
        if cpu_attention:
            order = None
            if geo.layout_tag == "canonical" and self.kv[0].dim() == 4 and not geo.is_mla:
                order = cpu_block_order(geo.kv_heads, geo.block_size, geo.head_dim, self.kv[0].dtype)
            self.layout = infer_layout(self.kv[0], block_size=geo.block_size, kv_heads=geo.kv_heads,
                                       head_dim=geo.head_dim, is_mla=geo.is_mla, cpu_order=order)
        else:
            self.layout = view_layout(self.kv, block_size=geo.block_size, kv_heads=geo.kv_heads,
                                      head_dim=geo.head_dim, is_mla=geo.is_mla, configured=layout)
        if (self.layout.name == "cpu_opaque") != geo.layout_tag.startswith("opaque"):
            raise ValueError(f"pof: the worker's KV layout {self.layout.name} disagrees with the scheduler's "
                             f"{geo.layout_tag}; keys would not match")
        if any(t.shape != self.kv[0].shape or t.dtype != self.kv[0].dtype for t in self.kv):
            raise ValueError("pof: all attention layers must share one KV shape and dtype (hybrid models are "
                             "not supported)")
        spec = PageSpec(len(names), self.layout.segment_bytes(geo.page_tokens), geo.page_tokens,
                        KIND_MLA if geo.is_mla else KIND_MHA)
        if spec != geo.spec:
            # The namespace names geo.spec (the scheduler has only the model config): pages of another
            # geometry under it would be found by lookups and refused by every load.
            raise ValueError(f"pof: the worker's KV tensors make pages of {spec}, the model config "
                             f"{geo.spec}; keys would not match (KV caches of layers the model config "
                             "does not count, e.g. a speculative draft model's, are not supported)")
        # Each rank stores its own heads (TP) or layers (PP) as a node of its own; the scheduler looks
        # up rank 0's pages, and the other ranks find their own in start().
        config = replace(self.config, node_id=geo.node_id(self.config, self.tp_rank, self.pp_rank))
        self.pool = Pool(config, spec, geo.namespace(config, self.tp_rank, self.pp_rank),
                         meta={"engine": "vllm", "model": geo.model})
        device = self.kv[0].device
        self._load_lane, self._save_lane = Lane(device), Lane(device)
        if device.type == "cuda":       # saves copy device-to-host without a wait: into page-locked staging
            self.staging = StagingPool(allocate=pinned_buffer)
        self._pins = HostPins.of_pool(self.pool, device)
        if config.audit.sample_rate > 0:
            canonical = self.layout.name != "cpu_opaque"     # else raw block bytes: one error per layer
            self.audits = WorkerAudits(self.pool, Auditor(self.pool, config.audit, str(self.kv[0].dtype),
                                                          1 if geo.is_mla else geo.kv_heads,
                                                          geo.head_dim if canonical else 0))
        if self.overlap is None:
            self.overlap = core_to_spare(self.kv[0].device)
        self.copy_threads = 1 if self.overlap else copy_threads(self.kv[0].device)
        log.info("pof: %d layers, layout %s%s %s, pages of %d tokens = %d KiB, tiers %s, loads %s", len(names),
                 self.layout.name, f" ({self.layout.physical})" if self.layout.physical else "",
                 list(self.kv[0].shape), geo.page_tokens, spec.page_bytes >> 10,
                 ", ".join(f"{t.medium}" for t in self.pool.tiers),
                 "overlapped with the forward" if self.overlap
                 else f"on the forward's thread, copied by {self.copy_threads} thread(s)")

    # ---- loads ----------------------------------------------------------------------------------

    def start(self, meta: PoFConnectorMetadata) -> None:
        assert self.pool is not None
        if self._loader is not None:      # the last step's loads were never finished: report them first
            self._finish_loads()
        t0 = time.perf_counter()
        if self._publishing:                 # a load of a page whose release is still queued waits for it
            self._publishing = {d: f for d, f in self._publishing.items() if not f.done()}
            for digest in {key.digest for job in meta.loads for key in job.keys} & self._publishing.keys():
                self._publishing[digest].exception()
        for job in meta.loads:
            job = self._for_this_rank(job)
            reader = self.pool.open_read(job.keys[:len(job.sources)], job.sources)
            self._loads.append(_ActiveLoad(job, reader))
        if self._loads:
            assert self.layout is not None
            if not self.layout.can_copy_checked(self.kv[0]):
                planned = [PlannedPage(a.reader, i, *a.targets[i]) for a in self._loads for i in range(a.readable)
                           if i not in a.reader.failed]
                self._strided = StepLoads(self.layout, self.kv, self.geo.page_tokens, self.geo.blocks_per_page,
                                          self.pool.spec.segment_bytes, self._load_lane, planned)
            if self.overlap and self._load_thread is None:
                self._load_thread = ThreadPoolExecutor(1, thread_name_prefix="pof-load")
            self._loader = LayerLoader(self._copy_layer, len(self.kv), self._load_thread if self.overlap else None)
            self._unwaited = set(range(len(self.kv)))
            self._waited = time.perf_counter() - t0

    def _for_this_rank(self, job: LoadJob) -> LoadJob:
        """The scheduler planned with rank 0's keys and locations. Another TP rank (other heads) or
        PP stage (other layers) stores the same pages under its own namespace and node: load those,
        found by its own lookup. Keys are checked against every page header, so loading rank 0's
        page here would be refused anyway; this finds the right one. Pages this rank lacks fail."""
        assert self.pool is not None
        keys = self._own_keys(job.keys)
        if keys is job.keys:
            return job
        return replace(job, keys=keys, sources=self.pool.lookup(keys, count=False).sources)  # the scheduler counted

    def _own_keys(self, keys: list[PageKey]) -> list[PageKey]:
        """``keys`` (the scheduler's: rank 0's namespace) in this rank's namespace."""
        assert self.pool is not None
        own = self.pool.namespace
        if not keys or keys[0].namespace == own:
            return keys
        return [PageKey(own, k.digest, k.place) for k in keys]

    def wait_layer(self, layer_name: str) -> None:
        """Return once ``layer_name``'s KV of this step's loads is in the engine's blocks (or its
        pages failed, for recompute)."""
        layer = self.layer_index.get(layer_name)
        if self._loader is not None and layer is not None:    # else: not a layer whose KV the pool holds
            t0 = time.perf_counter()
            self._loader.wait(layer)
            if self._strided is not None:        # the engine's stream waits for the layer on the device
                self._strided.ready(layer)
            self._unwaited.discard(layer)
            self._waited += time.perf_counter() - t0

    def _copy_layer(self, layer: int) -> None:
        """The loader: copy and check layer ``layer`` of every page of this step's loads."""
        if self._faults is not None and self._faults.zeroes_loads():
            assert self.layout is not None
            kv = self.kv[layer]
            ids = [b for a in self._loads for i in range(a.readable) for b in a.targets[i][0]]
            self.layout.write_blocks(kv, ids, torch.zeros((len(ids), *self.layout.block_shape()), dtype=kv.dtype,
                                                          device=kv.device))
            return
        device = self.kv[layer].device if self._strided is not None else None   # torch copies: GPU regions direct
        per_load = [(active, active.reader.segments(layer, device)) for active in self._loads]
        if self._strided is not None:
            self._strided.copy_layer(layer, [(a.reader, i, seg) for a, segs in per_load for i, seg in segs])
        else:
            self._copy_fused(layer, per_load)

    def _copy_fused(self, layer: int, per_load: list[tuple[_ActiveLoad, list[tuple[int, np.ndarray]]]]) -> None:
        """Convert, copy and checksum in one native pass (the sums are of the bytes as they are
        stored into the blocks), on this thread and the native crew's helpers. Nothing writes into
        a block once the call returned: a helper writes a page only if the caller did not take it
        over (see ``_pagesum.c``), so every source may be copied by the crew, another node's slot
        in a shared region included."""
        assert self.layout is not None
        lay = self.layout
        pages: list[tuple[np.ndarray, list[int], int, int]] = []
        order: list[tuple[_ActiveLoad, int]] = []
        for active, segs in per_load:
            seeds, targets, reader = active.seeds, active.targets, active.reader
            for i, seg in segs:
                seed = seeds[i]
                if seed is None:
                    seed = seeds[i] = reader.sum_seed(i)
                # targets: the blocks each page writes, after the first page's head blocks (the engine's own)
                pages.append((seg, *targets[i], seed))
                order.append((active, i))
        sums = iter(lay.copy_checked(lay.cache_bytes(self.kv[layer]), pages, self.copy_threads) if pages else ())
        checks: list[tuple[int, int]] = []
        current: _ActiveLoad | None = None
        for active, i in order:          # per reader, in the order its pages came
            if active is not current:
                if current is not None:
                    current.reader.check_all(layer, checks)
                current, checks = active, []
            checks.append((i, next(sums)))
        if current is not None:
            current.reader.check_all(layer, checks)

    def _finish_loads(self) -> None:
        """After the forward: wait for the loader (the layers the engine did not ask for too), then
        report the blocks of every page that failed, for recompute. The loader's unexpected error
        is raised (the caller fails every load)."""
        loader, self._loader = self._loader, None
        t0 = time.perf_counter()
        if loader is not None:
            loader.finish()
        strided, self._strided = self._strided, None
        if strided is not None:      # pof's copies done (one wait a step), the landed sums checked
            strided.settle()
        page_sum.settle()         # no copy helper still reads a slot when the readers unpin it
        # A layer the forward never waited for may have been read before its copy (a full CUDA
        # graph replay skips the hook): every load of the step is recomputed.
        unordered = loader is not None and bool(self._unwaited) and self._skipped("wait_for_layer_load")
        self._unwaited = set()
        for active in self._loads:
            active.reader.close()
            job = active.job
            failed = set(active.reader.failed) | set(range(active.readable, len(job.keys)))
            if unordered:
                failed = set(range(len(job.keys)))
            for i in failed:
                self._load_errors.update(job.blocks_to_load(i))
            self.load_latencies.append(time.perf_counter() - active.started)
            if failed:
                self._tainted.add(job.req_id)
                log.warning("pof: request %s: %d of %d pages failed to load; vLLM recomputes them",
                            job.req_id, len(failed), len(job.keys))
        if loader is not None:
            self.wait_seconds.append(self._waited + time.perf_counter() - t0)
        self._loads = []

    def _skipped(self, hook: str) -> bool:
        """Count (and log once) a step in which the engine skipped ``hook`` for some layer. True."""
        assert self.pool is not None
        self.pool.stats.add("skipped_hooks", hook=hook)
        if hook not in self._skip_logged:
            self._skip_logged.add(hook)
            log.warning("pof: the engine skipped %s for some layers in a step (a full CUDA graph replay?): %s. "
                        "Logged once; counted in pof_skipped_hooks_total.", hook,
                        "its loads are recomputed" if hook == "wait_for_layer_load" else "its saves are not stored")
        return True

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def fail_jobs(self, jobs: list[LoadJob]) -> None:
        """Report every block these loads promised as a load error (vLLM recomputes them)."""
        for job in jobs:
            self._tainted.add(job.req_id)
            for i in range(len(job.keys)):
                self._load_errors.update(job.blocks_to_load(i))

    def report_failed_blocks(self, blocks: list[int]) -> None:
        self._load_errors.update(blocks)

    def abort_loads(self) -> None:
        """Give up on this step's loads after an unexpected error: all their blocks are recomputed."""
        loader, self._loader = self._loader, None
        if loader is not None:
            loader.cancel()          # the thread stops reading before the readers close
        strided, self._strided = self._strided, None
        if strided is not None:
            strided.drain()          # and no copy still reads a source
        page_sum.settle()
        self.fail_jobs([a.job for a in self._loads])
        for active in self._loads:
            active.reader.close()
        self._loads = []
        self._unwaited = set()

    def close(self) -> None:
        self.abort_loads()
        self._held = {}           # the pool drops what is still held as it closes
        if self._load_thread is not None:
            self._load_thread.shutdown(wait=True)
        if self.audits is not None:
            self.audits.close()
        self._pins.release()      # before the pool unmaps what was registered
        if self.pool is not None:
            self.pool.close()

