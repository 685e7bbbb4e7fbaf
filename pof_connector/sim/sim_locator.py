"""The simulator's answer to the router's locality question: per node, the leading prompt tokens in
its engine's prefix cache, those its own pool stores, and those its pool can load (from its own
tier or over the remote tier from another node's), as :class:`~pof_connector.locality.locator.Locator`
answers from the index for real nodes."""

from __future__ import annotations

from pof_connector.index.base import NodeInfo
from pof_connector.locality.locator import Locality, NodeLocality
from pof_connector.sim.base import NodeView
from pof_connector.sim.job import Job
from pof_connector.sim.kv_pool import KvPool
from pof_connector.sim.profile import Profile
from pof_connector.sim.prompt_ref import PromptRef

MODEL = "sim"


class SimLocator:
    def __init__(self, profile: Profile, nodes: list[NodeView], pool: KvPool | None) -> None:
        self.profile = profile
        self.nodes = nodes
        self.pool = pool
        page = profile.block_tokens
        self._info = [NodeInfo(n.name, meta={"page_bytes": str(profile.kv_bytes_per_token * page), "model": MODEL})
                      for n in nodes]

    def locate(self, tokens: list[int], model: str | None = None, cache_salt: str | None = None) -> Locality:
        if not isinstance(tokens, PromptRef):
            raise TypeError("the simulator's locator answers for simulated prompts (PromptRef) only")
        job = tokens.job
        page = self.profile.block_tokens
        out: dict[str, NodeLocality] = {}
        for i, n in enumerate(self.nodes):
            held: dict[str, int] = {}
            usable: dict[str, int] = {}
            if self.pool is not None:
                own, tokens_, tier = self._pool(i, job)
                if own:
                    held[self.profile.local_tier.name] = own
                if tier is not None and tokens_:
                    usable[tier] = tokens_
            out[n.name] = NodeLocality(n.name, page, held, n.cached_prefix(job), usable,
                                       near_tokens=held.get(self.profile.local_tier.name, 0),
                                       load=n.reading(), info=self._info[i])
        return Locality(MODEL, job.prompt_tokens, page, out)

    def _pool(self, node: int, job: Job) -> tuple[int, int, str | None]:
        """(tokens its own pool holds, tokens it can load, the tier they come from)."""
        assert self.pool is not None
        cap = job.prompt_tokens - 1
        page = self.profile.block_tokens
        own = best = 0
        tier: str | None = None
        for key, limit in ((job.session_key, job.history_tokens), (job.system_key, job.request.system_tokens)):
            mine = min(self.pool.own(node, key), limit, cap)
            own = max(own, mine - mine % page)
            n, t = self.pool.best(node, key)
            n = min(n, limit, cap)
            n -= n % page
            if t is not None and n > best:
                best, tier = n, t.name
        return own, best, tier
