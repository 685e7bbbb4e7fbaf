"""The locality index's segment records: the holders of up to :data:`~pof_connector.keys.SEGMENT_PAGES`
pages of a chain under one hash field, so a lookup reads one field per segment instead of one per
page (the schema and the reasons: :mod:`.redis` and ``docs/index-segments.md``).

A segment's field is the first 16 bytes of its head page's chain digest; its value is a run of
:data:`SEGMENT_RECORD` records: the page's offset in the segment, the first 8 bytes of the page's
own digest (its tag: chains that diverge inside a segment have different pages at one offset)
and the holder record of :data:`~.record_runs.RECORD`. An offset holds the pages of at most
:data:`MAX_TAGS` chains; a page of one more chain goes to its own per-page field instead, and a
marker record (incarnation 0, which no node has) at that offset tells lookups to read the
per-page fields of the query's pages at that offset too.

Everything here is pure: building a query's fields and a publish's arguments, and decoding a
reply into the :class:`~.record_runs.LeadingRuns` the per-page decoder gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pof_connector.index import record_runs
from pof_connector.index.record_runs import FIELD_BYTES, RECORD, LeadingRuns, block_runs
from pof_connector.keys import SEGMENT_PAGES, PageKey

TAG_BYTES = 8
SEGMENT_RECORD = np.dtype([("offset", "u1"), ("tag", "<u8"), ("inc", "<u4"), ("medium", "u1"), ("slot", "<u4"),
                           ("gen", "<u8")])
"""One segment record: offset in the segment, tag (the page digest's first 8 bytes, little-endian),
then the 17-byte holder record (incarnation, medium code, slot, generation)."""
assert SEGMENT_RECORD.itemsize == 1 + TAG_BYTES + RECORD.itemsize == 26
ITEM_BYTES = FIELD_BYTES + SEGMENT_RECORD.itemsize
"""A publish or withdraw item sent to the scripts: the page's own 16-byte field (for a page that
goes to, or is in, a per-page field), then its segment record."""
MAX_TAGS = 4
"""Chains whose pages one offset of a segment holds at most (the pages of others go to per-page
fields): a segment where many chains diverge stays small for every lookup that reads it."""


def _native() -> Any:
    """The native decoder's module when it has the segment decoder (read at each call: tests
    switch :mod:`.record_runs`' to ``None`` to run numpy)."""
    mod = record_runs._native
    return mod if mod is not None and hasattr(mod, "segment_runs") else None


NATIVE: bool = _native() is not None
"""Whether the native segment decoder runs (else numpy: same runs, slower)."""


def tag(digest: bytes) -> int:
    return int.from_bytes(digest[:TAG_BYTES], "little")


@dataclass(frozen=True)
class SegmentPlan:
    """What a lookup of placed ``keys`` sends: the segments' fields. The tags, which only decoding
    needs, are computed by :meth:`query`, while the server answers."""

    fields: np.ndarray
    """The segments' fields, ``[segments, 16]`` uint8, in chain order."""
    first_page: np.ndarray
    """Per segment, the query page (index into the keys) at its offset 0 (int64; negative when
    the query starts inside that segment)."""
    keys: Sequence[PageKey]

    @classmethod
    def of(cls, keys: Sequence[PageKey]) -> SegmentPlan | None:
        """``None`` when the keys do not know their places, or are not one chain's consecutive
        pages (their first and last positions say so; a key from elsewhere in the middle could
        only miss, as in :func:`~.base.check_one_namespace`)."""
        n = len(keys)
        first, last = keys[0].place, keys[-1].place
        if first is None or last is None or last.position - first.position != n - 1:
            return None
        start = (SEGMENT_PAGES - first.offset) % SEGMENT_PAGES or SEGMENT_PAGES     # the second segment's head
        try:
            heads = b"".join([first.head, *[k.place.head for k in keys[start::SEGMENT_PAGES]]])  # type: ignore[union-attr]
        except AttributeError:         # a head without its place
            return None
        first_page = np.arange(start - SEGMENT_PAGES, n, SEGMENT_PAGES, dtype=np.int64)
        first_page[0] = -first.offset
        return cls(np.frombuffer(heads, dtype=np.uint8).reshape(len(first_page), -1)[:, :FIELD_BYTES], first_page, keys)

    def query(self) -> SegmentQuery:
        digests = np.frombuffer(b"".join([k.digest for k in self.keys]), dtype="<u8").reshape(len(self.keys), -1)
        return SegmentQuery(self.fields, self.first_page, digests[:, 0].copy())   # tag: the first u64


