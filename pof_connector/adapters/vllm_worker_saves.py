"""The save half of the vLLM worker (:class:`WorkerSaves`, a base of
:class:`~pof_connector.adapters.vllm_worker.PoFWorker`): which of a step's pages are staged, their
hand-off to the pool's store thread, and the saves held until the scheduler's verdict.

``save_layer(l)`` gathers the step's newly full pages of layer ``l`` into staging right after
attention wrote them; ``end_step`` hands the staged pages to the pool, which writes them on its own
thread — the forward never waits for a tier. In a step told to hold its saves, they stay held (in
their slots, neither found nor published) until the scheduler's verdict publishes or drops them.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pof_connector.adapters.vllm_audits import Countdown, WorkerAudits
from pof_connector.adapters.vllm_device import Lane, StepSaves
from pof_connector.adapters.vllm_faults import WriterFaults
from pof_connector.adapters.vllm_geometry import VllmGeometry
from pof_connector.adapters.vllm_layout import BlockLayout
from pof_connector.adapters.vllm_metadata import PoFConnectorMetadata, PoFWorkerMeta, Verdict
from pof_connector.config import DEFAULT_TENANT
from pof_connector.index import Location
from pof_connector.pages import PageKey
from pof_connector.pool import Pool, StagingPool

if TYPE_CHECKING:
    import torch

log = logging.getLogger("pof_connector.vllm")

HELD_STEPS_MAX = 16
"""Steps whose held saves wait for the scheduler's verdict at most (vLLM hands the output back one
step later, two with async scheduling, a few more with pipeline stages): older ones are dropped,
so a lost verdict never pins tier slots."""


@dataclass
class _PendingSave:
    req_id: str
    keys: list[PageKey]
    segments: np.ndarray              # [layers, pages, segment_bytes]
    audit: dict[int, Location] = field(default_factory=dict)   # position -> the pool's copy to compare with
    stored: set[int] = field(default_factory=set)              # positions this node stores already
    tenant: str = DEFAULT_TENANT                               # whose pages (the tiers' quotas)


class WorkerSaves:
    """The save methods of :class:`~pof_connector.adapters.vllm_worker.PoFWorker`; the state they
    share with its loads is set by its ``__init__`` and ``register``."""

    if TYPE_CHECKING:     # PoFWorker's attributes and methods that the saves use
        pool: Pool | None
        geo: VllmGeometry
        tp_rank: int
        pp_rank: int
        layout: BlockLayout | None
        kv: list[torch.Tensor]
        layer_index: dict[str, int]
        staging: StagingPool
        audits: WorkerAudits | None
        _faults: WriterFaults | None
        _save_lane: Lane
        _saves: list[_PendingSave]
        _step_saves: StepSaves | None
        _unsaved: set[int]
        _tainted: set[str]
        _step: int
        _hold: bool
        _held: dict[int, list[tuple[str, Future[int], frozenset[bytes]]]]
        _report: PoFWorkerMeta
        _publishing: dict[bytes, Future[int]]
        _lost_verdict_logged: bool

        def _finish_loads(self) -> None: ...

        def _own_keys(self, keys: list[PageKey]) -> list[PageKey]: ...

        def _skipped(self, hook: str) -> bool: ...

    def drop_saves(self) -> None:
        saves, self._step_saves = self._step_saves, None
        if saves is not None:
            saves.drain()            # no copy still writes into the staging
        self._saves = []
        self._unsaved = set()

    def track(self, meta: PoFConnectorMetadata) -> None:
        """Take the scheduler's news about requests before this step's saves are picked.

        A request whose load failed ran its forward on blocks that do not hold the page's KV; every
        page it computes on top of them is wrong under its right key, so none is stored until vLLM
        rewinds it to recompute from the failed block (``rewound``)."""
        self._tainted.difference_update(meta.rewound)
        self._tainted.difference_update(meta.finished)
        self._tainted.update(meta.tainted)
        wanted = {key.digest for job in meta.loads for key in job.keys} if meta.verdicts else set()
        for verdict in meta.verdicts:
            self._settle(verdict, wanted)
        if meta.step and any(s <= meta.step - HELD_STEPS_MAX for s in self._held):
            self._settle(Verdict(meta.step - HELD_STEPS_MAX, discard=sorted({r for s in self._held.values()
                                                                             for r, _, _ in s})), set())
        self._step, self._hold = meta.step, meta.hold
        self._report = PoFWorkerMeta(meta.step)
        if self._faults is not None:
            self._faults.begin_step()

    def _settle(self, verdict: Verdict, wanted: set[bytes]) -> None:
        """Publish or drop the saves held in ``verdict.step``. Those among ``wanted`` (the pages this
        step loads: the scheduler may plan them from pages it approved) are readable here when this
        returns; the others are published on the store thread, after their writes, so the forward
        never waits for a tier. Steps before it still held never got a verdict (their output was
        lost): dropped, the safe answer."""
        assert self.pool is not None
        discard = set(verdict.discard)
        if self.audits is not None:
            self.audits.settle(verdict.step, discard)
        for step in sorted(s for s in self._held if s <= verdict.step):
            for req_id, stored, digests in self._held.pop(step):
                tag = (step, req_id)
                if step == verdict.step and req_id not in discard:
                    if digests.isdisjoint(wanted):
                        released = self.pool.release(tag, publish=True)
                        self._publishing.update(dict.fromkeys(digests, released))
                    elif stored.exception() is None:      # waits for the write; a failed one has nothing
                        self.pool.release_now(tag)
                else:
                    self.pool.release(tag, publish=False)
                    if step != verdict.step and not self._lost_verdict_logged:
                        self._lost_verdict_logged = True
                        log.warning("pof: no verdict came for the saves held in step %d; they are dropped (the "
                                    "scheduler half lost that step's output). Logged once.", step)

    def report(self) -> PoFWorkerMeta:
        """This step's report for the scheduler half (vLLM's ``build_connector_worker_meta``)."""
        return self._report

    def prepare_saves(self, meta: PoFConnectorMetadata) -> None:
        """Pick the pages to save this step (skipping those this node stores already)."""
        assert self.pool is not None
        spec = self.pool.spec
        blocks: list[list[int]] = []
        for job in meta.saves:
            if job.req_id in self._tainted:
                continue
            keys = self._own_keys(job.keys)
            audit = self.audits.sources(job, keys) if self.audits is not None else {}
            have = {i for i, k in enumerate(keys) if self.pool.contains(k)}
            keep = [i for i in range(len(keys)) if i in audit or i not in have]
            if not keep:
                continue
            job_blocks = job.block_ids if self._faults is None else self._faults.blocks(job.block_ids)
            blocks.append([b for i in keep for b in job_blocks[i]])
            buffer = self.staging.take(spec.num_layers * len(keep) * spec.segment_bytes)
            self._saves.append(_PendingSave(job.req_id, [keys[i] for i in keep],
                                            buffer.reshape(spec.num_layers, len(keep), spec.segment_bytes),
                                            {n: audit[i] for n, i in enumerate(keep) if i in audit},
                                            {n for n, i in enumerate(keep) if i in have}, job.tenant))
        if self._saves:
            assert self.layout is not None
            self._unsaved = set(range(len(self.kv)))
            self._step_saves = StepSaves(self.layout, self.kv, self.geo.blocks_per_page, self._save_lane,
                                         [(b, save.segments) for b, save in zip(blocks, self._saves, strict=True)])

    def save_layer(self, layer_name: str) -> None:
        layer = self.layer_index.get(layer_name)
        if self._step_saves is None or layer is None:
            return
        self._step_saves.save_layer(layer)
        self._unsaved.discard(layer)

    def end_step(self) -> None:
        """After the forward: report loads, hand staged pages to the pool's store thread (held
        until the scheduler's verdict when this step was told to hold them)."""
        self._finish_loads()
        step_saves, self._step_saves = self._step_saves, None
        if self._saves and self._unsaved and self._skipped("save_kv_layer"):
            assert step_saves is not None
            step_saves.drain()
            for save in self._saves:      # staging the forward never filled: nothing of it is stored
                self.staging.give(save.segments)
            self._saves = []
        self._unsaved = set()
        if not self._saves:
            return
        assert step_saves is not None
        ready = step_saves.finish()       # the store thread waits for the copies, the forward does not
        assert self.pool is not None
        layers = self.pool.spec.num_layers
        if self._faults is not None:
            if ready is not None:
                ready()
            assert self.layout is not None
            for save in self._saves:
                self._faults.damage(save.segments, self.layout.canonical_shape(self.geo.page_tokens),
                                    self.kv[0].element_size())
        batches: list[tuple[str, str, list[tuple[PageKey, list[np.ndarray]]]]] = []
        buffers = [save.segments for save in self._saves]

        def give_back() -> None:        # the staging is reusable once the pool wrote it and every audit read it
            for b in buffers:
                self.staging.give(b)

        release = Countdown(give_back)
        for save in self._saves:
            if save.req_id in self._tainted:      # its load failed in this very step
                continue
            if save.audit and self.audits is not None:
                release.add()
                self.audits.add(self._step, self._hold, save.req_id,
                                [(save.keys[n], src, n) for n, src in save.audit.items()], save.segments, ready,
                                release.done)
            batches.append((save.req_id, save.tenant,
                            [(key, [save.segments[layer, i] for layer in range(layers)])
                             for i, key in enumerate(save.keys) if i not in save.stored]))
        self._saves = []
        batches = [(req_id, tenant, items) for req_id, tenant, items in batches if items]
        futures: list[Future[int]] = []
        if not self._hold:
            by_tenant: dict[str, list[tuple[PageKey, list[np.ndarray]]]] = {}
            for _, tenant, items in batches:
                by_tenant.setdefault(tenant, []).extend(items)
            futures = [self.pool.store(items, ready=ready, tenant=tenant) for tenant, items in by_tenant.items()]
        else:
            for req_id, tenant, items in batches:
                stored = self.pool.store(items, hold=(self._step, req_id), ready=ready, tenant=tenant)
                futures.append(stored)
                self._held.setdefault(self._step, []).append((req_id, stored,
                                                              frozenset(k.digest for k, _ in items)))
                if self.tp_rank == 0 and self.pp_rank == 0:     # the scheduler plans with rank 0's keys
                    self._report.held[req_id] = [key for key, _ in items]
            self._report.medium = self.pool.tiers[0].medium if self.pool.tiers else ""
        if futures:
            futures[-1].add_done_callback(release.done)      # the store thread runs them in order
        else:
            step_saves.drain()                              # no copy still writes into the buffers
            release.done()
