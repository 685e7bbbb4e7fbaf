"""The vLLM worker's side of the audit (:mod:`pof_connector.audit`): which of a step's staged
pages are compared with the pool's instead of stored, and when.

A page of an audited request is staged like any save (the engine computed it). Its comparison
runs on the auditor's thread once the staging holds the bytes; in a step whose saves are held
(some rank's load may have failed under a block this step's compute read) it waits for the
scheduler's verdict, and is dropped with the step's saves: a page computed on a failed load
would be a false alarm against a right pool page."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pof_connector.adapters.vllm_metadata import SaveJob
from pof_connector.audit.auditor import Auditor
from pof_connector.index import Location
from pof_connector.pages import PageKey
from pof_connector.pool import Pool


class Countdown:
    """Calls ``fn`` once, when every user it was :meth:`add`-ed for (and the creator) is :meth:`done`."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn, self._users, self._lock = fn, 1, threading.Lock()

    def add(self) -> None:
        with self._lock:
            self._users += 1

    def done(self, _: object = None) -> None:
        with self._lock:
            self._users -= 1
            last = self._users == 0
        if last:
            self._fn()


@dataclass
class _Pending:
    pages: list[tuple[PageKey, Location, int]]     # this rank's key, the pool's source, position in the staging
    segments: np.ndarray                            # [layers, pages, segment_bytes]
    ready: Callable[[], None] | None
    done: Callable[[], None]


class WorkerAudits:
    def __init__(self, pool: Pool, auditor: Auditor) -> None:
        self.pool, self.auditor = pool, auditor
        self._held: dict[int, list[tuple[str, _Pending]]] = {}

    def sources(self, job: SaveJob, keys: list[PageKey]) -> dict[int, Location]:
        """``job.audit`` for this rank: the scheduler's sources are rank 0's; another rank (other
        heads or layers, its own namespace) looks its own pages up. A page it lacks is not audited."""
        if not job.audit or keys[0].namespace == job.keys[0].namespace:
            return dict(job.audit)
        positions = sorted(job.audit)
        found = self.pool.lookup([keys[i] for i in positions], count=False)
        return {i: found.sources[n] for n, i in enumerate(positions[:found.pages])}

    def add(self, step: int, held: bool, req_id: str, pages: list[tuple[PageKey, Location, int]],
            segments: np.ndarray, ready: Callable[[], None] | None, done: Callable[[], None]) -> None:
        """Compare ``pages`` of ``segments`` now, or after the verdict on ``step`` when ``held``;
        ``done`` is called once they no longer read ``segments``."""
        pending = _Pending(pages, segments, ready, done)
        if held:
            self._held.setdefault(step, []).append((req_id, pending))
        else:
            self._run(pending)

    def settle(self, step: int, discard: set[str]) -> None:
        """The verdict on ``step``: its audits run unless their request is in ``discard``; those
        of earlier steps still waiting never got one and are dropped."""
        for s in sorted(s for s in self._held if s <= step):
            for req_id, pending in self._held.pop(s):
                if s == step and req_id not in discard:
                    self._run(pending)
                else:
                    pending.done()

    def _run(self, p: _Pending) -> None:
        futures = [self.auditor.submit(key, src, [p.segments[layer, pos] for layer in range(p.segments.shape[0])],
                                       p.ready) for key, src, pos in p.pages]
        if not futures:
            p.done()
            return
        futures[-1].add_done_callback(lambda _: p.done())      # one thread: they complete in order

    def close(self) -> None:
        self.settle(1 << 62, set())
        self.auditor.close()