@dataclass(frozen=True)
class SegmentQuery:
    """A lookup of placed keys (one chain's consecutive pages, in order) as segment fields, and
    the decoding of the reply."""

    fields: np.ndarray
    """As :attr:`SegmentPlan.fields`."""
    first_page: np.ndarray
    """As :attr:`SegmentPlan.first_page`."""
    tags: np.ndarray
    """Per query page, its tag (uint64)."""

    @classmethod
    def of(cls, keys: Sequence[PageKey]) -> SegmentQuery | None:
        """The plan's query at once (``None``: as :meth:`SegmentPlan.of`)."""
        plan = SegmentPlan.of(keys)
        return None if plan is None else plan.query()

    @property
    def pages(self) -> int:
        return len(self.tags)

    def decode(self, vals: list[Any], alive: list[int], n_media: int, *, native: bool | None = None) -> SegmentAnswer:
        """The runs in the reply ``vals`` (one value per field: ``None`` or records) of the live
        incarnations ``alive``, for a build that knows ``n_media`` medium codes. ``native``: force
        one implementation (``None``: the native one when it was built)."""
        nat = _native()
        if native or (native is None and nat is not None):
            if nat is None:
                raise RuntimeError("pof_connector._prefix_runs was not built with segment_runs")
            live = np.array(sorted({i for i in alive if 0 < i < 1 << 32}), dtype="<u4")   # np.unique: ~3x the time
            held, malformed, unknown, heads, runs, marked = nat.segment_runs(
                vals, self.first_page, self.tags, live, n_media, SEGMENT_PAGES)
            found = LeadingRuns(held, bool(malformed), unknown, heads,
                                [(np.frombuffer(m, dtype=np.uint8), np.frombuffer(s, dtype=np.int64),
                                  np.frombuffer(g, dtype=np.int64)) for m, s, g in runs])
            return SegmentAnswer(found, np.frombuffer(marked, dtype=np.int64), self, vals)
        m = self._match(vals)
        known = m.match & (m.recs["medium"] < n_media)
        unknown = int((m.match & ~known).sum())
        found = _runs(np.flatnonzero(known), m.page, m.recs, alive, m.limit, m.malformed, unknown)
        return SegmentAnswer(found, np.unique(m.page[m.marker]), self, vals)

    def _match(self, vals: list[Any]) -> _Matched:
        """Each record of the reply with its query page, and whether it is that page's (its tag)
        or a marker. Values after a malformed one are not read."""
        limit, malformed = self.pages, False
        good: list[bytes] = []
        for s, v in enumerate(vals):
            if v is None:
                good.append(b"")
            elif len(v) == 0 or len(v) % SEGMENT_RECORD.itemsize:
                # Cut short or padded: what a broken or hostile writer left. Every run ends here.
                limit, malformed = max(0, min(self.pages, int(self.first_page[s]))), True
                break
            else:
                good.append(v)
        lens = np.fromiter(map(len, good), dtype=np.int64, count=len(good)) // SEGMENT_RECORD.itemsize
        recs = np.frombuffer(b"".join(good), dtype=SEGMENT_RECORD)
        offset = recs["offset"].astype(np.int64)
        page = np.repeat(self.first_page[:len(good)], lens) + offset
        inside = (offset < SEGMENT_PAGES) & (page >= 0) & (page < limit)
        page = np.where(inside, page, 0)
        inc = recs["inc"]
        marker = inside & (inc == 0)
        match = inside & (inc != 0) & (recs["tag"] == self.tags[page])
        return _Matched(recs, page, match, marker, limit, malformed)


@dataclass(frozen=True)
class _Matched:
    recs: np.ndarray
    page: np.ndarray
    """Per record, its query page (0 where it is not :attr:`match` nor :attr:`marker`)."""
    match: np.ndarray
    """Per record: a holder record of its query page."""
    marker: np.ndarray
    limit: int
    """Pages before the first malformed value's segment (all of the query when none)."""
    malformed: bool


