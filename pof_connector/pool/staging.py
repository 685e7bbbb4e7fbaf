"""Reusable host staging buffers.

A fresh 100 MB ``numpy`` buffer costs more than the copy into it: every 4 KiB page faults and is
zeroed by the kernel on first touch (measured here: a 96 MB layer-wise load took 238 ms into new
buffers, 72 ms into reused ones). Adapters take buffers for a load or a save and give them back
when the pool is done with them. (The fabric's NIXL-registered staging that remote pages land in
is :mod:`pof_connector.fabric.registered_staging`.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np


class StagingPool:
    """Keeps up to ``keep_bytes`` of idle buffers; thread-safe (stores finish on the pool's thread)."""

    def __init__(self, keep_bytes: int = 1 << 30, allocate: Callable[[int], np.ndarray] | None = None) -> None:
        """``allocate``: makes a new uint8 buffer of the given size (page-locked memory, for
        device-to-host copies that do not wait); ``None``: plain ``numpy``."""
        self.keep_bytes = keep_bytes
        self._allocate = allocate
        self._idle: list[np.ndarray] = []
        self._lock = threading.Lock()

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._idle)

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of exactly ``nbytes`` (a view of the smallest idle buffer that fits)."""
        with self._lock:
            for i, b in enumerate(self._idle):       # sorted by size: the first fit is the smallest
                if b.nbytes >= nbytes:
                    return self._idle.pop(i)[:nbytes]   # by position: `remove` would compare arrays
        return (np.empty(nbytes, dtype=np.uint8) if self._allocate is None else self._allocate(nbytes))[:nbytes]

    def give(self, buf: np.ndarray) -> None:
        """Return a buffer from :meth:`take` once nothing reads or writes it any more."""
        base = buf.base if isinstance(buf.base, np.ndarray) else buf
        with self._lock:
            if any(b is base for b in self._idle):
                return
            self._idle.append(base)
            self._idle.sort(key=lambda b: b.nbytes)
            while sum(b.nbytes for b in self._idle) > self.keep_bytes:
                self._idle.pop(0)        # the smallest: big prompts are what the reuse is for
