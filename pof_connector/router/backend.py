"""One engine behind `pof router`: its health and the load the router itself put on it."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from pof_connector.router.router_config import BackendConfig

log = logging.getLogger("pof.router")


@dataclass
class Ticket:
    """A request on a backend; it counts as waiting, with ``prefill_tokens``, until its first token."""

    backend: Backend
    prefill_tokens: int
    first_token_seen: bool = False
    done: bool = False


class Backend:
    def __init__(self, config: BackendConfig, failures_to_remove: int) -> None:
        self.config = config
        self.name = config.name
        self.url = config.url
        self.healthy = True
        self._failures = 0
        self._failures_to_remove = failures_to_remove
        self.running = 0
        self.waiting = 0
        """Requests without a first token yet (also counted in ``running``)."""
        self.waiting_tokens = 0
        self.served = 0
        self._lock = threading.Lock()

    def admit(self, prefill_tokens: int) -> Ticket:
        with self._lock:
            self.running += 1
            self.waiting += 1
            self.waiting_tokens += prefill_tokens
        return Ticket(self, prefill_tokens)

    def first_token(self, t: Ticket) -> None:
        with self._lock:
            if not t.first_token_seen and not t.done:
                t.first_token_seen = True
                self.waiting -= 1
                self.waiting_tokens -= t.prefill_tokens

    def finish(self, t: Ticket) -> None:
        with self._lock:
            if t.done:
                return
            if not t.first_token_seen:
                self.waiting -= 1
                self.waiting_tokens -= t.prefill_tokens
            t.done = True
            self.running -= 1
            self.served += 1

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
                "served": self.served}
