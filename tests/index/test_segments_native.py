"""The native decoder of a summary lookup's reply (``_prefix_runs.summary_runs``) gives what the Python
one (:meth:`SegmentQuery.decode` with ``native=False``) gives, on replies a hostile writer may have
shaped."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pof_connector.index import base, record_runs, segments
from pof_connector.index.base import Matches, PrefixMatch
from pof_connector.index.segments import SegmentAnswer, SegmentQuery
from pof_connector.index.summary import Summary, encode_summary, record_slots

N_MEDIA = 6
SEG = 16
INCS = (1, 2, 3, 7)
NATIVE = segments._native() is not None
native_only = pytest.mark.skipif(not NATIVE, reason="pof_connector._prefix_runs was not built with summary_runs")


def query(first: list[int], tags: list[int]) -> SegmentQuery:
    return SegmentQuery(fields=np.zeros((len(first), 16), np.uint8), first_page=np.array(first, np.int64),
                        tags=np.array(tags, np.uint64))


def same(a: SegmentAnswer, b: SegmentAnswer) -> None:
    assert (a.held, a.malformed, a.unknown, a.heads) == (b.held, b.malformed, b.unknown, b.heads)
    assert [a.media_of(h).tolist() for h in range(len(a.heads))] == [
        b.media_of(h).tolist() for h in range(len(b.heads))]
    for x, y in ((a.media.pages, b.media.pages), (a.media.offsets, b.media.offsets), (a.media.starts, b.media.starts),
                 (a.media.codes, b.media.codes)):
        assert x.tolist() == y.tolist()
    assert np.array_equal(a.layers, b.layers)
    assert np.array_equal(np.asarray(a.marked, dtype=np.int64), np.asarray(b.marked, dtype=np.int64))


def both(q: SegmentQuery, vals: list[Any], alive: list[int]) -> SegmentAnswer:
    """The Python decoder's answer, checked equal to the native one's where it was built."""
    want = q.decode(vals, alive, N_MEDIA, native=False)
    if NATIVE:
        same(q.decode(vals, alive, N_MEDIA, native=True), want)
    return want


def test_the_native_segment_decoder_is_built() -> None:
    """CI builds the package with its kernels (pip install -e .). Set POF_ALLOW_NO_NATIVE=1 where no
    compiler exists on purpose."""
    if os.environ.get("POF_ALLOW_NO_NATIVE") != "1":
        assert NATIVE


def hand_reply() -> tuple[SegmentQuery, list[bytes]]:
    """A 28-page query starting at offset 4 of its first segment: pages 0-11 there, 12-27 in the next.
    Holder 1 holds pages 0-2 (page 1 also in medium 0: the lower code wins), holder 2 page 0 only,
    holder 3 pages 0-11 in layer 1 of offsets where layer 0 is another chain's; offset 9 (page 5) and
    page 14 are marked; holder 1 has page 3 in medium 7 (unknown)."""
    tags = [1000 + i for i in range(28)]
    q = query([-4, 12], tags)
    t0 = {16 + o: tags[o - 4] for o in range(4, 16)} | {o: 5 for o in range(4, 16)}
    s0 = Summary(1 << 9, 2, t0, [
        (1, 1, [0, 0b111 << 4]), (1, 0, [0, 1 << 5]), (2, 0, [0, 1 << 4]), (3, 0, [0, 0xFFF0]),
        (1, 7, [0, 1 << 7]), (9, 0, [0xFFFF, 0])])
    s1 = Summary(1 << 2, 1, {o: tags[12 + o] for o in range(16)}, [(3, 0, [0xFFFF])])
    return q, [encode_summary(s0), encode_summary(s1)]


def test_summary_runs_by_hand() -> None:
    q, vals = hand_reply()
    got = both(q, vals, [1, 2, 3])
    assert (got.held, got.malformed, got.unknown, got.heads) == (28, False, 1, [1, 2, 3])
    assert [got.media_of(h).tolist() for h in range(3)] == [[1, 0, 1], [0], [0] * 28]
    assert got.layers.tolist() == [1] * 12 + [0] * 16 and got.marked.tolist() == [5, 14]
    # A malformed segment 1 ends every run at its first page (and its mark is not read).
    for bad in (b"", vals[1][:-1], vals[1] + b"\x00"):
        got = both(q, [vals[0], bad], [1, 2, 3])
        assert (got.held, got.malformed, got.heads) == (12, True, [1, 2, 3]) and got.marked.tolist() == [5]
    # Malformed from the start: nothing is held, the marks are not read.
    got = both(q, [b"\x01" * 25, vals[1]], [1, 2, 3])
    assert (got.held, got.malformed, got.heads, got.marked.tolist()) == (0, True, [], [])
    # Fewer values than segments: the missing ones hold nothing. A dead holder is no head.
    got = both(q, [vals[0]], [3])
    assert (got.held, got.heads, got.media.pages.tolist()) == (12, [3], [12])


@native_only
def test_summary_runs_rejects_bad_arguments() -> None:
    nat = segments._native()
    q, vals = hand_reply()
    fp, tg, live = q.first_page.tobytes(), q.tags.tobytes(), np.array([1], "<u4").tobytes()
    for args in (([*vals, None, None], fp, tg, live, N_MEDIA, SEG),       # more values than segments
                 (vals, fp[:-1], tg, live, N_MEDIA, SEG), (vals, fp, tg[:-1], live, N_MEDIA, SEG),
                 (vals, fp, tg, live[:-1], N_MEDIA, SEG), (vals, fp, tg, live, 256, SEG),
                 (vals, fp, tg, live, -1, SEG), (vals, fp, tg, live, N_MEDIA, 0),
                 (vals, fp, tg, live, N_MEDIA, 17)):
        with pytest.raises(ValueError):
            nat.summary_runs(*args)
    # Anything but bytes or None is a malformed value.
    held, malformed, *_ = nat.summary_runs([vals[0], 7], fp, tg, live, N_MEDIA, SEG)
    assert (held, malformed) == (12, 1)


@st.composite
def replies(draw: st.DrawFn) -> tuple[SegmentQuery, list[Any], list[int]]:
    """A query of 1-80 pages starting anywhere in its first segment, and a reply: per segment a
    summary whose layers hold the query's tag or another chain's at random offsets, holders (live,
    dead, unknown media) with random masks, marks; a value may also be None or malformed (cut or
    padded, too many layers). Hypothesis draws the shape, a seeded generator the bits."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(1, 80))
    o0 = draw(st.integers(0, SEG - 1))
    first = [-o0, *range(SEG - o0, n, SEG)]
    tags = rng.integers(0, 2**64, size=n, dtype=np.uint64)
    vals: list[Any] = []
    for fp in first:
        layers = int(rng.integers(0, 5))
        tg: dict[int, int] = {}
        for lay in range(layers):
            for o in range(SEG):
                r, q = rng.random(), fp + o
                if r < 0.5 and 0 <= q < n and not any(tg.get(x * 16 + o) == int(tags[q]) for x in range(lay)):
                    tg[lay * 16 + o] = int(tags[q])
                elif r < 0.8:
                    tg[lay * 16 + o] = int(rng.integers(0, 2**63))
        holders = []
        for _ in range(int(rng.integers(0, 7)) if layers else 0):
            full = rng.random() < 0.5
            masks = [0xFFFF if full else int(rng.integers(0, 1 << 16)) for _ in range(layers)]
            holders.append((int(rng.choice((*INCS, 9))), int(rng.choice([0, 0, 1, 2, 7])), masks))
        value = encode_summary(Summary(int(rng.integers(0, 1 << 16)) if rng.random() < 0.3 else 0, layers, tg,
                                       holders))
        kind = draw(st.sampled_from(["summary"] * 8 + ["none", "malformed"]))
        if kind == "malformed":
            cut = draw(st.integers(-5, 5))
            value = b"\x00\x00\x05" if cut == 0 else value[:cut] if cut < 0 else value + b"\x00" * cut
        vals.append(None if kind == "none" else value)
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
    for h in range(len(got.heads)):
        media = got.media_of(h)
        assert 0 < len(media) == got.media.pages[h] <= got.held and (media < N_MEDIA).all()


