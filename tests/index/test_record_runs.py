"""The decoders of a lookup's reply (:mod:`pof_connector.index.record_runs`): native and numpy give
the same runs, on replies a hostile writer may have shaped."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pof_connector.index import record_runs
from pof_connector.index.record_runs import RECORD, LeadingRuns, leading_runs

N_MEDIA = 6


def rec(inc: int, medium: int, slot: int, gen: int) -> bytes:
    r = np.zeros(1, dtype=RECORD)
    r["inc"], r["medium"], r["slot"], r["gen"] = inc, medium, slot, gen
    return r.tobytes()


def same(a: LeadingRuns, b: LeadingRuns) -> None:
    assert (a.held, a.malformed, a.unknown, a.heads) == (b.held, b.malformed, b.unknown, b.heads)
    for (ma, sa, ga), (mb, sb, gb) in zip(a.runs, b.runs, strict=True):
        assert ma.dtype == mb.dtype == np.uint8 and sa.dtype == sb.dtype == ga.dtype == gb.dtype == np.int64
        assert ma.tolist() == mb.tolist() and sa.tolist() == sb.tolist() and ga.tolist() == gb.tolist()


def both(vals: list[bytes | None], alive: list[int]) -> LeadingRuns:
    """The numpy decoder's answer, checked equal to the native one's where it was built."""
    want = leading_runs(vals, alive, N_MEDIA, native=False)
    if record_runs.NATIVE:
        same(leading_runs(vals, alive, N_MEDIA, native=True), want)
    return want


def test_the_native_decoder_is_built() -> None:
    """CI builds the package with its kernels (pip install -e .). Set POF_ALLOW_NO_NATIVE=1 where no
    compiler exists on purpose."""
    if os.environ.get("POF_ALLOW_NO_NATIVE") != "1":
        assert record_runs.NATIVE


def test_runs_by_hand() -> None:
    """Node 1 holds pages 0-3 (page 1 also in a faster medium), node 2 pages 0-1 then a hole, node
    3 is not live, node 4 holds page 1 only (no run), and page 4 is held by nobody."""
    vals: list[bytes | None] = [
        rec(1, 1, 10, 7) + rec(2, 0, 20, 8) + rec(3, 0, 30, 9),
        rec(4, 0, 40, 1) + rec(1, 1, 11, 7) + rec(2, 0, 21, 8) + rec(1, 0, 99, 5),
        rec(1, 1, 12, 7) + rec(3, 0, 31, 9),
        rec(1, 1, 13, 2**64 - 1) + rec(2, 0, 23, 8),
        None,
        rec(1, 1, 14, 7),
    ]
    got = both(vals, [1, 2, 4])
    assert (got.held, got.malformed, got.unknown, got.heads) == (4, False, 0, [1, 2])
    media, slots, gens = got.runs[0]
    assert media.tolist() == [1, 0, 1, 1] and slots.tolist() == [10, 99, 12, 13]
    assert gens.tolist() == [7, 5, 7, -1]            # generations are int64 bit patterns
    assert got.runs[1][1].tolist() == [20, 21]


def test_malformed_and_unknown_records_are_counted() -> None:
    good = rec(1, 0, 1, 1)
    for bad in (b"", good[:-1], good + b"\x00"):
        got = both([good, good, bad, good], [1])
        assert (got.held, got.malformed, got.heads) == (2, True, [1])
        assert got.runs[0][1].tolist() == [1, 1]
    got = both([bad, good], [1])
    assert (got.held, got.malformed, got.heads, got.runs) == (0, True, [], [])
    # An unknown medium is an absent page, counted; a live set holding 0 or huge numbers is harmless.
    got = both([good + rec(2, 200, 5, 5), rec(1, 250, 2, 2) + rec(2, 0, 6, 6), good], [0, 1, 2, 2**40, -3])
    assert (got.held, got.unknown, got.heads) == (3, 2, [1])
    assert got.runs[0][1].tolist() == [1]
    assert both([], [1]).held == 0 and both([None, good], [1]).heads == []


records = st.builds(rec, st.integers(1, 6), st.integers(0, N_MEDIA + 1), st.integers(0, 2**32 - 1),
                    st.integers(0, 2**64 - 1))
values = st.one_of(st.none(), st.lists(records, min_size=0, max_size=6).map(b"".join),
                   st.binary(min_size=0, max_size=40))


@settings(max_examples=300, deadline=None)
@given(vals=st.lists(values, max_size=12), alive=st.lists(st.integers(0, 7), max_size=6))
def test_the_decoders_agree(vals: list[bytes | None], alive: list[int]) -> None:
    """Random replies, hostile values among them (any bytes, empty, records of unknown media)."""
    if not record_runs.NATIVE:
        pytest.skip("pof_connector._prefix_runs was not built")
    got = both(vals, alive)
    for media, _, _ in got.runs:
        assert len(media) <= got.held and (media < N_MEDIA).all()