@dataclass(frozen=True)
class SegmentAnswer:
    """A decoded segment reply: the runs, and what a second round needs."""

    runs: LeadingRuns
    marked: np.ndarray
    """Query pages whose offset carries a marker (int64, ascending): other chains' pages there
    are in per-page fields."""
    query: SegmentQuery
    vals: list[Any]

    def needs_pages(self) -> bool:
        """Whether a marked page could start a run or extend one: then the per-page fields of the
        marked pages must be read too."""
        if not len(self.marked):
            return False
        ends = [len(slots) for _, slots, _ in self.runs.runs] or [0]
        return int(self.marked[0]) <= max(ends)

    def page_values(self) -> list[bytes | None]:
        """The reply's records as a per-page reply (17-byte records per query page, ``None`` where
        none is), to merge with per-page fields and decode as one."""
        m = self.query._match(self.vals)
        rows = np.flatnonzero(m.match)
        rows = rows[np.argsort(m.page[rows], kind="stable")]
        rec = np.zeros(len(rows), dtype=RECORD)
        for name in RECORD.names or ():
            rec[name] = m.recs[name][rows]
        blob = rec.tobytes()
        ends = np.cumsum(np.bincount(m.page[rows], minlength=self.query.pages)) * RECORD.itemsize
        starts = np.concatenate(([0], ends[:-1]))
        return [blob[a:b] if b > a else None for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]


def _runs(sel: np.ndarray, page: np.ndarray, recs: np.ndarray, alive: list[int], limit: int, malformed: bool,
          unknown: int) -> LeadingRuns:
    """Per live holder of page 0, its run of pages from page 0 among the records ``sel``; of a
    page it holds in two media, the lowest medium code."""
    pg = page[sel]
    covered = np.zeros(limit + 1, dtype=bool)
    covered[pg] = True
    held = int(np.argmin(covered))
    inc = np.ascontiguousarray(recs["inc"])[sel]
    heads = sorted(set(inc[pg == 0].tolist()).intersection(alive))
    if not heads or held == 0:
        return LeadingRuns(held, malformed, unknown, [], [])
    order = np.array(heads, dtype=inc.dtype)
    row = np.minimum(np.searchsorted(order, inc), len(heads) - 1)
    mine = (order[row] == inc) & (pg < held)
    medium = np.ascontiguousarray(recs["medium"])
    idx = block_runs(sel[mine], row[mine], pg[mine], medium, len(heads), held)
    slot, gen = np.ascontiguousarray(recs["slot"]), np.ascontiguousarray(recs["gen"])
    return LeadingRuns(held, malformed, unknown, heads,
                       [(medium[i], slot[i].astype(np.int64), gen[i].astype(np.int64)) for i in idx])


def segment_items(entries: Sequence[tuple[PageKey, int, int, int, int]]) -> dict[bytes, bytes]:
    """Per segment field, the concatenated :data:`ITEM_BYTES` items of ``entries``: (placed key,
    incarnation, medium code, slot, generation)."""
    grouped: dict[bytes, list[tuple[PageKey, int, int, int, int]]] = {}
    for e in entries:
        place = e[0].place
        assert place is not None
        grouped.setdefault(place.head[:FIELD_BYTES], []).append(e)
    out = {}
    for field, group in grouped.items():
        recs = np.zeros(len(group), dtype=SEGMENT_RECORD)
        recs["offset"] = [k.place.offset for k, *_ in group]  # type: ignore[union-attr]
        recs["tag"] = [tag(k.digest) for k, *_ in group]
        recs["inc"] = [g[1] for g in group]
        recs["medium"] = [g[2] for g in group]
        recs["slot"] = [g[3] for g in group]
        recs["gen"] = [g[4] for g in group]
        items = np.zeros((len(group), ITEM_BYTES), dtype=np.uint8)
        items[:, :FIELD_BYTES] = np.frombuffer(b"".join(k.digest[:FIELD_BYTES] for k, *_ in group),
                                               dtype=np.uint8).reshape(len(group), FIELD_BYTES)
        items[:, FIELD_BYTES:] = recs.view(np.uint8).reshape(len(group), SEGMENT_RECORD.itemsize)
        out[field] = items.tobytes()
    return out
