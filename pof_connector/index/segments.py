"""The locality index's segments: the pages of up to :data:`~pof_connector.pages.keys.SEGMENT_PAGES`
consecutive pages of a chain under one field, found from the segment's head page, so a lookup
reads one field per segment instead of one per page (the reasons: ``docs/index-segments.md``; the
summary and record layouts: :mod:`.summary`).

A publish or withdraw sends, per segment, items of :data:`ITEM_BYTES`: the page's own 16-byte
field (for a page that goes to, or is in, a per-page field), then :data:`SEGMENT_RECORD`: its
offset in the segment, its tag (the first 8 bytes of its own digest: chains that diverge inside a
segment have different pages at one offset) and its holder record. An offset holds the pages of at
most :data:`MAX_TAGS` chains; a page of one more chain goes to its own per-page field instead, and
the offset is marked in the summary, which tells lookups to read the per-page fields of the
query's pages at that offset too.

Everything here is pure: building a query's fields and a publish's arguments, and decoding a
reply into runs and holders (:class:`SegmentAnswer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pof_connector.index import record_runs, summary
from pof_connector.index.record_runs import FIELD_BYTES, RECORD
from pof_connector.pages.keys import SEGMENT_PAGES, PageKey

TAG_BYTES = 8
SEGMENT_RECORD = np.dtype([("offset", "u1"), ("tag", "<u8"), ("inc", "<u4"), ("medium", "u1"), ("slot", "<u4"),
                           ("gen", "<u8")])
"""One location as the write scripts take it: offset in the segment, tag (the page digest's first 8
bytes, little-endian), then the 17-byte holder record (incarnation, medium code, slot, generation)."""
assert SEGMENT_RECORD.itemsize == 1 + TAG_BYTES + RECORD.itemsize == 26
ITEM_BYTES = FIELD_BYTES + SEGMENT_RECORD.itemsize
"""A publish or withdraw item sent to the scripts: the page's own 16-byte field (for a page that
goes to, or is in, a per-page field), then its segment record."""
MAX_TAGS = 4
"""Chains whose pages one offset of a segment holds at most (the pages of others go to per-page
fields): a segment where many chains diverge stays small for every lookup that reads it."""
assert MAX_TAGS <= summary.LAYERS


def _native() -> Any:
    """The native decoder's module when it has the summary decoder (read at each call: tests
    switch :mod:`.record_runs`' to ``None`` to run Python)."""
    mod = record_runs._native
    return mod if mod is not None and hasattr(mod, "summary_runs") else None


NATIVE: bool = _native() is not None
"""Whether the native summary decoder runs (else Python: same runs, slower)."""


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

    def decode(self, vals: list[Any], alive: list[int] | np.ndarray, n_media: int, *,
               native: bool | None = None) -> SegmentAnswer:
        """The runs and holders in the reply ``vals`` (one summary per field, or ``None``) of the live
        incarnations ``alive`` (a list, or already a sorted uint32 array), for a build that knows
        ``n_media`` medium codes. ``native``: force one implementation (``None``: the native one when
        it was built)."""
        nat = _native()
        live = alive if isinstance(alive, np.ndarray) else np.array(
            sorted({i for i in alive if 0 < i < 1 << 32}), dtype="<u4")    # np.unique: ~3x the time
        if native or (native is None and nat is not None):
            if nat is None:
                raise RuntimeError("pof_connector._prefix_runs was not built with summary_runs")
            held, malformed, unknown, heads, media, layers, marked = nat.summary_runs(
                vals, self.first_page, self.tags, live, n_media, SEGMENT_PAGES)
            marks = np.frombuffer(marked, dtype=np.int64)
        else:
            held, malformed, unknown, heads, media, layers, marks = summary.summary_runs(
                vals, self.first_page, self.tags, live.tolist(), n_media, SEGMENT_PAGES)
        return SegmentAnswer(held, bool(malformed), unknown, np.frombuffer(heads, dtype="<u4").tolist(),
                             summary.Stretches.of(media), np.frombuffer(layers, dtype=np.uint8), marks, self, vals)


@dataclass(frozen=True)
class SegmentAnswer:
    """A decoded summary reply: the runs and holders, and what a second round or the loader needs."""

    held: int
    """Pages before the first one no holder has in a known medium (or the first malformed value's segment)."""
    malformed: bool
    unknown: int
    """(holder, query page) pairs in a medium code this build does not know."""
    heads: list[int]
    """The live incarnations holding page 0, ascending."""
    media: summary.Stretches
    """The heads' runs' media (:meth:`~.summary.Stretches.media`)."""
    layers: np.ndarray
    """Per query page, the layer of its tag in its summary (255: no tag): where the records are."""
    marked: np.ndarray
    """Query pages at an overflowed offset (int64, ascending): other chains' pages there are in
    per-page fields."""
    query: SegmentQuery
    vals: list[Any]

    def needs_pages(self) -> bool:
        """Whether a marked page could start a run or extend one: then the per-page fields of the
        marked pages must be read too."""
        if not len(self.marked):
            return False
        return int(self.marked[0]) <= int(self.media.pages.max(initial=0))

    def media_of(self, h: int) -> np.ndarray:
        """The medium code of each page of head ``h``'s run."""
        return self.media.media(h)

    def page_values(self, alive: list[int], n_media: int) -> list[bytes | None]:
        """The reply as a per-page reply (17-byte records per query page, ``None`` where none is),
        to merge with per-page fields and decode as one. The records carry no slot
        (:data:`~.summary.SENTINEL_SLOT`, generation -1): the loader reads them."""
        pages = self.query.pages
        out: list[list[bytes]] = [[] for _ in range(pages)]
        for s, v in enumerate(self.vals):
            sm = None if v is None else summary.parse_summary(v)
            if sm is None:
                if v is not None:
                    break                     # malformed: nothing from here on
                continue
            fp = int(self.query.first_page[s])
            for o in range(SEGMENT_PAGES):
                q = fp + o
                if not 0 <= q < pages or self.layers[q] == 255:
                    continue
                lay = int(self.layers[q])
                for inc, medium, masks in sm.holders:
                    if lay < len(masks) and masks[lay] >> o & 1:
                        out[q].append(_unresolved(inc, medium))
        return [b"".join(r) if r else None for r in out]


def _unresolved(inc: int, medium: int) -> bytes:
    rec = np.zeros(1, dtype=RECORD)
    rec["inc"], rec["medium"], rec["slot"], rec["gen"] = inc, medium, summary.SENTINEL_SLOT, np.uint64(2**64 - 1)
    return rec.tobytes()


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
