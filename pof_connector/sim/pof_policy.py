"""Policy ``pof``: the real `pof router` (:class:`~pof_connector.router.router.Router`, its
:class:`~pof_connector.router.kv_admission.KvAdmission` and learning
:class:`~pof_connector.router.cost_model.CostModel`) decides, fed simulated state: the nodes'
``/metrics`` readings every ``metrics_interval_s`` (as its poller records them), locality from
:class:`~pof_connector.sim.sim_locator.SimLocator`, and its backends' tickets admitted, given their
first token and finished as the proxy does; the cost model learns from the simulated TTFTs. The
nodes have the pool."""

from __future__ import annotations

from pof_connector.router.backend import Backend, Ticket
from pof_connector.router.router import Decision, Router
from pof_connector.router.router_config import RouterConfig
from pof_connector.sim.base import NodeView, Policy
from pof_connector.sim.job import Job
from pof_connector.sim.kv_pool import KvPool
from pof_connector.sim.profile import Profile
from pof_connector.sim.prompt_ref import PromptRef
from pof_connector.sim.sim_locator import SimLocator

MIN_OVERHEAD_S = 1e-6
"""The least fixed cost per request the simulated router starts from (its config refuses 0)."""
NEVER_STALE_S = 1e12
"""The simulator records every node's reading itself, on each tick: none is ever missing, so the
router keeps its last one however far apart the ticks are set."""


def router_config(profile: Profile, nodes: int, *, learn: bool = True) -> RouterConfig:
    """The router configuration a deployment of ``profile`` nodes would use."""
    return RouterConfig.from_mapping({
        "policy": "pof",
        "backends": [{"name": f"n{i}", "url": f"http://n{i}.sim.invalid"} for i in range(nodes)],
        # the router's prior must be positive; a calibration on noisy decode samples can fit 0
        "cost": {"prefill_s_per_token": profile.prefill_s_per_token,
                 "request_overhead_s": max(profile.decode_step_s, MIN_OVERHEAD_S),
                 "decode_s_per_running": profile.decode_s_per_seq, "learn": learn,
                 "tier_gbps": {profile.local_tier.name: profile.local_tier.gbps,
                               profile.remote_tier.name: profile.remote_tier.gbps}},
        "capacity": {"block_tokens": profile.block_tokens, "stale_after_s": NEVER_STALE_S},
    }, source="pof sim router")


class PofPolicy(Policy):
    name = "pof"
    uses_pool = True

    def __init__(self, profile: Profile, *, learn: bool = True) -> None:
        self.profile = profile
        self.learn = learn
        self.router: Router | None = None
        self.locator: SimLocator | None = None
        self._nodes: list[NodeView] = []
        self._index: dict[str, int] = {}
        self._now = 0.0
        """Simulated seconds of the last event: the router's clock, so it sees how long a node
        has computed what it was sent in simulated time."""

    def bind(self, nodes: list[NodeView], pool: KvPool | None, cached: dict[str, set[int]] | None = None) -> None:
        self.locator = SimLocator(self.profile, nodes, pool, cached)
        self.router = Router(router_config(self.profile, len(nodes), learn=self.learn), self.locator,
                             clock=lambda: self._now)
        self._nodes = nodes
        self._index = {n.name: i for i, n in enumerate(nodes)}
        self.tick(0.0)

    def tick(self, now: float) -> None:
        assert self.router is not None and self.locator is not None
        self._now = now
        self.locator.readings = [n.reading() for n in self._nodes]
        for b, load in zip(self.router.backends, self.locator.readings, strict=True):
            b.record_load(load)

    def choose(self, job: Job, nodes: list[NodeView], now: float) -> int:
        assert self.router is not None
        self._now = now
        r = job.request
        d = self.router.choose(PromptRef(job), session=r.session, max_tokens=r.max_tokens)
        job.decision = d
        job.ticket = d.backend.admit(d.prefill_tokens, d.kv_blocks, d.chain)
        return self._index[d.backend.name]

    def first_token(self, job: Job, now: float) -> None:
        self._now = now
        t: Ticket = job.ticket
        t.backend.first_token(t)

    def finished(self, job: Job, now: float) -> None:
        self._now = now
        t: Ticket = job.ticket
        b: Backend = t.backend
        b.finish(t)
        d: Decision = job.decision
        ttft = job.ttft
        if self.router is not None and d.estimate is not None and ttft is not None:
            self.router.cost.observe(d.estimate, ttft, job.cached_tokens)
