"""The routing decision of `pof router` (no HTTP here: the proxy in proxy.py calls :meth:`choose`).

Policy ``pof``: ask the locality index where the prompt's prefix lives (engine prefix caches and
pools, see :class:`~pof_connector.locality.locator.Locator`) and pick the healthy backend with the
lowest estimated time to first token (:class:`~pof_connector.router.cost_model.CostModel`).
Without tokens, or when the index cannot be reached, fall back to the least loaded backend.
``least_loaded`` and ``round_robin`` exist for comparison.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from pof_connector.index import IndexUnavailable
from pof_connector.locality.index_health import IndexHealth
from pof_connector.locality.locator import Locality, Locator, ModelRequired, UnknownModel
from pof_connector.router.backend import Backend
from pof_connector.router.cost_model import Candidate, CostModel, Estimate
from pof_connector.router.router_config import RouterConfig

log = logging.getLogger("pof.router")
STICKY_TTL_S = 3600.0
MAX_SESSIONS = 1 << 16
"""Sessions remembered at most (the least recently used are forgotten): session ids come from
clients, who could otherwise grow the table without end."""


class NoBackend(RuntimeError):
    """Every backend is out of service."""


@dataclass(frozen=True)
class Decision:
    backend: Backend
    reason: str
    """'pof', 'sticky', 'least_loaded', 'round_robin' or 'fallback:<why>'."""
    estimate: Estimate | None = None
    prompt_tokens: int = 0

    @property
    def prefill_tokens(self) -> int:
        return self.estimate.recompute_tokens if self.estimate is not None else self.prompt_tokens


class Router:
    def __init__(self, config: RouterConfig, locator: Locator | None) -> None:
        self.config = config
        self.locator = locator
        self.backends = [Backend(b, config.health.failures_to_remove) for b in config.backends]
        self.cost = CostModel(config.cost)
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
               session: str | None = None, exclude: frozenset[str] = frozenset()) -> Decision:
        """The backend for a prompt of ``tokens`` (``None``: unknown tokens). Raises :class:`NoBackend`."""
        live = [b for b in self.healthy() if b.name not in exclude]
        if not live:
            raise NoBackend("no healthy backend: " + ", ".join(f"{b.name} ({b.url})" for b in self.backends))
        n_tokens = len(tokens) if tokens is not None else 0
        if session is not None:
            sticky = self._sticky((cache_salt, session), live)
            if sticky is not None:
                return Decision(sticky, "sticky", prompt_tokens=n_tokens)
        policy = self.config.policy
        if policy == "round_robin":
            decision = Decision(live[next(self._rr) % len(live)], "round_robin", prompt_tokens=n_tokens)
        elif policy == "least_loaded" or tokens is None or self.locator is None:
            why = "least_loaded" if policy == "least_loaded" else "fallback:no_tokens" if tokens is None \
                else "fallback:no_index"
            decision = Decision(self._least_loaded(live), why, prompt_tokens=n_tokens)
        else:
            decision = self._by_cost(tokens, cache_salt, live)
        if session is not None:
            with self._lock:
                self._sessions[(cache_salt, session)] = (decision.backend.name, time.monotonic() + STICKY_TTL_S)
                self._sessions.move_to_end((cache_salt, session))
                while len(self._sessions) > MAX_SESSIONS:
                    self._sessions.popitem(last=False)
        return decision

    def _by_cost(self, tokens: list[int], cache_salt: str | None, live: list[Backend]) -> Decision:
        assert self.locator is not None
        try:
            found: Locality | None = self.locator.locate(tokens, self.config.model, cache_salt)
        except (IndexUnavailable, ModelRequired, UnknownModel) as e:
            self.index_health.lost(type(e).__name__, str(e), "routing to the least loaded backend until it is back")
            return Decision(self._least_loaded(live), f"fallback:{type(e).__name__}", prompt_tokens=len(tokens))
        assert found is not None
        self.index_health.ok()
        best: tuple[float, int, Backend, Estimate] | None = None
        offset = next(self._rr)
        for i, b in enumerate(live):
            node = found.nodes.get(b.config.pool_node)
            bytes_per_token = 0.0
            if node is not None and node.info is not None and node.page_tokens:
                bytes_per_token = int(node.info.meta.get("page_bytes", 0)) / node.page_tokens
            est = self.cost.estimate(Candidate(
                b.name, len(tokens), node.engine_tokens if node else 0, node.usable if node else {},
                bytes_per_token, b.running, b.waiting, b.waiting_tokens))
            # ties (e.g. an idle cluster and a new prefix) go round the backends, not always to the first
            key = (est.ttft_s, (i - offset) % len(live))
            if best is None or key < best[:2]:
                best = (*key, b, est)
        assert best is not None
        return Decision(best[2], "pof", best[3], len(tokens))

    def _least_loaded(self, live: list[Backend]) -> Backend:
        start = next(self._rr)
        return min((live[(start + i) % len(live)] for i in range(len(live))),
                   key=lambda b: (b.waiting_tokens, b.running))

    def _sticky(self, session: tuple[str | None, str], live: list[Backend]) -> Backend | None:
        with self._lock:
            entry = self._sessions.get(session)
            if entry is None or entry[1] < time.monotonic():
                return None
            return next((b for b in live if b.name == entry[0]), None)
