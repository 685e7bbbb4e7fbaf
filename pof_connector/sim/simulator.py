"""The event loop: requests arrive (the trace's times scaled by the rate factor), the policy places
them, the nodes run; KV usage is sampled across nodes for the fragmentation spread.

A session's turns go one after another, as ``pof bench capacity`` sends them: turn k arrives at its
scaled time or when turn k-1 finished, whichever is later (its prompt holds turn k-1's answer), and
its TTFT counts from then; after a turn that failed, the session's later turns are never sent.

Events live in one heap of ``(time, seq, kind, a, b)``, first turns in a list sorted by time, taken
before a heap event of the same time; a node's wake-up carries its version, so a segment cut short
by an arrival leaves a stale event that the node ignores.
"""

from __future__ import annotations

import heapq
import math
import time

from pof_connector.bench import nearest_rank
from pof_connector.sim.base import NodeEvents, NodeView, Policy
from pof_connector.sim.counters import Counters
from pof_connector.sim.engine_node import EngineNode
from pof_connector.sim.job import Job
from pof_connector.sim.kv_pool import KvPool
from pof_connector.sim.profile import Profile
from pof_connector.sim.sim_config import SimConfig
from pof_connector.sim.trial_result import TrialResult
from pof_connector.sim.workload import SimRequest

WAKE, SAMPLE, TICK, ARRIVE = 1, 2, 3, 4


class _Stop(Exception):
    """The run is given up (a failure, or the SLO cannot be met any more)."""


