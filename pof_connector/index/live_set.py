"""The live incarnations a lookup counts, from the registry's reply (``TIME`` and the ``GET`` of
the leases, or ``ZRANGE live WITHSCORES``), parsed once per reply and reused while the reply repeats."""

from __future__ import annotations

from typing import Any

import numpy as np

Registry = bytes | list[Any] | None
"""A registry reply :meth:`LiveSet.of` takes: the leases' ``GET`` (``None``: no key), or ``ZRANGE live
WITHSCORES``'s."""
LEASE = np.dtype([("inc", "<u4"), ("expiry", "<f8")])
"""One entry of the leases (``lua/leases.lua``): incarnation, expiry in ms of the server's clock."""


class LiveSet:
    """The registry's reply changes with heartbeats (about once a second per node) while lookups
    come by the thousand: parsing 64 members and scores cost a lookup as much as decoding its runs,
    and filtering them by expiry a tenth of a lookup at 4 holders. So both are kept: the parse
    while the reply repeats, the answer until its first member's lease ends."""

    __slots__ = ("_answer", "_parsed")

    def __init__(self) -> None:
        self._parsed: tuple[Any, np.ndarray, np.ndarray] | None = None
        """(reply, incarnations sorted, their expiries in ms)."""
        self._answer: tuple[Any, int, int, np.ndarray] | None = None
        """(reply, from, until, live incarnations): the answer for a server time in [from, until)."""

    def of(self, now: list[bytes], live: Registry) -> np.ndarray:
        """The live incarnations at server time ``now`` (``TIME``'s reply) in ``live``: the leases
        (bytes; ``None``: no key, nobody registered), or ``ZRANGE live 0 -1 WITHSCORES``'s reply
        (RESP2 or RESP3); as a sorted uint32 array: not to be modified."""
        now_ms = int(now[0]) * 1000 + int(now[1]) // 1000
        answer = self._answer
        if answer is not None and answer[1] <= now_ms < answer[2] and answer[0] == live:
            return answer[3]
        parsed = self._parsed
        if parsed is None or parsed[0] != live:
            incs, expiry = _parse(live)
            order = np.argsort(incs, kind="stable")
            parsed = self._parsed = (live, incs[order], expiry[order])
        _, incs, expiry = parsed
        keep = (expiry > now_ms) & (incs > 0) & (incs < 1 << 32)
        mine = incs[keep]
        out = np.unique(mine).astype("<u4") if len(mine) and (np.diff(mine) == 0).any() else mine.astype("<u4")
        # A member whose expiry is later than now_ms by a fraction of a millisecond ends the reuse a
        # millisecond early: a recomputation, never a dead member counted.
        until = int(expiry[keep].min()) if len(mine) else now_ms + 1
        self._answer = (live, now_ms, until, out)
        return out


def _parse(live: Registry) -> tuple[np.ndarray, np.ndarray]:
    """(incarnations as int64, expiries in ms as float64) of a registry reply, in its order."""
    if live is None:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
    if isinstance(live, bytes):
        # Whole entries only: a value cut short (not the scripts' writing) loses its last entry, a
        # holder not counted (a miss), never one counted that is not in it.
        leases = np.frombuffer(live, dtype=LEASE, count=len(live) // LEASE.itemsize)
        return leases["inc"].astype(np.int64), leases["expiry"].astype(np.float64)
    pairs = live if live and isinstance(live[0], list) else list(zip(live[::2], live[1::2], strict=True))
    return (np.array([int(m) for m, _ in pairs], dtype=np.int64),
            np.array([float(sc) for _, sc in pairs], dtype=np.float64))