@native_only
def test_overlapping_segments_mark_each_page_once() -> None:
    """Segments whose first pages a caller made overlap (the plans never do) name each marked page
    once, ascending: the marked buffer is as long as its pages, with nothing left unwritten."""
    nat = segments._native()
    rng = np.random.default_rng(3)
    n = 40
    tags = rng.integers(0, 2**64, size=n, dtype=np.uint64)
    first = [0, 4, 4, 20]
    vals = [encode_summary(Summary(0xFFFF, 1, {o: int(tags[fp + o]) for o in range(SEG) if fp + o < n},
                                   [(1, 0, [0xFFFF])])) for fp in first]
    *_, marked = nat.summary_runs(vals, np.array(first, np.int64), tags, np.array([1], "<u4"), N_MEDIA, SEG)
    assert np.frombuffer(marked, np.int64).tolist() == list(range(36))


@native_only
def test_the_record_readers_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """A holder's records (groups per medium and layer, some cut short or absent) give the same slots
    natively and in Python, and only for pages whose generation is not known yet."""
    rng = np.random.default_rng(5)
    for _ in range(200):
        n, base = int(rng.integers(1, 60)), -int(rng.integers(0, 16))
        media = rng.choice([0, 1, 2], n).astype(np.uint8)
        layers = rng.choice([0, 1, 255], n).astype(np.uint8)
        segs = np.arange((n - base + 15) // 16, dtype=np.int64)
        vals: list[bytes | None] = []
        for _s in segs:
            v = b""
            for md in (0, 1, 2):
                for la in (0, 1):
                    mask = int(rng.integers(0, 1 << 16))
                    recs = rng.integers(0, 1 << 30, size=(bin(mask).count("1"), 3))
                    v += bytes([md, la]) + mask.to_bytes(2, "little") + b"".join(
                        int(a).to_bytes(4, "little") + int(b).to_bytes(8, "little") for a, b, _ in recs)
            cut = int(rng.integers(-30, 1)) if rng.random() < 0.2 else 0
            vals.append(None if rng.random() < 0.1 else v[:len(v) + cut])
        known = np.where(rng.random(n) < 0.2, 7, -1)
        got = []
        for native in (True, False):
            if not native:
                monkeypatch.setattr(record_runs, "_native", None)
            slots, gens = np.full(n, -1, np.int64), known.astype(np.int64)
            record_slots(vals, segs, base, media, layers, slots, gens)
            got.append((slots.tolist(), gens.tolist()))
            monkeypatch.undo()
        assert got[0] == got[1]
        assert all(g == 7 for g, k in zip(got[0][1], known.tolist(), strict=True) if k == 7)


class _Source:
    def media_of(self, key: int) -> np.ndarray:
        return np.full(key + 1, key, np.uint8)

    def resolve(self, key: int, pages: int, media: np.ndarray, slots: np.ndarray,
                gens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.arange(pages, dtype=np.int64), np.full(pages, key, np.int64)


@native_only
def test_matches_from_a_source_natively_and_in_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PrefixMatch.from_source`` makes the same matches with the native ``slot_objects`` as without
    (enough of them that the native call is made); a node without a name is left out."""
    nodes = [None if i == 1 else f"n{i}" for i in range(10)]
    assert len(nodes) >= base._NATIVE_FROM
    got = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(record_runs, "_native", None)
        m = PrefixMatch.from_source(nodes, [i + 1 for i in range(10)], _Source(), held=7)
        assert isinstance(m, Matches) and m.held == 7
        got.append({node: (x.node, x.pages, x.media.tolist(), x.resolve(2), x.slots.tolist(), x.generations.tolist())
                    for node, x in m.items()})
    assert got[0] == got[1] == {f"n{i}": (f"n{i}", i + 1, [i] * (i + 1), min(2, i + 1), list(range(i + 1)),
                                          [i] * (i + 1)) for i in range(10) if i != 1}


@native_only
def test_slot_objects_sets_only_writable_slots() -> None:
    nat = segments._native()
    for names in (("nodex",), ("pages",), ("__dict__",), ("node", "node")):
        with pytest.raises((TypeError, AttributeError)):
            nat.slot_objects(PrefixMatch, names, tuple([["x"]] * len(names)))
    for cls, names, values in ((PrefixMatch, ("node", "_key"), (["a"], [1, 2])), (PrefixMatch, ("node",), ("a",)),
                               (int, ("real",), ([1],))):
        with pytest.raises(ValueError):
            nat.slot_objects(cls, names, values)
    assert nat.slot_objects(PrefixMatch, ("node",), ([],)) == []
