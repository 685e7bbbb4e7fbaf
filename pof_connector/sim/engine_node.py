"""One simulated engine node: KV memory in blocks, vLLM-like admission, continuous batching, and
preemption of the newest running request when a decode step cannot get a block.

Each iteration the node first makes room for one decode step of its running requests (preempting
the newest until the step's new blocks fit), then admits queued requests in arrival order while
their blocks (``ceil(context / block_tokens)``) fit and its prefill token budget lasts; a request
that does not fit blocks the queue behind it, as vLLM's FCFS scheduler does. An iteration with
admissions prefills them (after loading what the pool holds of their prompt) while the running
requests decode one token; without admissions the node runs decode steps back to back up to the
next finish, fast-forwarded as one event: the blocks ``k`` steps need are counted per residue of
the requests' lengths modulo the block size, so a segment costs O(block_tokens), not O(batch x k).
An arrival cuts a segment short at the end of the step in progress.

A preempted request returns to the head of the queue and re-prefills its prompt and output so far
when it resumes; with the pool it loads them instead (its pages were stored when it was preempted).
"""

from __future__ import annotations

import heapq
import math
from collections import deque

from pof_connector.locality.engine_load import EngineLoad
from pof_connector.sim.base import NodeEvents, NodeView
from pof_connector.sim.counters import Counters
from pof_connector.sim.index_cost import request_index_s
from pof_connector.sim.job import Job
from pof_connector.sim.kv_pool import KvPool
from pof_connector.sim.prefix_cache import PrefixCache
from pof_connector.sim.profile import Profile, TierProfile

MAX_SEGMENT_STEPS = 256
"""Decode steps fast-forwarded as one event at most (the KV usage samples see reservations no
further ahead than this)."""


