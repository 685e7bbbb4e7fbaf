"""The routing decision of `pof router` (no HTTP here: the proxy in proxy.py calls :meth:`choose`).

Policy ``pof``: ask the locality index where the prompt's prefix lives (engine prefix caches and
pools, see :class:`~pof_connector.locality.locator.Locator`) and pick the healthy backend with the
lowest estimated time to first token (:class:`~pof_connector.router.cost_model.CostModel`) plus
what a move there displaces (:attr:`Decision.displacement_s`) among those with KV room for the
request (:class:`~pof_connector.router.kv_admission.KvAdmission`): a prefix holder whose KV
memory is saturated is passed over for a node with room, whose pool loads the prefix; when every
node is saturated, the lowest estimate plus admission cost wins.
Without tokens, or when the index cannot be reached, fall back to the least loaded backend (with
room, when the backends' metrics say).
``least_loaded`` and ``round_robin`` exist for comparison.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from pof_connector.index import IndexUnavailable
from pof_connector.locality.engine_load import EngineLoad
from pof_connector.locality.index_health import IndexHealth
from pof_connector.locality.locator import Locality, ModelRequired, NodeLocality, UnknownModel
from pof_connector.router.backend import Backend
from pof_connector.router.cost_model import Candidate, CostModel, Estimate
from pof_connector.router.kv_admission import Admission, KvAdmission, NodePressure
from pof_connector.router.router_config import RouterConfig
from pof_connector.router.sent_prefixes import SentPrefixes

log = logging.getLogger("pof.router")
STICKY_TTL_S = 3600.0
MAX_SESSIONS = 1 << 16
"""Sessions remembered at most (the least recently used are forgotten): session ids come from
clients, who could otherwise grow the table without end."""


_Weighed = tuple[Backend, NodeLocality | None, float, int, float, int, int | None]
"""A backend as :meth:`Router._by_cost` weighed it: (backend, its locality, KV bytes per token,
leading tokens it holds, move, tokens queued ahead, tokens a request in flight there shares with
the prompt beyond its engine's known cache, or ``None``)."""


class Locates(Protocol):
    """Where a prompt's prefix lives: :class:`~pof_connector.locality.locator.Locator` on the index,
    or the simulator's view of its simulated nodes (``pof sim``), which drives this same router."""

    def locate(self, tokens: list[int], model: str | None = None, cache_salt: str | None = None, *,
               shared_salt: str | None = None, shared_tokens: int = 0) -> Locality: ...


class NoBackend(RuntimeError):
    """Every backend is out of service."""


@dataclass(frozen=True)
class Decision:
    backend: Backend
    reason: str
    """'pof', 'sticky', 'least_loaded', 'round_robin' or 'fallback:<why>'."""
    estimate: Estimate | None = None
    prompt_tokens: int = 0
    route: str = ""
    """Why this node, for policy ``pof`` (header ``x-pof-route-reason``): 'prefix-holder' (it holds
    the longest prefix and has KV room), 'lower-cost' (another node holds more, but this one is
    estimated faster: queue, load), 'load-balanced' (the least loaded node: the lowest estimate
    beat it by less than the estimates' measured error), 'no-prefix' (no node holds any), 'holder-saturated:pool' (the
    holder is saturated; this node has room and its pool loads the prefix),
    'holder-saturated:recompute' (the same, but it recomputes the prefix), 'all-saturated' (the
    least admission cost), 'sticky-saturated:...' (a session moved off its saturated node: the same
    endings). Empty for the other policies."""
    admission: Admission | None = None
    """The chosen node's KV admission (``None``: capacity not assessed)."""
    saturated: tuple[str, ...] = ()
    """Backends saturated for this request."""
    holder: str | None = None
    """The backend holding the longest prefix (engine cache or own pool tiers); ``None``: none."""
    pool_tokens: int = 0
    """Prompt tokens the chosen node's pool loads (beyond its engine's own cache)."""
    lookup_s: float = 0.0
    """Seconds this decision waited on the locality index (the router's ``lookup`` stage)."""
    balance: tuple[float, float] | None = None
    """(gain, margin), seconds: how much lower the lowest estimate was than the least loaded
    backend's, and the estimates' measured error it had to beat (route 'load-balanced' when it
    did not); ``None``: not weighed (another policy, or every backend saturated)."""
    displacement_s: float = 0.0
    """What choosing this node over the one with the cheapest prefix was priced for the
    conversations it evicts there (``cost.displacement_weight`` x the difference in the two nodes'
    prefix costs; header ``x-pof-displacement``). It weighs in the choice, not in ``estimate``,
    which is the request's own TTFT the model learns from."""
    chain: tuple[bytes, ...] = ()
    """The prompt's page digests (:attr:`Locality.chain`), for the chosen backend to count as in
    flight there (:meth:`Backend.admit`); empty: not looked up."""

    @property
    def prefill_tokens(self) -> int:
        return self.estimate.recompute_tokens if self.estimate is not None else self.prompt_tokens

    @property
    def kv_blocks(self) -> int:
        return self.admission.need_blocks if self.admission is not None else 0


class Router:
    def __init__(self, config: RouterConfig, locator: Locates | None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: seconds (`pof sim` passes its simulated time): when readings were taken and
        how long a node has been computing what it was sent."""
        self.config = config
        self._clock = clock
        self.locator = locator
        self.cost = CostModel(config.cost)
        self.kv = KvAdmission(config.capacity)
        self.backends = [Backend(b, config.health.failures_to_remove, self.kv.fit_tokens, clock=clock)
                         for b in config.backends]
        self.sent = SentPrefixes(config.capacity.block_tokens)
        """Prefixes sent to each backend: the cached-token count of a sample the engine did not report."""
        self._rr = itertools.count()
        self._sessions: OrderedDict[tuple[str | None, str], tuple[str, float]] = OrderedDict()
        """(cache salt, session) -> (backend, expiry): a session id is the client's choice, so it is
        only known within its tenant (another tenant sending it is neither routed by it nor told)."""
        self._lock = threading.Lock()
        self.index_health = IndexHealth("pof router", log)
        """Whether routing uses the index now: logged per transition, exported in /metrics."""

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    def choose(self, tokens: list[int] | None, *, cache_salt: str | None = None,
               session: str | None = None, exclude: frozenset[str] = frozenset(),
               max_tokens: int | None = None, shared: tuple[str, int] | None = None) -> Decision:
        """The backend for a prompt of ``tokens`` (``None``: unknown tokens) that generates up to
        ``max_tokens`` (``None``: the request did not say). ``shared``: two salts, (the
        organisation's salt, the tokens it covers) from the request's ``kv_transfer_params``; the
        rest is under ``cache_salt``. Raises :class:`NoBackend`."""
        live = [b for b in self.healthy() if b.name not in exclude] if exclude else self.healthy()
        if not live:
            raise NoBackend("no healthy backend: " + ", ".join(f"{b.name} ({b.url})" for b in self.backends))
        n_tokens = len(tokens) if tokens is not None else 0
        policy = self.config.policy
        need = self.kv.need_tokens(n_tokens, max_tokens)
        moved = False
        if session is not None:
            sticky = self._sticky((cache_salt, session), live)
            if sticky is not None:
                adm = self._assess(sticky, need) if policy == "pof" else None
                if adm is None or not adm.saturated:
                    return Decision(sticky, "sticky", prompt_tokens=n_tokens, admission=adm)
                moved = True            # its node is full: the session moves, its KV comes from the pool
        if policy == "round_robin":
            decision = Decision(live[next(self._rr) % len(live)], "round_robin", prompt_tokens=n_tokens)
        elif policy == "least_loaded" or tokens is None or self.locator is None:
            why = "least_loaded" if policy == "least_loaded" else "fallback:no_tokens" if tokens is None \
                else "fallback:no_index"
            decision = self._least_loaded_decision(live, why, n_tokens, need if policy == "pof" else None)
        else:
            decision = self._by_cost(tokens, cache_salt, live, need, shared)
        if moved and decision.route:
            decision = replace(decision, route="sticky-saturated:" + decision.route.split(":")[-1])
        if session is not None:
            with self._lock:
                self._sessions[(cache_salt, session)] = (decision.backend.name, self._clock() + STICKY_TTL_S)
                self._sessions.move_to_end((cache_salt, session))
                while len(self._sessions) > MAX_SESSIONS:
                    self._sessions.popitem(last=False)
        return decision

    def _assess(self, b: Backend, need: int, fallback: EngineLoad | None = None) -> Admission:
        pressure = b.pressure(self.config.capacity.stale_after_s)
        if pressure.load is None and fallback is not None:
            pressure = NodePressure(fallback)        # the relay's reading, published in the index
        return self.kv.assess(pressure, need, s_per_token=self.cost.s_per_token, overhead_s=self.cost.overhead_s)

    def _by_cost(self, tokens: list[int], cache_salt: str | None, live: list[Backend], need: int,
                 shared: tuple[str, int] | None = None) -> Decision:
        assert self.locator is not None
        asked = time.perf_counter()
        try:
            found: Locality | None = (
                self.locator.locate(tokens, self.config.model, cache_salt) if shared is None else
                self.locator.locate(tokens, self.config.model, cache_salt, shared_salt=shared[0],
                                    shared_tokens=shared[1]))
        except (IndexUnavailable, ModelRequired, UnknownModel) as e:
            lookup_s = time.perf_counter() - asked
            self.index_health.lost(type(e).__name__, str(e), "routing to the least loaded backend until it is back")
            decision = self._least_loaded_decision(live, f"fallback:{type(e).__name__}", len(tokens), need)
            return replace(decision, lookup_s=lookup_s)
        lookup_s = time.perf_counter() - asked
        assert found is not None
        self.index_health.ok()
        n_tokens = len(tokens)
        cost, kv, stale = self.cost, self.kv, self.config.capacity.stale_after_s
        ttft_s, fit_tokens = cost.ttft_s, kv.fit_tokens
        # A node is weighed by its TTFT estimate plus ``move``: displacement_weight x its prefix cost
        # (recompute and pool load). A node without the prefix allocates what the holder has cached
        # and evicts that much of other conversations' context, which they load or recompute later;
        # static routing never pays that, and on hosts where a second server adds little compute a
        # move priced by its own request alone lost to it (issue 47's neighbours run). Adding the
        # whole prefix cost, not its excess over the cheapest node's, ranks the same.
        weight = self.config.cost.displacement_weight
        nodes_get = found.nodes.get
        # Every backend is weighed with plain numbers (a cluster of hundreds of backends, and `pof
        # sim` driving this per simulated request); the chosen one's Estimate and Admission objects
        # are built once it is known. Keys: equal estimates (e.g. nodes loading the same shared
        # region) go to the node holding the prefix, then round the backends (an idle cluster and a
        # new prefix), not always to the first: the backends are visited in their turn order (the
        # turn of live[i] is (i - offset) mod n), so an earlier one keeps a tie.
        n_live = len(live)
        start = next(self._rr) % n_live
        order = live[start:] + live[:start] if start else live
        # id(locality entry) -> (recompute, fetch_s, bytes per token, held, move, idle): the entries
        # of nodes holding nothing of the prompt may be one shared object (the simulator's are);
        # ``idle``: running requests -> the score of a node with nothing waiting, the same for
        # all such nodes of the entry (most nodes, most of the time)
        terms: dict[int, tuple[int, float, float, int, float, dict[int, float]]] = {}
        need_pos = need if need > 0 else 0
        best: _Weighed | None = None
        best_ttft, best_held = 0.0, 0
        # the least loaded backend with room (the earliest in turn order of equals): the stock
        # load balancer's choice, taken when the lowest estimate beats it by less than the
        # estimates' measured error
        lightest: _Weighed | None = None
        lightest_ttft, lightest_load = 0.0, (0, 0)
        holder: tuple[Backend, int] | None = None
        holder_held = -1
        saturated: list[tuple[int, _Weighed, float, EngineLoad | None, int, bool]] = []
        now = self._clock()
        per_s = 1.0 / cost.s_per_token             # prefill tokens a node computes per second
        last: object = False                        # matches no entry: the first backend looks its entry up
        idle: dict[int, float] = {}
        recompute, fetch_s, bpt, held, move = 0, 0.0, 0.0, 0, 0.0
        least_move = math.inf
        chain, page = found.chain, found.page_tokens
        for turn, b in enumerate(order):
            node = nodes_get(b.pool_node)
            if node is not last:                   # most often the previous backend's entry
                last = node
                t = terms.get(id(node))
                if t is None:
                    r, f, p, h = self._prefix_terms(node, n_tokens)
                    t = terms[id(node)] = (r, f, p, h, weight * cost.prefix_s(r, f), {})
                recompute, fetch_s, bpt, held, move, idle = t
                if move < least_move:
                    least_move = move
            waiting, running = b.waiting, b.running
            # this backend's own terms where a request in flight there shares more of the prompt
            # than its engine's cache is known to (``own``: those tokens; None: the entry's terms)
            own: int | None = None
            b_recompute, b_fetch_s, b_held, b_move = recompute, fetch_s, held, move
            if chain and running:
                flying = b.in_flight_tokens(chain, page)
                if flying > (node.engine_tokens if node is not None else 0):
                    own = flying
                    b_recompute, b_fetch_s, _, b_held = self._prefix_terms(node, n_tokens, flying)
                    b_move = weight * cost.prefix_s(b_recompute, b_fetch_s)
                    if b_move < least_move:
                        least_move = b_move
            if waiting:
                # Backend.tokens_left written out: what the node still has to compute of them
                left = int(b.waiting_tokens - (now - b.busy_since) * per_s)
                queued = left if left > 0 else 0
                ttft = ttft_s(b_recompute, b_fetch_s, running, waiting, queued) + b_move
            elif own is None and (known := idle.get(running)) is not None:
                ttft, queued = known, 0
            else:
                ttft, queued = ttft_s(b_recompute, b_fetch_s, running, 0, 0) + b_move, 0
                if own is None:
                    idle[running] = ttft
            # the node is saturated for this request when its need exceeds the most its KV reading
            # fits (KvAdmission.fit_tokens), which the backend keeps with its reading
            state = b.pressure_state
            if state[0] is not None and now - state[3] <= stale:
                fit = state[4]
            elif node is not None and node.load is not None:
                fit = fit_tokens(node.load, 0, False)
                state = (node.load, 0, False, now, fit)     # the relay's reading, published in the index
            else:
                fit = None
            chosen = (b, node, bpt, b_held, b_move, queued, own)
            if fit is None or need_pos <= fit:
                if best is None or ttft < best_ttft or (ttft == best_ttft and b_held > best_held):
                    best, best_ttft, best_held = chosen, ttft, b_held
                if lightest is None or (queued, running) < lightest_load:
                    lightest, lightest_ttft, lightest_load = chosen, ttft, (queued, running)
            else:
                saturated.append((turn, chosen, ttft, state[0], state[1], state[2]))
            if b_held > holder_held:
                holder, holder_held = (b, turn), b_held
        assert holder is not None
        roomy = best is not None
        if best is None:                           # all saturated: the least estimate plus admission cost
            s_per_token, overhead_s = cost.s_per_token, cost.overhead_s
            for _, weighed, ttft, load, pending, preempting in saturated:
                ttft += kv.verdict(load, pending, preempting, need, s_per_token, overhead_s)[4]
                if best is None or ttft < best_ttft or (ttft == best_ttft and weighed[3] > best_held):
                    best, best_ttft, best_held = weighed, ttft, weighed[3]
        assert best is not None
        gain = lightest_ttft - best_ttft if lightest is not None else 0.0
        margin = cost.error_s if self.config.cost.balance_within_error else 0.0
        balanced = lightest is not None and lightest[0] is not best[0] and gain < margin
        if balanced:
            assert lightest is not None
            best, best_held = lightest, lightest[3]
        b, node, bpt, _, move, queued, own = best
        engine_tokens = own if own is not None else node.engine_tokens if node else 0
        estimate = cost.estimate(Candidate(
            b.name, n_tokens, engine_tokens, node.usable if node else {}, bpt, b.running, b.waiting, queued))
        admission = self._assess(b, need, node.load if node else None)
        holder_b, holder_turn = holder
        has_holder = holder_held > 0
        if not roomy:
            route = "all-saturated"
        elif balanced:
            route = "load-balanced"
        elif not has_holder:
            route = "no-prefix"
        elif holder_b is b or best_held >= holder_held:
            route = "prefix-holder"
        elif any(s[0] == holder_turn for s in saturated):
            route = "holder-saturated:pool" if estimate.fetch_tokens > 0 else "holder-saturated:recompute"
        else:
            route = "lower-cost"
        # the saturated backends in live order
        names = tuple(live[i].name for i in sorted((start + s[0]) % n_live for s in saturated)) if saturated else ()
        return Decision(b, "pof", estimate, n_tokens, route, admission, names,
                        holder_b.name if has_holder else None, estimate.fetch_tokens, lookup_s,
                        (round(gain, 6), round(margin, 6)) if roomy else None, round(move - least_move, 6), chain)

    def _prefix_terms(self, node: NodeLocality | None, n_tokens: int,
                      engine_tokens: int | None = None) -> tuple[int, float, float, int]:
        """(recompute, fetch_s, bytes per token, held) of a prompt on a node with locality ``node``
        (``None``: the index knows nothing of it); ``engine_tokens``: what its engine will hold of
        the prompt when the request's turn comes (``None``: what the index says it holds)."""
        if node is None:
            engine = engine_tokens or 0
            recompute, _, fetch_s = self.cost.prefix_terms(n_tokens, engine, {}, 0.0)
            return recompute, fetch_s, 0.0, engine
        engine = node.engine_tokens if engine_tokens is None else engine_tokens
        bpt = _bytes_per_token(node)
        recompute, _, fetch_s = self.cost.prefix_terms(n_tokens, engine, node.usable, bpt)
        return recompute, fetch_s, bpt, max(engine, node.held_tokens)

    def _least_loaded_decision(self, live: list[Backend], why: str, n_tokens: int, need: int | None) -> Decision:
        """The least loaded backend; with ``need`` (policy ``pof``) among those with KV room when any has."""
        if need is None:
            return Decision(self._least_loaded(live), why, prompt_tokens=n_tokens)
        assessed = [(b, self._assess(b, need)) for b in live]
        roomy = [b for b, a in assessed if not a.saturated]
        chosen = self._least_loaded(roomy or live)
        adm = next(a for b, a in assessed if b is chosen)
        return Decision(chosen, why, prompt_tokens=n_tokens, admission=adm,
                        saturated=tuple(b.name for b, a in assessed if a.saturated))

    def _least_loaded(self, live: list[Backend]) -> Backend:
        """The backend with the least prefill left to compute, then the fewest requests (the
        earliest in turn order of equals)."""
        start, now, s_per_token = next(self._rr), self._clock(), self.cost.s_per_token
        return min((live[(start + i) % len(live)] for i in range(len(live))),
                   key=lambda b: (b.tokens_left(now, s_per_token), b.running))

    def _sticky(self, session: tuple[str | None, str], live: list[Backend]) -> Backend | None:
        with self._lock:
            entry = self._sessions.get(session)
            if entry is None or entry[1] < self._clock():
                return None
            return next((b for b in live if b.name == entry[0]), None)


def _bytes_per_token(node: NodeLocality) -> float:
    """KV bytes per token of ``node``'s pages (its published ``page_bytes``); 0: it does not say."""
    if node.info is None or not node.page_tokens:
        return 0.0
    return int(node.info.meta.get("page_bytes", 0)) / node.page_tokens
