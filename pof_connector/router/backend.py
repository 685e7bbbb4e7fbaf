"""One engine behind `pof router`: its health, the load the router itself put on it, and the
engine's own load and KV pressure as its last ``/metrics`` reading showed them."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pof_connector.locality.engine_load import EngineLoad
from pof_connector.router.kv_admission import NodePressure
from pof_connector.router.router_config import BackendConfig

log = logging.getLogger("pof.router")


@dataclass(eq=False)
class Ticket:
    """A request on a backend; it counts as waiting, with ``prefill_tokens``, until its first token."""

    backend: Backend
    prefill_tokens: int
    kv_blocks: int = 0
    """KV blocks it will hold (its admission estimate)."""
    pending: bool = True
    """Its blocks are not in the engine's last KV reading: sent after it, or still without a first
    token then (queued in the engine, which allocates blocks only when it schedules a request)."""
    first_token_seen: bool = False
    done: bool = False
    chain: tuple[bytes, ...] = ()
    """Its prompt's page digests (:attr:`~pof_connector.locality.locator.Locality.chain`): in the
    engine's KV from its prefill until it ends (:meth:`Backend.in_flight_tokens`)."""


FitTokens = Callable[[EngineLoad | None, int, bool], int | None]
"""(reading, pending blocks, preempting) -> the most KV tokens a request may need on the node
without saturating it (:meth:`~pof_connector.router.kv_admission.KvAdmission.fit_tokens`)."""


