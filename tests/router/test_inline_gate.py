"""The routing choice runs on the event loop while it is fast, on a thread for a while after a slow one;
on the thread only a much slower one keeps the next there."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pof_connector.router.inline_gate import InlineGate


def test_fast_choices_inline_slow_one_moves_the_next_to_a_thread() -> None:
    gate = InlineGate(max_s=0.01, threaded_after_slow=3)
    loop_thread = threading.get_ident()

    async def main() -> list[bool]:
        where = []
        for slow in (False, True, False, False, False, False):
            def fn(slow: bool = slow) -> int:
                if slow:
                    time.sleep(0.02)
                return threading.get_ident()
            where.append(await gate.run(fn) == loop_thread)
        return where

    # fast: inline; the slow one still inline (it was not known slow); then 3 on a thread; inline again
    assert asyncio.run(main()) == [True, True, False, False, False, True]
    assert gate.ran == {"inline": 3, "thread": 3}


def test_on_the_thread_only_a_choice_past_very_slow_s_keeps_the_next_there() -> None:
    """A thread's choice waits for the GIL behind a busy event loop: slower than max_s there says
    nothing about the index, and must not keep every later choice on the thread (issue 42)."""
    gate = InlineGate(max_s=0.005, threaded_after_slow=2, very_slow_s=0.05)
    loop_thread = threading.get_ident()

    async def main() -> list[bool]:
        where = []
        for sleep_s in (0.01, 0.02, 0.0, 0.0, 0.01, 0.06, 0.0, 0.0, 0.0):
            def fn(sleep_s: float = sleep_s) -> int:
                time.sleep(sleep_s)
                return threading.get_ident()
            where.append(await gate.run(fn) == loop_thread)
        return where

    # 10 ms inline: the next 2 on the thread; there 20 ms (under very_slow_s) does not restart the
    # count, so the 4th runs inline; 10 ms inline again sends 2 to the thread, where 60 ms restarts it
    assert asyncio.run(main()) == [True, False, False, True, True, False, False, False, True]


def test_a_raising_choice_raises_through_the_gate() -> None:
    gate = InlineGate()

    def fn() -> int:
        raise LookupError("no backend")

    async def main() -> None:
        await gate.run(fn)

    try:
        asyncio.run(main())
    except LookupError as e:
        assert str(e) == "no backend"
    else:
        raise AssertionError("not raised")


def test_a_choice_the_host_paused_keeps_the_next_inline_unless_very_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    from pof_connector.router import inline_gate

    switches = iter(range(0, 1000, 1))          # every reading one more: the host preempted each choice
    monkeypatch.setattr(inline_gate, "_preemptions", lambda: next(switches))
    gate = InlineGate(max_s=0.002, threaded_after_slow=3, very_slow_s=0.05)
    loop_thread = threading.get_ident()

    async def main() -> list[bool]:
        where = []
        for sleep_s in (0.01, 0.0, 0.06, 0.0):
            def fn(sleep_s: float = sleep_s) -> int:
                time.sleep(sleep_s)
                return threading.get_ident()
            where.append(await gate.run(fn) == loop_thread)
        return where

    # 10 ms, paused: inline after it; 60 ms, paused but past very_slow_s: the next on a thread
    assert asyncio.run(main()) == [True, True, True, False]
