from __future__ import annotations

from pof_connector.pool.staging import StagingPool


def test_buffers_are_reused_and_capped() -> None:
    pool = StagingPool(keep_bytes=3000)
    a = pool.take(1000)
    assert a.nbytes == 1000
    pool.give(a)
    b = pool.take(800)                       # the idle 1000-byte buffer serves a smaller request
    assert b.nbytes == 800 and b.base is a.base
    pool.give(b)
    pool.give(b)                             # giving twice keeps one copy
    assert pool.idle_bytes == 1000
    e = pool.take(1500)
    pool.give(e)                             # two idle buffers of different sizes
    assert pool.take(1200).base is e.base and pool.take(900).base is a.base
    pool.give(e)
    pool.give(a)
    c, d = pool.take(2500), pool.take(100)   # too big for the idle ones; the small one reuses one
    assert c.base is not a.base and d.base is a.base
    pool.give(c)
    pool.give(d)
    assert pool.idle_bytes <= 3000           # the cap drops the smallest buffer
