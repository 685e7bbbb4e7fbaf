"""The scheduler half of the vLLM connector (EngineCore process): keeps books, moves no bytes.

Loading is **synchronous and layer-wise**: ``get_num_new_matched_tokens`` answers ``(n, False)``,
so vLLM schedules the request in the same step, calls ``start_load_kv`` before the forward, and
every attention layer waits only for its own layer (``wait_for_layer_load``); where a core is
free, the worker's layer loader copies later layers meanwhile (``adapters/layer_loader.py``).
Pool pages are host memory (DRAM, CXL) that copies in milliseconds; an asynchronous load would
park the request for at least one extra scheduler step and gain nothing.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pof_connector.adapters.vllm_chain import Chain
from pof_connector.adapters.vllm_geometry import VllmGeometry
from pof_connector.adapters.vllm_metadata import LoadJob, PoFConnectorMetadata, PoFWorkerMeta, SaveJob, Verdict
from pof_connector.adapters.vllm_pd import PDBooks, is_decode, is_prefill
from pof_connector.audit.sampler import Sampler
from pof_connector.config import PofConfig
from pof_connector.index import Location
from pof_connector.pages import PageKey
from pof_connector.pool import Lookup, Pool

log = logging.getLogger("pof_connector.vllm")
LOOKUP_REUSE_S = 0.25
"""How long a request's lookup answer is reused while vLLM cannot schedule it yet. vLLM asks again
every step for the request at the head of its queue while KV memory is full; an index round trip
each time cost a saturated CPU engine ~10% of its scheduler process (measured). A page evicted
meanwhile fails its load and is recomputed; one published meanwhile is a smaller hit."""
APPROVED_KEEP_S = 30.0
"""How long the scheduler half offers pages it approved itself (held by the workers, published at
their next step) to its own lookups: an idle engine's last step would otherwise stay invisible
until its next one. By then the index has them."""
APPROVED_MAX = 1 << 16


@dataclass
class _Step:
    """A step whose output the scheduler half has not seen yet."""

    promised: bool
    """It loads KV from the pool, or reports promised blocks as failed: some rank may fail a load."""
    held: bool
    """Its saves wait for a :class:`Verdict`."""
    saves: dict[str, frozenset[int]]
    """Per request with saves in it, every block the request held (and its compute could read)."""
    discard: set[str] = field(default_factory=set)


@dataclass
class _Plan:
    """A lookup answer waiting for vLLM's block allocation."""

    first_page: int
    num_computed: int
    keys: list[PageKey]
    sources: list[Location]


