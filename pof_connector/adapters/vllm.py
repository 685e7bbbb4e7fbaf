"""``PoFConnector``: the pool in a stock vLLM server, with one flag::

    --kv-transfer-config '{"kv_connector": "PoFConnector",
                           "kv_connector_module_path": "pof_connector.adapters.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"node_id": "a", "tiers": {"cpu_dram": {"size": "1GiB"}}}}'

``kv_connector_extra_config`` is pof's config (README, "Configuration"). Set
``kv_load_failure_policy`` to ``recompute``: with vLLM's default (``fail``) a page the pool
rejects aborts the request instead of being recomputed.

vLLM creates one instance per role: the SCHEDULER instance (EngineCore process) keeps books in
:class:`PoFScheduler`; the WORKER instance (Worker process) moves bytes in :class:`PoFWorker`.
They share nothing but the per-step :class:`PoFConnectorMetadata`. This class only translates
vLLM's calls.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from pof_connector.adapters.vllm_geometry import cache_spec_problem, geometry, on_cpu, pof_config
from pof_connector.adapters.vllm_metadata import PoFConnectorMetadata
from pof_connector.adapters.vllm_scheduler import PoFScheduler
from pof_connector.adapters.vllm_stats import PoFConnectorStats, PoFPromMetrics, counter_delta
from pof_connector.adapters.vllm_worker import PoFWorker
from pof_connector.config import ConfigError
from pof_connector.metrics import tier_gauges

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )

log = logging.getLogger("pof_connector.vllm")


def _log_like_vllm() -> None:
    """Send pof's INFO logs where vLLM's go (vLLM configures only its own logger tree)."""
    ours, theirs = logging.getLogger("pof_connector"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False

# Where vLLM's hit-source metrics put each pool medium: CPU DRAM and CXL are host memory.
_SOURCE = {"cpu_dram": CacheHitSource.HOST, "cxl": CacheHitSource.HOST, "peer_hbm": CacheHitSource.P2P,
           "gpu_hbm": CacheHitSource.P2P, "disk": CacheHitSource.DISK}


class PoFConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_like_vllm()
        config = pof_config(vllm_config)          # a bad config stops start-up here, naming the key
        geo = geometry(vllm_config, config)
        problem = cache_spec_problem(kv_cache_config)
        if problem is not None:
            raise ConfigError(f"pof: vLLM's KV cache cannot be pooled: {problem}")
        self._scheduler: PoFScheduler | None = None
        self._worker: PoFWorker | None = None
        self._last_snapshot: dict[str, Any] = {}
        self._last_gauges: dict[str, float] = {}
        if role == KVConnectorRole.SCHEDULER:
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                log.warning("pof: kv_load_failure_policy is %r: a page the pool rejects will fail its request. "
                            "Set \"kv_load_failure_policy\": \"recompute\" in --kv-transfer-config so vLLM "
                            "recomputes it instead.", self._kv_transfer_config.kv_load_failure_policy)
            # kv_role as vLLM defines it: a producer only stores, a consumer only loads.
            kv_role = self._kv_transfer_config.kv_role
            self._scheduler = PoFScheduler(config, geo, loads=kv_role != "kv_producer",
                                           saves=kv_role != "kv_consumer",
                                           tp_size=vllm_config.parallel_config.tensor_parallel_size)
        else:
            self._worker = PoFWorker(config, geo, tp_rank=_tp_rank(), pp_rank=_pp_rank(), cpu_attention=on_cpu())

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True, for every configuration: pof's loads and saves run in the per-layer hooks
        (``wait_for_layer_load`` orders the forward after a layer's copy, ``save_kv_layer`` copies a
        layer's new pages out right after attention wrote them), and a full CUDA graph replay
        skips both. vLLM then runs attention eagerly between graph pieces (``PIECEWISE``) instead
        of its default ``FULL_AND_PIECEWISE`` (``config/vllm.py``). Keeping the hooks out of the
        graph entirely instead (all loads before the forward, all saves after it) would give up
        overlapping a load with the forward. Should a replay skip them anyway, the worker stores
        nothing the forward did not hand it and recomputes the step's loads
        (``pof_skipped_hooks_total``)."""
        return True

    @property
    def requires_kv_delivery(self) -> bool:
        """False: the pool is a best-effort cache, never a hand-off. vLLM's default (the producer
        role, so ``kv_both`` too) makes a preemption drop the request's in-flight output and
        resample it; a save the preemption cut short is only a later miss here."""
        return False

    # ---- scheduler side ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Loads are synchronous (``False``); ``None``: a P/D decode request waits for its
        prefill's pages to reach the index (see ``adapters/vllm_pd.py``)."""
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[CacheHitSource, int]:
        assert self._scheduler is not None
        out: dict[CacheHitSource, int] = {}
        for medium, n in self._scheduler.hit_tiers(request).items():
            src = _SOURCE.get(medium, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[src] = out.get(src, 0) + n
        return out if sum(out.values()) == num_external_tokens else super().get_external_cache_hit_sources(
            request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        """Every rank's load errors and reports of a step: the verdict on the saves held in it."""
        assert self._scheduler is not None
        try:
            self._scheduler.update_output(connector_output)
        except Exception as e:     # a bug here must not stop the engine: nothing held is published
            self._scheduler.pool.report_adapter_error("update_connector_output", e)
            self._scheduler.fail_unsettled()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Saves were copied out of the blocks during the forward: vLLM may free them now, a P/D
        prefill's too (the decode server reads the pool, never these blocks). The prefill half of
        a disaggregated request returns the hand-off for its decode half."""
        assert self._scheduler is not None
        # Like NixlConnector: an aborted prefill hands nothing on (the proxy's decode half computes).
        done = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        handoff = self._scheduler.handoff(request) if done else None
        self._scheduler.finished(request.request_id)
        return False, handoff

    def has_pending_push_work(self) -> bool:
        """Keep vLLM stepping while saves wait for their verdict (see ``PoFScheduler.has_pending_work``)."""
        return self._scheduler is not None and self._scheduler.has_pending_work()

    # ---- worker side -----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        # The layout vLLM resolved (VLLM_KV_CACHE_LAYOUT or its backends' choice): the strides must show it.
        layout = getattr(self._vllm_config.cache_config, "kv_cache_layout", None)
        self._worker.register(kv_caches, layout=layout)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, PoFConnectorMetadata):
            self._worker.track(connector_metadata)
            self._worker.report_failed_blocks(connector_metadata.fail_blocks)
            self._safely("bind_connector_metadata", self._worker.prepare_saves, connector_metadata,
                         on_error=self._worker.drop_saves)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, PoFConnectorMetadata)
        worker = self._worker

        def fail() -> None:
            worker.abort_loads()
            worker.fail_jobs(meta.loads)

        self._safely("start_load_kv", worker.start, meta, on_error=fail)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._safely("wait_for_layer_load", self._worker.wait_layer, layer_name, on_error=self._worker.abort_loads)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        self._safely("save_kv_layer", self._worker.save_layer, layer_name, on_error=self._worker.drop_saves)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        worker = self._worker

        def fail() -> None:
            worker.abort_loads()
            worker.drop_saves()

        self._safely("wait_for_save", worker.end_step, on_error=fail)

    def _safely(self, hook: str, fn: Any, *args: Any, on_error: Any) -> None:
        """Run a worker hook; an unexpected error is logged (once, with its traceback), counted, and
        turned into recompute by ``on_error`` — a pool bug must not take the engine down."""
        try:
            fn(*args)
        except Exception as e:
            pool = self._worker.pool if self._worker is not None else None
            if pool is not None:
                pool.report_adapter_error(hook, e)
            else:
                log.exception("pof: unexpected error in %s; the engine recomputes instead", hook)
            on_error()

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Sent every step, even an idle one: vLLM hands a step's output to the scheduler half
        (``update_connector_output``) only when it is not empty, and the verdicts need each one."""
        assert self._worker is not None
        return self._worker.report()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Counter deltas since the last call; vLLM asks both roles (lookups and hits come from the
        scheduler's pool, loads and stores from the worker's)."""
        pool = self._worker.pool if self._worker is not None else self._scheduler.pool if self._scheduler else None
        if pool is None:
            return None
        now = pool.stats.snapshot()
        delta = counter_delta(now, self._last_snapshot)
        self._last_snapshot = now
        latencies: list[float] = []
        waits: list[float] = []
        errors: list[float] = []
        gauges: dict[str, float] = {}
        if self._worker is not None:
            # the worker's tiers hold the pages: their levels now, sent when they moved
            now_gauges = tier_gauges(pool.tiers)
            gauges = {k: v for k, v in now_gauges.items() if self._last_gauges.get(k) != v}
            self._last_gauges = now_gauges
            latencies, self._worker.load_latencies = self._worker.load_latencies, []
            waits, self._worker.wait_seconds = self._worker.wait_seconds, []
            if self._worker.audits is not None:
                errors = self._worker.audits.auditor.take_errors()
        stats = PoFConnectorStats(data={"counters": delta, "load_seconds": latencies, "wait_seconds": waits,
                                        "audit_errors": errors, "gauges": gauges})
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return PoFConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
                           ) -> KVConnectorPromMetrics | None:
        return PoFPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, RuntimeError):    # no TP group (single process tests)
        return 0


def _pp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_pp_group

        return int(get_pp_group().rank_in_group)
    except (AssertionError, RuntimeError):    # no PP group (single process tests)
        return 0
