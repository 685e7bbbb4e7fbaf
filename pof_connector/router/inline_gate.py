"""Whether `pof router` runs its routing choice (the index lookup in it) on the event loop.

The choice blocks on the locality index: a thread keeps a slow or hung index from stalling every
other request, but the hop to it and back costs ~0.1 ms per request, and more under concurrency
(the GIL passed back and forth), while a healthy index answers in well under that. So the choice
runs inline while choices are fast, and on a thread for the next :data:`THREADED_AFTER_SLOW`
choices after one that took over :data:`INLINE_MAX_S`: a hung index stalls the loop once, for at
most the index client's timeout, not per request (every slow choice on the thread starts the count
again, so a slow index keeps them there).

Why only 20: most slow choices on a busy host are not the index but the host pausing the router
for a few milliseconds (two vLLM servers beside it on a 2-core box, issue 42), and each of the
choices that follow pays the thread hop for nothing: at 200, 43% of the bench's choices ran on a
thread (0.12 ms each against 0.04 inline, besides the lookup).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
INLINE_MAX_S = 0.002
THREADED_AFTER_SLOW = 20


class InlineGate:
    def __init__(self, max_s: float = INLINE_MAX_S, threaded_after_slow: int = THREADED_AFTER_SLOW) -> None:
        self.max_s = max_s
        self.threaded_after_slow = threaded_after_slow
        self._threaded = 0
        """Choices still to run on a thread."""

    async def run(self, fn: Callable[[], T]) -> T:
        if self._threaded > 0:
            self._threaded -= 1
            return await asyncio.to_thread(self._timed, fn)
        return self._timed(fn)

    def _timed(self, fn: Callable[[], T]) -> T:
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            if time.perf_counter() - t0 > self.max_s:
                self._threaded = self.threaded_after_slow
