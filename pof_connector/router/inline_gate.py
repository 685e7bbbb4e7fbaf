"""Whether `pof router` runs its routing choice (the index lookup in it) on the event loop.

The choice blocks on the locality index: a thread keeps a slow or hung index from stalling every
other request, but the hop to it and back costs ~0.1 ms per request, and more under concurrency
(the GIL passed back and forth), while a healthy index answers in well under that. So the choice
runs inline while choices are fast, and on a thread for the next :data:`THREADED_AFTER_SLOW`
choices after one that took over :data:`INLINE_MAX_S`: a hung index stalls the loop once, for at
most the index client's timeout, not per request (every slow choice on the thread starts the count
again, so a slow index keeps them there).

A slow choice during which the host took the CPU away from the router (an involuntary context
switch of the thread that ran it: two vLLM servers beside the router on a 2-core box, issue 42)
counts as slow only past :data:`PAUSED_MAX_S`: a thread would have been paused just the same, and
the choices after it would each have paid the hop for nothing (at the old count of 200, 43% of the
bench's choices ran on a thread: 0.12 ms each against 0.04 inline, besides the lookup; at load 19
with the count of 20, 88% did, 54% with this rule, and the token-id requests' choose stage p50 went
0.14 -> 0.09 ms). A hung index is slower than that; a thread waiting on the index switches
voluntarily. Reading the counter costs ~2 us, twice per choice. A host slow to wake the router when
the index has answered still counts as a slow index (no counter tells that wait from the index's).
"""

from __future__ import annotations

import asyncio
import resource
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
INLINE_MAX_S = 0.002
PAUSED_MAX_S = 0.02
THREADED_AFTER_SLOW = 20
_RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)
"""Linux's per-thread counters (elsewhere every slow choice counts, as before)."""


def _preemptions() -> int:
    """Involuntary context switches of the calling thread so far (0 where not counted)."""
    return resource.getrusage(_RUSAGE_THREAD).ru_nivcsw if _RUSAGE_THREAD is not None else 0


class InlineGate:
    def __init__(self, max_s: float = INLINE_MAX_S, threaded_after_slow: int = THREADED_AFTER_SLOW,
                 paused_max_s: float = PAUSED_MAX_S) -> None:
        self.max_s = max_s
        self.threaded_after_slow = threaded_after_slow
        self.paused_max_s = paused_max_s
        self._threaded = 0
        """Choices still to run on a thread."""

    async def run(self, fn: Callable[[], T]) -> T:
        if self._threaded > 0:
            self._threaded -= 1
            return await asyncio.to_thread(self._timed, fn)
        return self._timed(fn)

    def _timed(self, fn: Callable[[], T]) -> T:
        t0, paused = time.perf_counter(), _preemptions()
        try:
            return fn()
        finally:
            took = time.perf_counter() - t0
            if took > self.max_s and (took > self.paused_max_s or _preemptions() == paused):
                self._threaded = self.threaded_after_slow
