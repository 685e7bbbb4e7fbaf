"""Whether `pof router` runs its routing choice (the index lookup in it) on the event loop.

The choice blocks on the locality index: a thread keeps a slow or hung index from stalling every
other request, but the hop to it and back costs ~0.1 ms per request on an idle host, and 5-25 ms on
a busy one: the thread waits for the GIL behind the event loop after every socket read. So the
choice runs inline unless the index looks sick: a slow choice sends the next
:data:`THREADED_AFTER_SLOW` choices to a thread, so a hung index stalls the loop once, for at most
the index client's timeout, not per request.

What counts as slow, and why (issue 42's capacity runs: two vLLM servers beside the router and the
index on a 2-core box, the default mix at x8):

- inline, over :data:`INLINE_MAX_S` (100 ms). There the index answered within 1 ms for 65% of the
  choices, within 10 ms for 93%, and over 50 ms for 1.5-4% (the index server waiting for a core).
  With the bar at 2 ms, 10 ms and 50 ms, 74%, 48% and 28% of the choices ran on the thread, where
  the ``choose`` stage's mean was 5-24 ms against 0.1 ms inline.
- inline, but the host took the CPU away from the router during the choice (an involuntary context
  switch of its thread): only past :data:`VERY_SLOW_S`, since a thread would have been paused just
  the same;
- on the thread: only past :data:`VERY_SLOW_S` (250 ms), since its wall time includes the GIL
  waits. A lower bar kept every choice on the thread once one went there. A hung index is slower
  than that (the client times out after a second) and keeps them there.

An index that answers between 100 and 250 ms costs one inline stall per :data:`THREADED_AFTER_SLOW`
+ 1 choices. Reading the counter costs ~2 us, twice per inline choice.
"""

from __future__ import annotations

import asyncio
import resource
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
INLINE_MAX_S = 0.1
VERY_SLOW_S = 0.25
THREADED_AFTER_SLOW = 20
_RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)
"""Linux's per-thread counters (elsewhere every slow choice counts, as before)."""


def _preemptions() -> int:
    """Involuntary context switches of the calling thread so far (0 where not counted)."""
    return resource.getrusage(_RUSAGE_THREAD).ru_nivcsw if _RUSAGE_THREAD is not None else 0


class InlineGate:
    def __init__(self, max_s: float = INLINE_MAX_S, threaded_after_slow: int = THREADED_AFTER_SLOW,
                 very_slow_s: float = VERY_SLOW_S) -> None:
        self.max_s = max_s
        self.threaded_after_slow = threaded_after_slow
        self.very_slow_s = very_slow_s
        self._threaded = 0
        """Choices still to run on a thread."""
        self.ran = {"inline": 0, "thread": 0}
        """Choices run each way so far (the router's ``pof_router_choices_total{ran}``)."""

    async def run(self, fn: Callable[[], T]) -> T:
        if self._threaded > 0:
            self._threaded -= 1
            self.ran["thread"] += 1
            return await asyncio.to_thread(self._on_thread, fn)
        self.ran["inline"] += 1
        return self._inline(fn)

    def _inline(self, fn: Callable[[], T]) -> T:
        t0, paused = time.perf_counter(), _preemptions()
        try:
            return fn()
        finally:
            took = time.perf_counter() - t0
            if took > self.max_s and (took > self.very_slow_s or _preemptions() == paused):
                self._threaded = self.threaded_after_slow

    def _on_thread(self, fn: Callable[[], T]) -> T:
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            if time.perf_counter() - t0 > self.very_slow_s:
                self._threaded = self.threaded_after_slow