class EngineNode(NodeView):
    def __init__(self, index: int, profile: Profile, events: NodeEvents, counters: Counters,
                 pool: KvPool | None = None, *, cached: dict[str, set[int]] | None = None) -> None:
        self.index = index
        self._name = f"n{index}"
        self.profile = profile
        self.events = events
        self.counters = counters
        self.pool = pool
        """``None``: no pool (nothing stored, nothing loaded)."""
        self.cache = PrefixCache(profile.block_tokens, index, cached)
        """``cached``: shared by the run's nodes, prefix key -> nodes caching it (``None``: not kept)."""
        self.total = profile.kv_blocks
        self.used = 0
        """Blocks requests hold, with those reserved for the decode steps of the segment under way."""
        self.waiting: deque[Job] = deque()
        self.decoding: dict[Job, int] = {}
        """Running requests past their prefill, in admission order -> the step they finish at."""
        self.steps = 0
        """Decode steps this node has run (a request's context = its offset + steps)."""
        self._resid = [0] * profile.block_tokens
        self._offsets = 0
        self._finish: list[tuple[int, int, Job]] = []
        self.preemptions = 0
        # the iteration or segment under way: start time, steps, cost terms, requests prefilling
        self.version = 0
        self._busy = False
        self._t0 = 0.0
        self._k = 0
        self._a = 0.0
        self._b = 0.0
        self._prefill: list[Job] = []

    # -- NodeView -------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._name

    def outstanding(self) -> int:
        return len(self.waiting) + len(self.decoding) + len(self._prefill)

    def cached_prefix(self, job: Job) -> int:
        peek = self.cache.peek
        session, system = peek(job.session_key), peek(job.system_key)
        if not session and not system:
            return 0                           # most nodes, for most prompts
        return min(self._hit(job, session, system, job.history_tokens), job.prompt_tokens - 1)

    def _hit(self, job: Job, session: int, system: int, context: int) -> int:
        """Leading tokens of ``job``'s prompt the engine has, from the cached lengths of its
        session's and its tenant's entries: the session's blocks follow the system prompt's in one
        hash chain, so they are reachable only while the system prompt's full blocks are cached."""
        sys_tokens = job.request.system_tokens
        if system < sys_tokens - sys_tokens % self.profile.block_tokens:
            session = 0
        return max(min(session, context), min(system, sys_tokens))

    def reading(self) -> EngineLoad:
        return EngineLoad(running=len(self.decoding) + len(self._prefill), waiting=len(self.waiting),
                          kv_usage=self.used / self.total, kv_capacity_tokens=self.profile.kv_tokens,
                          block_tokens=self.profile.block_tokens, preemptions=self.preemptions)

    @property
    def busy(self) -> bool:
        """An iteration or decode segment is under way."""
        return self._busy

    @property
    def usage(self) -> float:
        return self.used / self.total

    # -- events ---------------------------------------------------------------------------------
    def arrive(self, job: Job, now: float) -> None:
        job.node = self.index
        if self.profile.blocks(job.context + 1) > self.total:
            self._fail(job, now)         # it can never fit: vLLM refuses it
            return
        self.waiting.append(job)
        if not self._busy:
            self._start(now, 0, 0.0, 0.0)      # schedule at ``now``, after every arrival of this instant
        elif self._k > 1:
            self._cut(now)

    def wake(self, now: float, version: int) -> None:
        if version == self.version:
            self._apply(now)
            self._boundary(now)

    # -- one iteration / segment ------------------------------------------------------------------
    def _apply(self, now: float) -> None:
        """The iteration or segment under way ends at ``now``."""
        self._busy = False
        self.steps += self._k
        for job in self._prefill:
            job.generated += 1
            if job.first_token_at is None:
                # The API server's part, and the index's lookups (neither occupies the engine).
                job.first_token_at = now + self.profile.request_latency_s + job.index_s
                self.events.first_token(job, job.first_token_at)
            self._join(job)
        self._prefill = []
        while self._finish and self._finish[0][0] <= self.steps:
            step, _, job = heapq.heappop(self._finish)
            if self.decoding.get(job) == step:
                self._complete(job, now)

    def _boundary(self, now: float) -> None:
        """Schedule the next iteration (or decode segment) from ``now``."""
        step_blocks = 0                        # blocks the running requests' next step takes
        while self.decoding:
            step_blocks = self._need(1)
            if step_blocks <= self.total - self.used:
                break
            self._preempt(next(reversed(self.decoding)))
            step_blocks = 0
        admitted = self._admit(now, step_blocks)
        b = len(self.decoding)
        context = self._offsets + b * self.steps
        # nodes that share a host's cores slow each other (1: every node a host of its own)
        share = self.profile.host_slowdown
        slow = 1.0 + share * self.events.busy_others(self.index) if share else 1.0
        if admitted is not None:
            self.used += step_blocks
            self._start(now, 1, slow * (self.profile.decode_s(b, context) + admitted), 0.0)
        elif b:
            k, blocks = self._steps_that_fit(step_blocks)
            self.used += blocks
            self.cache.shrink(self.total - self.used)
            self._start(now, k, slow * self.profile.decode_s(b, context),
                        slow * self.profile.decode_s_per_ctx_token * b)

    def _start(self, now: float, k: int, a: float, b: float) -> None:
        self._busy = True
        self.version += 1
        self._t0, self._k, self._a, self._b = now, k, a, b
        self.events.wake(self.index, now + self._time(k), self.version)

    def _time(self, k: int) -> float:
        """Seconds of the first ``k`` steps under way (each step's context grows by the batch)."""
        return k * self._a + self._b * k * (k - 1) / 2

    def _cut(self, now: float) -> None:
        """End the decode segment under way with the step in progress at ``now``."""
        dt = now - self._t0
        if self._b > 0:
            half = self._a - self._b / 2
            j = math.ceil((-half + math.sqrt(half * half + 2 * self._b * dt)) / self._b)
        else:
            j = math.ceil(dt / self._a) if self._a > 0 else 1
        j = min(max(j, 1), self._k)
        if j < self._k:
            self.used -= self._need(self._k) - self._need(j)
            self._start(self._t0, j, self._a, self._b)

    def _steps_that_fit(self, one_step: int) -> tuple[int, int]:
        """Decode steps to run as one segment (up to the next finish, while their blocks fit) and
        the blocks they take; ``one_step``: the blocks of one step (which fit)."""
        kmax = MAX_SEGMENT_STEPS
        while self._finish and self.decoding.get(self._finish[0][2]) != self._finish[0][0]:
            heapq.heappop(self._finish)        # preempted since
        if self._finish:
            kmax = min(kmax, max(self._finish[0][0] - self.steps, 1))
        free = self.total - self.used
        need = self._need(kmax)
        if need <= free:
            return kmax, need
        lo, lo_need, hi = 1, one_step, kmax    # need(lo) fits (the caller made room), need(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            need = self._need(mid)
            if need <= free:
                lo, lo_need = mid, need
            else:
                hi = mid
        return lo, lo_need

    def _need(self, k: int) -> int:
        """New blocks the decoding requests take over the next ``k`` steps.

        A request holding ``m * bt + r`` tokens (``0 <= r < bt``) takes ``ceil((r + k) / bt) -
        (1 if r else 0)`` new blocks in ``k = a * bt + e`` steps: ``a``, plus one when ``e > 0``
        and ``r`` is 0 or above ``bt - e``. So the sum is ``a`` per request plus the requests whose
        residue lies in that window of ``e`` residues (``bt - e + 1 .. bt``, mod ``bt``); a
        request's residue is its offset's residue (``_resid``'s index) plus the node's steps."""
        bt = self.profile.block_tokens
        a, e = divmod(k, bt)
        total = a * len(self.decoding)
        if e:
            lo = (bt - e + 1 - self.steps) % bt        # the offset residue of the window's first residue
            end = lo + e
            resid = self._resid
            total += sum(resid[lo:end]) if end <= bt else sum(resid[lo:]) + sum(resid[:end - bt])
        return total

    # -- requests -------------------------------------------------------------------------------
    def _admit(self, now: float, step_blocks: int) -> float | None:
        """Admit queued requests that fit; the seconds their prefill (and loads) take, or ``None``
        when none was admitted."""
        p = self.profile
        cost = 0.0
        budget = 0
        admitted = 0
        while self.waiting and len(self.decoding) + admitted < p.max_running:
            job = self.waiting[0]
            need = p.blocks(job.context + 1)       # its KV so far, and the token this iteration samples
            # its system prompt's full blocks are one copy per node, held by every running
            # request of the tenant (vLLM's reference count): only the first one takes them
            shared = self._system_blocks(job) if self.cache.pins(job.system_key) else 0
            if need - shared > self.total - self.used - step_blocks:
                if not self.decoding and not admitted and need > self.total:
                    self.waiting.popleft()
                    self._fail(job, now)       # grown past the node's whole memory
                    continue
                break
            engine, best, key, tier = self._lookup(job)
            if self.pool is not None and job.first_token_at is None:
                job.index_s = request_index_s(len(self.pool.holders(job.system_key)),
                                              tier is not None and tier is not self.profile.local_tier)
            compute = job.context - best
            if admitted and budget + compute > p.max_batched_tokens:
                break
            self.waiting.popleft()
            if tier is not None and self.pool is not None:
                cost += self.pool.load(self.index, key, best - engine, tier)
                self.counters.loaded_tokens += best - engine
            self.counters.cache_hit_tokens += engine
            cost += p.prefill_s(compute, best)
            budget += compute
            admitted += 1
            known = max(job.known_tokens, job.computed)
            self.counters.computed_tokens += compute
            self.counters.recomputed_tokens += max(0, min(known, job.context) - best)
            if job.first_token_at is None:
                job.cached_tokens = best
            job.computed = job.context
            job.blocks = need
            self.used += need - shared
            self.cache.pin(job.system_key, job.request.system_tokens)
            self.cache.pin(job.session_key, job.context, self._system_blocks(job))
            self.cache.shrink(self.total - self.used - step_blocks)
            if self.pool is not None:
                self.pool.store(self.index, job.system_key, job.request.system_tokens)
                self.pool.store(self.index, job.session_key, job.prompt_tokens)
            self._prefill.append(job)
        return cost if admitted else None

    def _lookup(self, job: Job) -> tuple[int, int, str, TierProfile | None]:
        """Leading tokens of ``job``'s context in the engine's cache, the most it has without
        computing them (cache or pool), and where the pool part comes from (``None``: no load)."""
        cap = job.context - 1                  # the last token is always computed, as engines do
        ctx = max(job.history_tokens, job.computed)
        engine = min(self._hit(job, self.cache.tokens(job.session_key), self.cache.tokens(job.system_key), ctx),
                     cap)
        engine -= engine % self.profile.block_tokens
        best, best_key, best_tier = engine, "", None
        if self.pool is None:
            return engine, best, best_key, best_tier
        for key, limit in ((f"r:{job.id}", job.computed), (job.session_key, ctx),
                           (job.system_key, job.request.system_tokens)):
            tokens, tier = self.pool.best(self.index, key)
            tokens = min(tokens, limit, cap)
            tokens -= tokens % self.profile.block_tokens
            if tier is not None and tokens > best:
                best, best_key, best_tier = tokens, key, tier
        return engine, best, best_key, best_tier

    def _join(self, job: Job) -> None:
        """``job`` finished its prefill iteration and decodes from now on."""
        job.offset = job.context - self.steps
        self._resid[job.offset % self.profile.block_tokens] += 1
        self._offsets += job.offset
        end = self.steps + job.request.max_tokens - job.generated
        self.decoding[job] = end
        heapq.heappush(self._finish, (end, job.id, job))

    def _leave(self, job: Job) -> None:
        del self.decoding[job]
        self._resid[job.offset % self.profile.block_tokens] -= 1
        self._offsets -= job.offset
        job.generated = job.offset + self.steps - job.prompt_tokens
        job.computed = max(job.computed, job.context - 1)     # the last sampled token has no KV yet
        self.used -= self.profile.blocks(job.context) - self._system_blocks(job)

    def _system_blocks(self, job: Job) -> int:
        """Full blocks of ``job``'s system prompt: counted in ``used`` once per node while a
        running request holds them, not once per request."""
        return job.request.system_tokens // self.profile.block_tokens

    def _release_pins(self, job: Job) -> None:
        # vLLM frees a request's blocks tail first, so its leading ones (the system prompt) are
        # the more recently freed and evicted last
        self.cache.unpin(job.session_key, job.computed)
        self.cache.unpin(job.system_key, job.request.system_tokens)
        if not self.cache.pins(job.system_key):
            self.used -= self._system_blocks(job)      # the last running request of the tenant here

    def _complete(self, job: Job, now: float) -> None:
        self._leave(job)
        self._release_pins(job)
        if self.pool is not None:
            self.pool.store(self.index, job.session_key, job.computed)
            self.pool.drop(f"r:{job.id}")
        job.done_at = now
        self.events.finished(job, now)

    def _preempt(self, job: Job) -> None:
        self._leave(job)
        self._release_pins(job)
        if self.pool is not None:
            self.pool.store(self.index, f"r:{job.id}", job.computed)
        job.preemptions += 1
        self.preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(job)

    def _fail(self, job: Job, now: float) -> None:
        job.failed = True
        job.done_at = now
        self.counters.failed += 1
        self.events.finished(job, now)
