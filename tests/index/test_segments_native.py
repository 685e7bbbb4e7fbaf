"""The native decoder of a segment lookup's reply (``_prefix_runs.segment_runs``) gives what the numpy
one (:meth:`SegmentQuery.decode` with ``native=False``) gives, on replies a hostile writer may have
shaped."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pof_connector.index import segments
from pof_connector.index.segments import SEGMENT_RECORD, SegmentAnswer, SegmentQuery

N_MEDIA = 6
SEG = 16
INCS = (1, 2, 3, 7)
NATIVE = segments._native() is not None
native_only = pytest.mark.skipif(not NATIVE, reason="pof_connector._prefix_runs was not built with segment_runs")


def seg_rec(offset: int, tag: int, inc: int, medium: int, slot: int, gen: int) -> bytes:
    r = np.zeros(1, dtype=SEGMENT_RECORD)
    r["offset"], r["tag"], r["inc"], r["medium"], r["slot"], r["gen"] = offset, tag, inc, medium, slot, gen
    return r.tobytes()


def query(first: list[int], tags: list[int]) -> SegmentQuery:
    return SegmentQuery(fields=np.zeros((len(first), 16), np.uint8), first_page=np.array(first, np.int64),
                        tags=np.array(tags, np.uint64))


def same(a: SegmentAnswer, b: SegmentAnswer) -> None:
    ra, rb = a.runs, b.runs
    assert (ra.held, ra.malformed, ra.unknown, ra.heads) == (rb.held, rb.malformed, rb.unknown, rb.heads)
    assert len(ra.runs) == len(rb.runs)
    for (ma, sa, ga), (mb, sb, gb) in zip(ra.runs, rb.runs, strict=True):
        assert ma.dtype == mb.dtype == np.uint8 and sa.dtype == sb.dtype == ga.dtype == gb.dtype == np.int64
        assert np.array_equal(ma, mb) and np.array_equal(sa, sb) and np.array_equal(ga, gb)
    assert np.array_equal(np.asarray(a.marked, dtype=np.int64), np.asarray(b.marked, dtype=np.int64))


def both(q: SegmentQuery, vals: list[Any], alive: list[int]) -> SegmentAnswer:
    """The numpy decoder's answer, checked equal to the native one's where it was built."""
    want = q.decode(vals, alive, N_MEDIA, native=False)
    if NATIVE:
        same(q.decode(vals, alive, N_MEDIA, native=True), want)
    return want


def test_the_native_segment_decoder_is_built() -> None:
    """CI builds the package with its kernels (pip install -e .). Set POF_ALLOW_NO_NATIVE=1 where no
    compiler exists on purpose."""
    if os.environ.get("POF_ALLOW_NO_NATIVE") != "1":
        assert NATIVE


def hand_reply() -> tuple[SegmentQuery, list[Any]]:
    """Segment 0 starts 4 pages before the query (pages 0-11 at offsets 4-15), segment 1 at page 12.
    Node 1 holds pages 0-2 (page 1 also in medium 0, twice: the first one counts; page 3 only in an
    unknown medium), node 2 page 0 (its page 1 is another chain's: wrong tag), node 3 (not live) pages
    0-11, and an offset-16 record of node 1 would be page 12 if offsets past the segment counted."""
    tags = [1000 + p for p in range(30)]
    t = tags.__getitem__
    seg0 = b"".join([
        seg_rec(3, 999, 1, 0, 1, 1),                    # page -1: before the query
        seg_rec(5, t(1), 1, 1, 11, 6),
        seg_rec(4, t(0), 2, 0, 20, 8),
        seg_rec(5, t(1) + 1, 2, 0, 21, 8),              # another chain's page 1
        *[seg_rec(4 + p, t(p), 3, 0, 30 + p, 9) for p in range(12)],
        seg_rec(6, t(2), 1, 1, 12, 2**64 - 1),
        seg_rec(5, t(1), 1, 0, 99, 7),                  # page 1 in a faster medium
        seg_rec(5, t(1), 1, 0, 98, 7),                  # ... again: the first one wins
        seg_rec(9, 0, 0, 0, 0, 0),                      # marker at page 5
        seg_rec(7, t(3), 1, N_MEDIA, 13, 1),            # unknown medium
        seg_rec(4, t(0), 1, 1, 10, 5),
        seg_rec(16, t(12), 1, 0, 50, 5),                # offset past the segment
    ])
    seg1 = seg_rec(1, t(13), 1, 0, 60, 5) + seg_rec(2, 0, 0, 0, 0, 0)
    return query([-4, 12], tags), [seg0, seg1]


def test_segment_runs_by_hand() -> None:
    q, vals = hand_reply()
    got = both(q, vals, [1, 2])
    r = got.runs
    assert (r.held, r.malformed, r.unknown, r.heads) == (12, False, 1, [1, 2])
    media, slots, gens = r.runs[0]
    assert media.tolist() == [1, 0, 1] and slots.tolist() == [10, 99, 12] and gens.tolist() == [5, 7, -1]
    assert [a.tolist() for a in r.runs[1]] == [[0], [20], [8]]
    assert got.marked.tolist() == [5, 14]
    # A malformed segment 1 ends every run at its first page (and its marker is not read).
    for bad in (b"", vals[1][:-1], vals[1] + b"\x00"):
        got = both(q, [vals[0], bad], [1, 2])
        assert (got.runs.held, got.runs.malformed, got.runs.heads) == (12, True, [1, 2])
        assert got.marked.tolist() == [5]
    # Malformed from the start: nothing is held, the markers are not read.
    got = both(q, [b"\x01" * 25, vals[1]], [1, 2, 3])
    assert (got.runs.held, got.runs.malformed, got.runs.heads, got.marked.tolist()) == (0, True, [], [])
    # Fewer values than segments: the missing ones hold nothing.
    got = both(q, [vals[0]], [3])
    assert (got.runs.held, got.runs.heads, got.marked.tolist()) == (12, [3], [5])
    assert got.runs.runs[0][1].tolist() == list(range(30, 42))


@native_only
def test_segment_runs_rejects_bad_arguments() -> None:
    nat = segments._native()
    q, vals = hand_reply()
    fp, tg, live = q.first_page.tobytes(), q.tags.tobytes(), np.array([1], "<u4").tobytes()
    for args in (([*vals, None], fp, tg, live, N_MEDIA, SEG),             # more values than segments
                 (vals, fp[:-1], tg, live, N_MEDIA, SEG), (vals, fp, tg[:-1], live, N_MEDIA, SEG),
                 (vals, fp, tg, live[:-1], N_MEDIA, SEG), (vals, fp, tg, live, 256, SEG),
                 (vals, fp, tg, live, -1, SEG), (vals, fp, tg, live, N_MEDIA, 0),
                 (vals, fp, tg, live, N_MEDIA, 257)):
        with pytest.raises(ValueError):
            nat.segment_runs(*args)
    # Anything but bytes or None is a malformed value.
    held, malformed, *_ = nat.segment_runs([vals[0], 7], fp, tg, live, N_MEDIA, SEG)
    assert (held, malformed) == (12, 1)


@st.composite
def replies(draw: st.DrawFn) -> tuple[SegmentQuery, list[Any], list[int]]:
    """A query of 1-80 pages starting anywhere in its first segment, and a reply: a few holders' runs
    of query pages (some from page 0, some with holes or a page in two media), stray records (offsets
    past the segment or the query, other chains' tags, markers, unknown media), each segment's
    records shuffled; a segment's value may also be None or malformed (empty, cut or padded).
    Hypothesis draws the shape; the records' fields come from a seeded generator (drawing each one
    made 300 examples take 40 s). Pages are assigned to segments as the query would, so segments
    that overlap (now and then) hold some pages at other offsets."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(1, 80))
    o0 = draw(st.integers(0, SEG - 1))
    first = [-o0, *range(SEG - o0, n, SEG)]
    if draw(st.integers(0, 4)) == 0:        # segments that overlap or leave gaps: no query builds them,
        first = [f + draw(st.integers(-4, 4)) for f in first]     # but both decoders must agree on them
    tags = rng.integers(0, 2**64, size=n, dtype=np.uint64)
    pages: list[int] = []
    incs: list[int] = []
    for inc, start, end in draw(st.lists(st.tuples(st.sampled_from(INCS), st.integers(0, 3) | st.just(0),
                                                   st.integers(0, n) | st.just(n)), min_size=1, max_size=5)):
        held = [p for p in range(start, end) if rng.random() >= 0.03]       # now and then a hole
        held += [p for p in held if rng.random() < 0.1]                     # a page in a second medium
        pages += held
        incs += [inc] * len(held)
    strays = draw(st.integers(0, 3 * len(first)))
    seg = np.concatenate([(np.array(pages, np.int64) + o0) // SEG, rng.integers(0, len(first), strays)])
    recs = np.zeros(len(seg), dtype=SEGMENT_RECORD)
    recs["offset"] = np.concatenate([(np.array(pages, np.int64) + o0) % SEG, rng.integers(0, 21, strays)])
    recs["inc"] = incs + rng.choice((0, *INCS), strays).tolist()
    page = np.array(first, np.int64)[seg] + recs["offset"]
    inside = (page >= 0) & (page < n)
    wrong = rng.random(len(recs)) < np.where(np.arange(len(recs)) < len(pages), 0.01, 0.25)
    recs["tag"] = np.where(inside & ~wrong, tags[np.clip(page, 0, n - 1)],
                           rng.integers(0, 2**64, size=len(recs), dtype=np.uint64))
    recs["medium"] = np.where(rng.random(len(recs)) < 0.6, 0, rng.integers(0, 8, len(recs)))
    recs["slot"] = rng.integers(0, 2**32, size=len(recs), dtype=np.uint32)
    gens = np.array([0, 1, 2**63 - 1, 2**63, 2**64 - 1], dtype=np.uint64)
    recs["gen"] = np.where(rng.random(len(recs)) < 0.3, rng.choice(gens, len(recs)),
                           rng.integers(0, 2**64, size=len(recs), dtype=np.uint64))
    vals: list[Any] = []
    for s in range(len(first)):
        mine = recs[seg == s]
        value = mine[rng.permutation(len(mine))].tobytes()
        kind = draw(st.sampled_from(["records"] * 8 + ["none", "malformed"]))
        if kind == "malformed":
            cut = draw(st.integers(-5, 5))
            value = b"" if cut == 0 else value[:cut] if cut < 0 else value + b"\x00" * cut
        vals.append(None if kind == "none" or not value else value)
    if draw(st.integers(0, 4)) == 0:
        vals = vals[:draw(st.integers(0, len(first)))]
    alive = draw(st.lists(st.sampled_from(INCS), unique=True) | st.just(list(INCS)))
    return query(first, tags.tolist()), vals, alive


@native_only
@settings(max_examples=300, deadline=None)
@given(reply=replies())
def test_the_segment_decoders_agree(reply: tuple[SegmentQuery, list[Any], list[int]]) -> None:
    q, vals, alive = reply
    got = both(q, vals, alive)
    for media, _, _ in got.runs.runs:
        assert 0 < len(media) <= got.runs.held and (media < N_MEDIA).all()