class PoFScheduler:
    def __init__(self, config: PofConfig, geo: VllmGeometry, *, loads: bool = True, saves: bool = True,
                 tp_size: int = 1) -> None:
        """``loads`` / ``saves``: whether requests take pages from the pool / give their pages to it
        (vLLM's ``kv_role``: ``kv_producer`` never loads, ``kv_consumer`` never saves)."""
        self.config = config
        self.pd = PDBooks(config.pd, config.node_id, tp_size)
        self._decodes: set[str] = set()
        """P/D decode requests (a prefill's hand-off), whose own pages ``pd.decode_saves`` stores"""
        self.geo = geo
        self.loads = loads
        self.saves = saves
        # The client pool never touches bytes, but its keys (rank 0's) name the whole page geometry.
        self.pool = Pool(config, geo.spec, geo.namespace(config, tp_rank=0), role="client")
        self._chains: dict[str, Chain] = {}
        self._plans: dict[str, _Plan] = {}
        self._requests: dict[str, Any] = {}
        self._blocks: dict[str, list[int]] = {}
        self._saved_pages: dict[str, int] = {}
        self._progress: dict[str, int] = {}      # tokens computed once the last planned step ran
        self._loads: list[LoadJob] = []
        self._fail_blocks: list[int] = []
        self._tainted: list[str] = []
        self._finished: list[str] = []
        self._hit_tiers: dict[str, dict[str, int]] = {}
        self._looked: dict[str, tuple[float, int, int, Lookup]] = {}
        """request id -> (when, first page, page limit, answer) of its last lookup"""
        self._step = 0
        self._unsettled: dict[int, _Step] = {}
        self._verdicts: list[Verdict] = []
        self._approved: OrderedDict[bytes, tuple[float, Location]] = OrderedDict()
        """digest -> (when, where) of pages rank 0 held and this half approved"""
        self._local: dict[str, int] = {}
        """request id -> tokens vLLM's own prefix cache gave it when it was admitted"""
        self._suspect: set[int] = set()
        """Blocks that may hold KV of a failed load or computed on one, still in vLLM's prefix
        cache (its recompute policy keeps them registered until they are computed again)."""
        self._poisoned: set[str] = set()
        """Requests that read a suspect block: nothing they compute is stored, until they end."""
        self._sampler = Sampler(config.audit)
        self._audit_pick: dict[str, bool] = {}
        """request id -> whether its pool hit is audited (decided once per request)"""
        self._audits: dict[str, tuple[int, list[PageKey], list[Location]]] = {}
        """request id -> (first page, keys, sources) of the pool hit the engine computes instead"""

    def _chain(self, request: Any) -> Chain:
        chain = self._chains.get(request.request_id)
        if chain is None:
            chain = self._chains[request.request_id] = Chain(self.pool.namespace, request,
                                                             self.pool.tenant_of(request.cache_salt),
                                                             self.geo.page_tokens)
        return chain

    # ---- get_num_new_matched_tokens ------------------------------------------------------

    def matched_tokens(self, request: Any, num_computed: int) -> int | None:
        """Tokens beyond ``num_computed`` the pool can load: whole pages only, never the
        prompt's last token (vLLM must compute it to produce logits). ``None`` ("ask again next
        step") while a P/D decode request waits for the pages its prefill named (:mod:`.vllm_pd`)."""
        P = self.geo.page_tokens
        tokens = request.all_token_ids
        limit = (len(tokens) - 1) // P
        first = num_computed // P
        req_id = request.request_id
        self._plans.pop(req_id, None)
        first_ask = req_id not in self._local
        self._local[req_id] = num_computed
        named = min(self.pd.named_pages(request, P), limit)
        if named:
            self._decodes.add(req_id)
        elif first_ask and is_decode(request):
            log.info("pof: request %s (P/D decode): its prefill named no pool pages: a plain lookup", req_id)
        if limit <= first or not self.loads:
            return 0
        keys = self._chain(request).upto(tokens, limit, P)[first:]
        if not keys:
            return 0
        if self.pd.waiting(req_id) and not self.pd.may_ask(req_id):
            return None
        found = self._with_approved(keys, self._lookup(req_id, first, limit, keys, fresh=self.pd.waiting(req_id)))
        if named > first and self.pd.keep_waiting(req_id, first + found.pages, min(named, first + len(keys))):
            return None
        if found.pages == 0 or (first + found.pages) * P <= num_computed:
            return 0
        if self.saves and not is_decode(request) and self._audited(request.request_id):
            # Audited: the engine computes these pages; the workers compare them with the pool's.
            # Never a P/D decode: that would prefill the whole prompt on a decode server, the
            # stall P/D exists to avoid; the same pages are audited where prompts are computed.
            self._audits[request.request_id] = (first, keys[:found.pages], list(found.sources))
            return 0
        self._plans[request.request_id] = _Plan(first, num_computed, keys[:found.pages], found.sources)
        return (first + found.pages) * P - num_computed

    def _audited(self, req_id: str) -> bool:
        """Whether ``req_id``'s pool hit is audited: drawn once, however often vLLM asks again (a
        seeded sampler then picks the same requests in every run)."""
        pick = self._audit_pick.get(req_id)
        if pick is None:
            pick = self._audit_pick[req_id] = self._sampler.sampled()
        return pick

    def _lookup(self, req_id: str, first: int, limit: int, keys: list[PageKey], fresh: bool = False) -> Lookup:
        """``fresh``: ask the index even within :data:`LOOKUP_REUSE_S` (a P/D decode request waiting
        for its prefill's pages, which :class:`PDBooks` paces)."""
        now = time.monotonic()
        seen = self._looked.get(req_id)
        if not fresh and seen is not None and seen[1:3] == (first, limit) and now - seen[0] < LOOKUP_REUSE_S:
            return seen[3]
        found = self.pool.lookup(keys)
        self._looked[req_id] = (now, first, limit, found)
        return found

    def _with_approved(self, keys: list[PageKey], found: Lookup) -> Lookup:
        """``found`` extended by the pages that follow it among those this half approved (see
        :meth:`update_output`): the worker makes them readable before this step's loads start."""
        if found.pages >= len(keys) or not self._approved:
            return found
        now = time.monotonic()
        extra: list[Location] = []
        for key in keys[found.pages:]:
            got = self._approved.get(key.digest)
            if got is None or now - got[0] > APPROVED_KEEP_S:
                break
            extra.append(got[1])
        if not extra:
            return found
        for loc in extra:
            self.pool.stats.add("hit_pages", tier=loc.medium)
        return Lookup(found.keys, found.sources + extra, found.elsewhere)

    def hit_tiers(self, request: Any) -> dict[str, int]:
        """Tokens per medium of the last plan for ``request`` (for vLLM's hit-source metrics)."""
        return dict(self._hit_tiers.get(request.request_id, {}))

    # ---- update_state_after_alloc ----------------------------------------------------------

    def after_alloc(self, request: Any, block_ids: list[int], num_external: int) -> None:
        plan = self._plans.get(request.request_id)
        try:
            self._after_alloc(request, block_ids, num_external)
        except Exception as e:     # vLLM was promised these tokens: have the worker report them for recompute
            self.pool.report_adapter_error("update_state_after_alloc", e)
            if num_external > 0:
                bs = self.geo.block_size
                start = (plan.num_computed if plan else 0) // bs
                self._fail_blocks += block_ids[start:start + -(-num_external // bs)]
                self._tainted.append(request.request_id)

    def _after_alloc(self, request: Any, block_ids: list[int], num_external: int) -> None:
        req_id = request.request_id
        self._looked.pop(req_id, None)          # scheduled: a later ask (a preemption) looks up afresh
        self._requests[req_id] = request
        self._blocks[req_id] = list(block_ids)
        plan = self._plans.pop(req_id, None)
        num_computed = plan.num_computed if plan else request.num_computed_tokens
        # Pages this request had or loads are in the pool already: save only what it computes.
        self._saved_pages[req_id] = (num_computed + num_external) // self.geo.page_tokens
        if num_external <= 0 or plan is None:
            return
        P, bpp = self.geo.page_tokens, self.geo.blocks_per_page
        n_pages = (plan.num_computed + num_external) // P - plan.first_page
        pages = range(plan.first_page, plan.first_page + n_pages)
        job = LoadJob(req_id, plan.keys[:n_pages], plan.sources[:n_pages],
                      [block_ids[p * bpp:(p + 1) * bpp] for p in pages],
                      skip_blocks=(plan.num_computed - plan.first_page * P) // self.geo.block_size)
        self._loads.append(job)
        tiers: dict[str, int] = {}
        for src in job.sources:
            tiers[src.medium] = tiers.get(src.medium, 0) + P
        first_tokens = job.skip_blocks * self.geo.block_size
        first_medium = job.sources[0].medium
        tiers[first_medium] -= first_tokens          # the locally cached head of the first page
        self._hit_tiers[req_id] = {m: n for m, n in tiers.items() if n > 0}
        nodes = sorted({s.node for s in job.sources})
        log.info("pof: request %s: %d prompt tokens, %d from the engine's prefix cache, %d from the pool (%s; "
                 "node %s), %d to compute", req_id, len(request.prompt_token_ids or ()), plan.num_computed,
                 num_external, ", ".join(f"{m}: {n}" for m, n in self._hit_tiers[req_id].items()),
                 ",".join(nodes), request.num_tokens - plan.num_computed - num_external)

    # ---- build_connector_meta ----------------------------------------------------------------

    def build_meta(self, so: Any) -> PoFConnectorMetadata:
        """This step's plan for the workers. Its saves are held (``hold``) when this step, or one
        whose output is not in yet, promised pool KV: only once every rank's load errors of those
        steps are known can a page be published (:meth:`update_output`)."""
        self._step += 1
        promised = bool(self._loads or self._fail_blocks)
        held = promised or any(s.promised for s in self._unsettled.values())
        meta = PoFConnectorMetadata(loads=self._loads, fail_blocks=self._fail_blocks, tainted=self._tainted,
                                    finished=self._finished, step=self._step, hold=held, verdicts=self._verdicts)
        self._loads, self._fail_blocks, self._tainted, self._finished, self._verdicts = [], [], [], [], []
        try:
            self._plan_step_saves(so, meta)
        except Exception as e:     # saving is best effort: this step's pages are simply not stored
            self.pool.report_adapter_error("build_connector_meta", e)
            meta.saves = []
        try:
            self._guard_suspects(so)
        except Exception as e:     # the safe answer: nothing scheduled in this step is stored
            self.pool.report_adapter_error("build_connector_meta", e)
            self._poisoned.update(self._scheduled(so))
        meta.tainted += sorted(self._poisoned)
        self._unsettled[self._step] = _Step(promised, held, {
            job.req_id: frozenset(self._blocks.get(job.req_id, ())) for job in meta.saves})
        return meta

    @staticmethod
    def _scheduled(so: Any) -> list[str]:
        return [new.req_id for new in so.scheduled_new_reqs] + list(so.scheduled_cached_reqs.req_ids)

    def _guard_suspects(self, so: Any) -> None:
        """Blocks this step computes or loads anew are no longer suspect; a request that reads a
        suspect block without writing it (its prefix-cache hits, or what it computed before) is
        poisoned: vLLM keeps serving a block whose load failed from its prefix cache until it is
        recomputed, and a request admitted meanwhile computes on it with no error reported."""
        N = self.geo.block_size
        spans: list[tuple[str, int, int, int]] = []       # request, read end, write start, write end
        for new in so.scheduled_new_reqs:
            start = self._local.get(new.req_id, new.num_computed_tokens)
            spans.append((new.req_id, start, start, new.num_computed_tokens + so.num_scheduled_tokens[new.req_id]))
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            computed = cached.num_computed_tokens[i]
            spans.append((req_id, computed, computed, computed + so.num_scheduled_tokens[req_id]))
        if not self._suspect:
            return
        # Every write of a step lands before any read: a block a clean request writes is good again,
        # one a poisoned request writes is garbage too; who is poisoned depends on both: iterate.
        poisoned = {req_id for req_id, _, _, _ in spans if req_id in self._poisoned}
        while True:
            suspect = set(self._suspect)
            for req_id, _, start, end in spans:
                written = self._blocks.get(req_id, [])[start // N:end // N]
                (suspect.update if req_id in poisoned else suspect.difference_update)(written)
            grown = poisoned | {req_id for req_id, read, _, _ in spans
                                if not suspect.isdisjoint(self._blocks.get(req_id, [])[:-(-read // N)])}
            if grown == poisoned:
                break
            poisoned = grown
        self._suspect = suspect
        for req_id in sorted(poisoned - self._poisoned):
            log.warning("pof: request %s reads KV of a failed load that vLLM's prefix cache still serves (not "
                        "computed again yet); none of its pages are stored", req_id)
        self._poisoned |= poisoned

    # ---- update_connector_output ---------------------------------------------------------------

    def update_output(self, output: Any) -> None:
        """A step's output from every rank (vLLM's aggregated ``KVConnectorOutput``): the blocks any
        rank failed to load, and the worker's report. Every request that held such a block, in this
        step or in one planned before vLLM saw the failure, computed on it (a request that shares
        a block through vLLM's prefix cache included): its held saves of those steps are dropped.
        The verdict on this step goes to the workers with the next step's plan."""
        report = getattr(output, "kv_connector_worker_meta", None)
        report = report if isinstance(report, PoFWorkerMeta) else None
        if report is not None and report.step in self._unsettled:
            step = report.step
        elif self._unsettled:
            step = min(self._unsettled)       # no report: outputs come in the order steps were planned
        else:
            return
        invalid = set(getattr(output, "invalid_block_ids", None) or ())
        if invalid:
            for s, plan in self._unsettled.items():
                if s >= step:
                    plan.discard.update(r for r, blocks in plan.saves.items() if not blocks.isdisjoint(invalid))
            for blocks in self._blocks.values():     # from a request's first failed block on: suspect
                first = next((i for i, b in enumerate(blocks) if b in invalid), None)
                if first is not None:
                    self._suspect.update(blocks[first:])
        for s in sorted(s for s in self._unsettled if s <= step):
            plan = self._unsettled.pop(s)
            if s < step:           # its output never came: nothing of it is known good
                plan.discard.update(plan.saves)
            if plan.held:
                self._verdicts.append(Verdict(s, sorted(plan.discard)))
            if s == step and plan.held and report is not None:
                self._approve(report, plan.discard)

    def _approve(self, report: PoFWorkerMeta, discard: set[str]) -> None:
        now = time.monotonic()
        where = Location(self.config.node_id, report.medium, -1, 0)     # the worker finds its pages by key
        for req_id, keys in report.held.items():
            if req_id in discard:
                continue
            for key in keys:
                self._approved[key.digest] = (now, where)
                self._approved.move_to_end(key.digest)
        while len(self._approved) > APPROVED_MAX:
            self._approved.popitem(last=False)

    def fail_unsettled(self) -> None:
        """After an error in :meth:`update_output`: drop every held save not judged yet."""
        for s in sorted(self._unsettled):
            plan = self._unsettled.pop(s)
            if plan.held:
                self._verdicts.append(Verdict(s, sorted(plan.saves)))

    def _plan_step_saves(self, so: Any, meta: PoFConnectorMetadata) -> None:
        for new in so.scheduled_new_reqs:
            self._blocks[new.req_id] = list(new.block_ids[0])
            self._plan_saves(new.req_id, new.num_computed_tokens + so.num_scheduled_tokens[new.req_id], meta)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    self._blocks[req_id] = list(new_ids[0])
                else:
                    self._blocks.setdefault(req_id, []).extend(new_ids[0])
            computed = cached.num_computed_tokens[i]
            if computed < self._progress.get(req_id, 0):
                self._rewind(req_id, computed, meta)
            self._plan_saves(req_id, computed + so.num_scheduled_tokens[req_id], meta)

    def _rewind(self, req_id: str, computed: int, meta: PoFConnectorMetadata) -> None:
        """vLLM set the request back to ``computed`` tokens (a load failed, or it was preempted):
        it recomputes from there, so the pages from there on are saved again when full (the
        worker stored none that were computed on top of a failed load)."""
        P = self.geo.page_tokens
        self._saved_pages[req_id] = min(self._saved_pages.get(req_id, 0), computed // P)
        meta.rewound.append(req_id)

    def _plan_saves(self, req_id: str, computed_after: int, meta: PoFConnectorMetadata) -> None:
        self._progress[req_id] = computed_after
        request = self._requests.get(req_id)
        if request is None or not self.saves or (req_id in self._decodes and not self.config.pd.decode_saves):
            return
        P, bpp = self.geo.page_tokens, self.geo.blocks_per_page
        tokens = request.all_token_ids
        blocks = self._blocks.get(req_id, [])
        full = min(computed_after, len(tokens), len(blocks) * self.geo.block_size) // P
        start = self._saved_pages.get(req_id, 0)
        if full <= start:
            return
        chain = self._chain(request)
        keys = chain.upto(tokens, full, P)
        full = len(keys)          # fewer when the request's KV is not its tokens' alone (see Chain)
        if full <= start:
            return
        page_blocks = [blocks[p * bpp:(p + 1) * bpp] for p in range(start, full)]
        audit: dict[int, Location] = {}
        if req_id in self._audits:
            a_first, a_keys, a_sources = self._audits[req_id]
            pages = range(max(start, a_first), min(full, a_first + len(a_keys)))
            audit = {p - start: a_sources[p - a_first] for p in pages if keys[p] == a_keys[p - a_first]}
        meta.saves.append(SaveJob(req_id, keys[start:full], page_blocks, audit, chain.tenant))
        self._saved_pages[req_id] = full

    # ---- request_finished ----------------------------------------------------------------------

    def handoff(self, request: Any) -> dict[str, Any] | None:
        """The ``kv_transfer_params`` for the decode half when ``request`` is the prefill half of a
        disaggregated request (its pages are in the pool or on their way); call before
        :meth:`finished`."""
        if not is_prefill(request):
            return None
        # Pages it had, loaded or saved: 0 when it stored nothing (a kv_consumer, a poisoned
        # request), and the decode server then looks up without waiting.
        req_id = request.request_id
        stored = self._saved_pages.get(req_id, 0) if self.saves and req_id not in self._poisoned else 0
        log.info("pof: request %s (P/D prefill): %d prompt tokens, %d of them in the pool for its decode half",
                 req_id, len(request.prompt_token_ids or ()), stored * self.geo.page_tokens)
        return self.pd.handoff(request, stored * self.geo.page_tokens)

    def has_pending_work(self) -> bool:
        """Saves held for a verdict the workers have not received: vLLM keeps stepping (empty
        steps) until they have, so an idle server's last pages are published now rather than at
        its next request. A P/D decode server waits for exactly those pages."""
        return bool(self._verdicts) or any(s.held for s in self._unsettled.values())

    def finished(self, req_id: str) -> None:
        self.pd.finished(req_id)
        self._decodes.discard(req_id)
        for books in (self._chains, self._plans, self._requests, self._blocks, self._saved_pages, self._hit_tiers,
                      self._progress, self._looked, self._local, self._audit_pick, self._audits):
            books.pop(req_id, None)  # type: ignore[attr-defined]
        self._poisoned.discard(req_id)
        self._finished.append(req_id)

    def close(self) -> None:
        self.pool.close()
