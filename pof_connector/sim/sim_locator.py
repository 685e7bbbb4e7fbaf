"""The simulator's answer to the router's locality question: per node, the leading prompt tokens in
its engine's prefix cache, those its own pool stores, and those its pool can load (from its own
tier or over the remote tier from another node's), as :class:`~pof_connector.locality.locator.Locator`
answers from the index for real nodes."""

from __future__ import annotations

from collections.abc import Iterable

from pof_connector.index.base import NodeInfo
from pof_connector.locality.engine_load import EngineLoad
from pof_connector.locality.locator import Locality, NodeLocality
from pof_connector.sim.base import NodeView
from pof_connector.sim.job import Job
from pof_connector.sim.kv_pool import KvPool
from pof_connector.sim.profile import Profile
from pof_connector.sim.prompt_ref import PromptRef

MODEL = "sim"


class SimLocator:
    def __init__(self, profile: Profile, nodes: list[NodeView], pool: KvPool | None,
                 cached: dict[str, set[int]] | None = None) -> None:
        self.profile = profile
        self.nodes = nodes
        self.pool = pool
        self.cached = cached
        """Prefix key -> nodes whose engine cache has it (``None``: ask every node)."""
        self._names = [n.name for n in nodes]
        page = profile.block_tokens
        self.readings: list[EngineLoad] = []
        """The nodes' last metrics readings (what a relay would publish beside the index)."""
        self._nothing: dict[int, NodeLocality] = {}
        """Tokens the pool can load over the remote tier -> the entry of a node holding nothing."""
        self._info = [NodeInfo(n.name, meta={"page_bytes": str(profile.kv_bytes_per_token * page), "model": MODEL})
                      for n in nodes]

    def locate(self, tokens: list[int], model: str | None = None, cache_salt: str | None = None, *,
               shared_salt: str | None = None, shared_tokens: int = 0) -> Locality:
        if not isinstance(tokens, PromptRef):
            raise TypeError("the simulator's locator answers for simulated prompts (PromptRef) only")
        job = tokens.job
        page = self.profile.block_tokens
        local = self.profile.local_tier.name
        remote = self.profile.remote_tier.name
        own_of = self._stored(job)
        far = max(own_of.values(), default=0)
        # Nodes holding the same of the prompt (own pool, engine cache; most often nothing, or a
        # tenant's system prompt cached everywhere) share one entry: the router reads of an entry
        # only the page size and what it holds and can load, and weighs each distinct entry once;
        # the nodes' loads it reads from its own backends, which the simulator keeps fresh (so the
        # entries carry no load reading and no node id).
        if self.cached is None:
            maybe: Iterable[int] = range(len(self.nodes))
        else:
            by_session, by_system = self.cached.get(job.session_key), self.cached.get(job.system_key)
            maybe = by_session | by_system if by_session and by_system else by_session or by_system or ()
        engine_of = {i: e for i in maybe if (e := self.nodes[i].cached_prefix(job))}
        nothing = self._nothing.get(far)
        if nothing is None:                    # the router only reads entries: one per ``far`` serves
            nothing = self._nothing[far] = NodeLocality("*", page, {}, 0, {remote: far} if far else {}, 0, None,
                                                        self._info[0])
        out: dict[str, NodeLocality] = dict.fromkeys(self._names, nothing)
        names = self._names

        def entry_of(own: int, engine: int) -> NodeLocality:
            if own:
                held, usable = {local: own}, ({local: own} if own >= far else {remote: far})
            else:
                held, usable = {}, ({remote: far} if far else {})
            return NodeLocality("*", page, held, engine, usable, own, None, self._info[0])
        by_own: dict[int, NodeLocality] = {}   # nodes whose engine caches none of it, by what their pool has
        for i, own in own_of.items():
            if engine_of and i in engine_of:
                continue
            entry = by_own.get(own)
            if entry is None:
                entry = by_own[own] = entry_of(own, 0)
            out[names[i]] = entry
        shared: dict[tuple[int, int], NodeLocality] = {}
        for i, engine in engine_of.items():
            own = own_of.get(i, 0)
            entry = shared.get((own, engine))
            if entry is None:
                entry = shared[(own, engine)] = entry_of(own, engine)
            out[names[i]] = entry
        return Locality(MODEL, job.prompt_tokens, page, out)

    def _stored(self, job: Job) -> dict[int, int]:
        """Per node whose pool stores some of ``job``'s prompt, the most leading tokens of it stored
        under one of its prefix keys (capped at what the prompt shares with it, whole pages)."""
        if self.pool is None:
            return {}
        cap = job.prompt_tokens - 1
        page = self.profile.block_tokens
        own_of: dict[int, int] = {}
        for key, limit in ((job.session_key, job.history_tokens), (job.system_key, job.request.system_tokens)):
            where = self.pool.holders(key)
            if where:
                lim = min(limit, cap)
                for node, n in where.items():
                    n = (n if n < lim else lim) // page * page
                    if n > own_of.get(node, 0):
                        own_of[node] = n
        return own_of