class Backend:
    def __init__(self, config: BackendConfig, failures_to_remove: int, fit_tokens: FitTokens | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``fit_tokens``: the router's KV rule, kept in :attr:`pressure_state` (``None``: no
        limit, the router does not weigh KV room). ``clock``: seconds, the router's (`pof sim`
        passes its simulated time)."""
        self.config = config
        self._clock = clock
        self.name = config.name
        self.url = config.url
        self.pool_node = config.pool_node
        """Its pool's node id in the index (``config.pool_node``, read once: the router looks it
        up for every backend per request)."""
        self.healthy = True
        self._failures = 0
        self._failures_to_remove = failures_to_remove
        self.running = 0
        self.waiting = 0
        """Requests without a first token yet (also counted in ``running``)."""
        self.waiting_tokens = 0
        self.busy_since = 0.0
        """When the node began the prefill work it still owes this router (:meth:`tokens_left`):
        when a request came to a node with none waiting, or the last first token came while others
        still waited; by the clock of the constructor."""
        self.served = 0
        self.engine_load: EngineLoad | None = None
        """The engine's last ``/metrics`` reading; ``None`` before one, or when the last failed."""
        self.preempting = False
        """Its preemption counter grew between the last two readings."""
        self._load_at = 0.0
        self._pending_blocks = 0
        self._fit_tokens = fit_tokens
        self.pressure_state: tuple[EngineLoad | None, int, bool, float, int | None] = (None, 0, False, 0.0, None)
        """(``engine_load``, pending blocks, ``preempting``, when the reading was taken, and the
        most KV tokens a request may need without saturating the node by them: ``fit_tokens``):
        replaced whole, under the lock, whenever one of them changes, so the router reads them
        consistently without taking the lock, and weighs the KV room of every backend per
        request with one comparison (the limit changes with a reading or a request, not per
        request weighed)."""
        self._live: set[Ticket] = set()
        self._in_flight: dict[bytes, int] = {}
        """Page digest -> live tickets whose prompt has it (:meth:`in_flight_tokens`)."""
        self._lock = threading.Lock()

    def admit(self, prefill_tokens: int, kv_blocks: int = 0, chain: tuple[bytes, ...] = ()) -> Ticket:
        """``chain``: the prompt's page digests (empty: not known); the router counts them as in the
        node's KV until the request ends."""
        with self._lock:
            if self.waiting == 0:
                self.busy_since = self._clock()
            self.running += 1
            self.waiting += 1
            self.waiting_tokens += prefill_tokens
            self._pending_blocks += kv_blocks
            self._publish()
            t = Ticket(self, prefill_tokens, kv_blocks, chain=chain)
            self._live.add(t)
            counts = self._in_flight
            for d in chain:
                counts[d] = counts.get(d, 0) + 1
            return t

    def record_load(self, load: EngineLoad | None) -> None:
        """A new ``/metrics`` reading (``None``: it failed or carried no load gauges)."""
        with self._lock:
            prev = self.engine_load
            self.preempting = bool(load is not None and prev is not None and load.preemptions is not None
                                   and prev.preemptions is not None and load.preemptions > prev.preemptions)
            self.engine_load = load
            self._load_at = self._clock()
            # The engine's gauge now counts what had begun by then; what it still queued, it does not.
            self._pending_blocks = 0
            for t in self._live:
                t.pending = not t.first_token_seen
                self._pending_blocks += t.kv_blocks if t.pending else 0
            self._publish()

    def _publish(self) -> None:
        """Renew :attr:`pressure_state` (with the lock held)."""
        load, pending, preempting = self.engine_load, self._pending_blocks, self.preempting
        fit = self._fit_tokens(load, pending, preempting) if self._fit_tokens is not None else None
        self.pressure_state = (load, pending, preempting, self._load_at, fit)

    def pressure(self, stale_after_s: float) -> NodePressure:
        """The last reading, if younger than ``stale_after_s``, with the blocks it does not show
        (requests sent since, and those it found still waiting for their first token)."""
        return NodePressure(*self.pressure_fields(stale_after_s))

    def pressure_fields(self, stale_after_s: float, now: float | None = None) -> tuple[EngineLoad | None, int, bool]:
        """:meth:`pressure`'s fields as a tuple (what the router reads of every backend per
        request); ``now``: the clock read once for all of them (``None``: read it)."""
        load, pending, preempting, at, _ = self.pressure_state
        if load is None or (self._clock() if now is None else now) - at > stale_after_s:
            return None, 0, False
        return load, pending, preempting

    def tokens_left(self, now: float, s_per_token: float) -> int:
        """Prefill tokens the node still has to compute for this router's waiting requests: their
        tokens less what it computed since :attr:`busy_since` at ``s_per_token`` (0: none waiting,
        or it should be done). Counting them whole until the first token made a node about to
        finish look like one that had just begun, and the router queued behind it as readily."""
        if not self.waiting:
            return 0
        left = int(self.waiting_tokens - (now - self.busy_since) * (1.0 / s_per_token))
        return left if left > 0 else 0

    def in_flight_tokens(self, chain: tuple[bytes, ...], page_tokens: int) -> int:
        """Leading tokens of a prompt with page digests ``chain`` that a request this router sent
        here and has not seen end shares: the engine computes them for that request (its prefill
        comes first in the node's queue) and keeps them while it runs, before its relay tells the
        index. Without this a second request of a new system prompt, sent while the first still
        computes it, saw no holder and went to recompute it all elsewhere."""
        counts = self._in_flight
        if not counts or not chain or chain[0] not in counts:
            return 0
        # chained digests: a prompt that has page k's has every page's before it, so the pages
        # present are a leading run, found by bisection
        lo, hi = 1, len(chain)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if chain[mid - 1] in counts:
                lo = mid
            else:
                hi = mid - 1
        return lo * page_tokens

    def first_token(self, t: Ticket) -> None:
        with self._lock:
            if not t.first_token_seen and not t.done:
                t.first_token_seen = True
                self._stop_waiting(t)

    def _stop_waiting(self, t: Ticket) -> None:
        """``t`` computed its prefill or ended without (with the lock held); the node's progress on
        the others counts from now, since what it did for them meanwhile is unknown."""
        self.waiting -= 1
        self.waiting_tokens -= t.prefill_tokens
        self.busy_since = self._clock()

    def finish(self, t: Ticket) -> None:
        with self._lock:
            if t.done:
                return
            if not t.first_token_seen:
                self._stop_waiting(t)
            t.done = True
            self.running -= 1
            self.served += 1
            self._live.discard(t)
            counts = self._in_flight
            for d in t.chain:
                left = counts[d] - 1
                if left:
                    counts[d] = left
                else:
                    del counts[d]
            if t.pending:
                self._pending_blocks -= t.kv_blocks
                self._publish()

    def check_passed(self) -> None:
        with self._lock:
            self._failures = 0
            if not self.healthy:
                log.info("pof router: backend %s (%s) is healthy again", self.name, self.url)
            self.healthy = True

    def check_failed(self, why: str, *, now: bool = False) -> None:
        """A failed health check (``now``: a failed request, which takes the backend out at once)."""
        with self._lock:
            self._failures += 1
            if self.healthy and (now or self._failures >= self._failures_to_remove):
                self.healthy = False
                log.warning("pof router: backend %s (%s) removed: %s", self.name, self.url, why)

    def state(self) -> dict[str, object]:
        return {"name": self.name, "url": self.url, "node_id": self.config.pool_node, "healthy": self.healthy,
                "running": self.running, "waiting": self.waiting, "waiting_tokens": self.waiting_tokens,
                "served": self.served, "engine": _load_state(self.engine_load), "preempting": self.preempting}


def _load_state(load: EngineLoad | None) -> dict[str, object] | None:
    if load is None:
        return None
    return {"running": load.running, "waiting": load.waiting, "kv_usage": load.kv_usage,
            "kv_capacity_tokens": load.kv_capacity_tokens, "block_tokens": load.block_tokens,
            "preemptions": load.preemptions}
