"""The live incarnations a lookup counts, from the registry's reply (``TIME`` and ``ZRANGE live
WITHSCORES``), parsed once per reply and reused while the reply repeats."""

from __future__ import annotations

from typing import Any

import numpy as np


class LiveSet:
    """The registry's reply changes with heartbeats (about once a second per node) while lookups
    come by the thousand: parsing 64 members and scores cost a lookup as much as decoding its runs,
    and filtering them by expiry a tenth of a lookup at 4 holders. So both are kept: the parse
    while the reply repeats, the answer until its first member's lease ends."""

    __slots__ = ("_answer", "_parsed")

    def __init__(self) -> None:
        self._parsed: tuple[list[Any], np.ndarray, np.ndarray] | None = None
        """(reply, incarnations sorted, their expiries in ms)."""
        self._answer: tuple[list[Any], int, int, np.ndarray] | None = None
        """(reply, from, until, live incarnations): the answer for a server time in [from, until)."""

    def of(self, now: list[bytes], live: list[Any]) -> np.ndarray:
        """The live incarnations at server time ``now`` (``TIME``'s reply) in ``live`` (``ZRANGE
        live 0 -1 WITHSCORES``'s, RESP2 or RESP3), as a sorted uint32 array: not to be modified."""
        now_ms = int(now[0]) * 1000 + int(now[1]) // 1000
        answer = self._answer
        if answer is not None and answer[1] <= now_ms < answer[2] and answer[0] == live:
            return answer[3]
        parsed = self._parsed
        if parsed is None or parsed[0] != live:
            pairs = live if live and isinstance(live[0], list) else list(zip(live[::2], live[1::2], strict=True))
            incs = np.array([int(m) for m, _ in pairs], dtype=np.int64)
            expiry = np.array([float(sc) for _, sc in pairs], dtype=np.float64)
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