class Simulator(NodeEvents):
    def __init__(self, profile: Profile, policy: Policy, config: SimConfig) -> None:
        self.profile = profile
        self.policy = policy
        self.config = config
        self.counters = Counters()
        tiers = config.tiers or ("shared" if policy.uses_pool else "none")
        self.pool = KvPool(profile, config.nodes, shared=tiers == "shared") if tiers != "none" else None
        self.cached: dict[str, set[int]] = {}
        """Prefix key -> nodes whose engine cache has it (the nodes keep it)."""
        self.nodes = [EngineNode(i, profile, self, self.counters, self.pool, cached=self.cached)
                      for i in range(config.nodes)]
        self._views: list[NodeView] = list(self.nodes)
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self._late = 0
        self._late_limit = 0
        self._arrived = 0
        self._session_known: dict[str, int] = {}
        self._tenants: set[str] = set()
        self._jobs: list[Job] = []
        self._next_turn: dict[int, Job] = {}
        """Job id -> the next turn of its session, sent once it finished."""
        self._usage: list[tuple[float, float, float]] = []
        """Per sample: (max - min usage, free share of the fullest node, of the emptiest)."""

    # -- NodeEvents -----------------------------------------------------------------------------
    def busy_others(self, node: int) -> int:
        return sum(1 for n in self.nodes if n.busy) - self.nodes[node].busy

    def wake(self, node: int, at: float, version: int) -> None:
        self._push(at, WAKE, node, version)

    def first_token(self, job: Job, at: float) -> None:
        self.policy.first_token(job, at)
        ttft = at - job.arrival
        if self.config.slo_s is not None and ttft > self.config.slo_s:
            self._late += 1
            if self._late > self._late_limit and self.config.give_up:
                raise _Stop

    def finished(self, job: Job, at: float) -> None:
        self.policy.finished(job, at)
        after = self._next_turn.pop(job.id, None)
        if after is not None and not job.failed:
            after.arrival = max(after.arrival, at)
            self._push(after.arrival, ARRIVE, after.id)
        if job.failed:
            if self.config.slo_s is not None and self.config.give_up:
                raise _Stop
            return
        s = job.request.session
        self._session_known[s] = max(self._session_known.get(s, 0), job.computed)

    # -- the run --------------------------------------------------------------------------------
    def _push(self, at: float, kind: int, a: int, b: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, kind, a, b))

    def jobs(self, requests: list[SimRequest]) -> list[Job]:
        """The requests as jobs, their prompts built from their sessions' earlier turns."""
        history: dict[str, int] = {}
        out = []
        for i, r in enumerate(requests):
            before = history.get(r.session, r.system_tokens)
            prompt = before + r.turn_tokens
            history[r.session] = prompt + r.max_tokens
            out.append(Job(i, r, r.at / self.config.rate_factor, before, prompt))
        return out

    def run(self, requests: list[SimRequest]) -> TrialResult:
        started = time.perf_counter()
        jobs = self._jobs = self.jobs(requests)
        cfg = self.config
        self._late_limit = int(cfg.late_share * len(jobs))
        self.policy.bind(self._views, self.pool, self.cached)
        span = max((j.arrival for j in jobs), default=0.0)
        last: dict[str, Job] = {}
        for job in jobs:
            before = last.get(job.request.session)
            if before is not None:
                self._next_turn[before.id] = job
            last[job.request.session] = job
        later = {j.id for j in self._next_turn.values()}
        # First turns are not in the heap (it would hold every request): they are taken in (time,
        # job) order, before any heap event of the same time, the order their heap entries had
        # (pushed first, so with the lowest sequence numbers). Later turns are pushed when the turn
        # before them finishes.
        arrivals = sorted((j for j in jobs if j.id not in later), key=lambda j: (j.arrival, j.id))
        self._seq = len(jobs)
        step = span / cfg.samples if span > 0 else 0.0
        if step > 0:
            for k in range(cfg.samples + 1):
                self._push(k * step, SAMPLE, k)
        ticks = int(span / cfg.metrics_interval_s) + 1
        for k in range(ticks + int(cfg.drain_s / cfg.metrics_interval_s)):
            self._push(k * cfg.metrics_interval_s, TICK, k)
        horizon = span + cfg.drain_s
        events = 0
        self._arrived = 0
        aborted = False
        heap, pop, nodes = self._heap, heapq.heappop, self.nodes
        n_arrivals, k = len(arrivals), 0
        try:
            while k < n_arrivals or heap:
                if k < n_arrivals and (not heap or arrivals[k].arrival <= heap[0][0]):
                    job = arrivals[k]
                    k += 1
                    if job.arrival > horizon:
                        break
                    events += 1
                    self._arrive(job, job.arrival)
                    continue
                at, _, kind, a, b = pop(heap)
                if at > horizon:
                    break
                events += 1
                if kind == WAKE:
                    nodes[a].wake(at, b)
                elif kind == ARRIVE:
                    self._arrive(jobs[a], at)
                elif kind == TICK:
                    self.policy.tick(at)
                else:
                    self._sample()
        except _Stop:
            aborted = True
        return self._result(jobs, span, aborted, events, time.perf_counter() - started)

    def _arrive(self, job: Job, now: float) -> None:
        self._arrived += 1
        r = job.request
        job.known_tokens = max(self._session_known.get(r.session, 0),
                               r.system_tokens if r.tenant in self._tenants else 0)
        self._tenants.add(r.tenant)
        self.nodes[self.policy.choose(job, self._views, now)].arrive(job, now)

    def _sample(self) -> None:
        usage = [n.used / n.total for n in self.nodes]
        hi, lo = max(usage), min(usage)
        self._usage.append((hi - lo, 1.0 - hi, 1.0 - lo))

    def _result(self, jobs: list[Job], span: float, aborted: bool, events: int, wall_s: float) -> TrialResult:
        ttfts = sorted(j.ttft if j.ttft is not None else math.inf for j in jobs)
        n = len(ttfts)
        p90 = nearest_rank(ttfts, 0.9) if n else 0.0
        got = [t for t in ttfts if t != math.inf]
        failed = sum(1 for j in jobs if j.failed or j.first_token_at is None)
        slo = self.config.slo_s
        passed = not aborted and failed == 0 and (slo is None or p90 <= slo)
        spreads = sorted(s for s, _, _ in self._usage) or [0.0]
        k = len(self._usage) or 1
        return TrialResult(
            policy=self.policy.name, factor=self.config.rate_factor, requests=n,
            offered_rps=n / span if span > 0 else 0.0, p90_ttft_s=p90,
            mean_ttft_s=sum(got) / len(got) if got else math.inf, failed=failed, passed=passed, aborted=aborted,
            counters=self.counters, spread_mean=sum(spreads) / len(spreads),
            spread_p90=nearest_rank(spreads, 0.9),
            idle_busiest=sum(b for _, b, _ in self._usage) / k, idle_idlest=sum(i for _, _, i in self._usage) / k,
            loaded_bytes=dict(self.pool.loaded_bytes) if self.pool else {},
            stored_bytes=self.pool.stored_bytes if self.pool else 0, events=events, arrived=self._arrived,
            wall_s=wall_s)
