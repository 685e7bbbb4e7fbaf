"""Each live holder's leading run of pages, decoded from the reply of a lookup's ``HMGET``.

The reply holds one value per page of the query, in query order: ``None`` where no node holds
the page, else the page's holder records (:data:`RECORD`, 17 bytes each). A holder's run is the
pages from page 0 on which it has a record of a medium this build knows; of a page it holds in
two media, the lowest medium code counts. Values come from a server that a broken or hostile
writer may have filled, so a value that is empty or not whole records ends every run there, and
records of unknown media are absent pages; both are counted for the caller to report.

Two implementations give the same :class:`LeadingRuns`: the native ``pof_connector._prefix_runs``
(one pass in C, built with the package when a C compiler is there) and numpy. The native one
exists because decoding a 2,000-page reply in numpy calls cost the client more than the server
spent answering (0.55 ms against 0.5 ms on a 2-core AMD host); :data:`NATIVE` says which one runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

FIELD_BYTES = 16
"""A page's field in the index: the first 16 bytes of its chain digest."""
RECORD = np.dtype([("inc", "<u4"), ("medium", "u1"), ("slot", "<u4"), ("gen", "<u8")])
"""One holder record: incarnation, medium code, slot, generation (little-endian, packed)."""
assert RECORD.itemsize == 17

MAX_CELLS = 1 << 20
"""Cells (holder x page) of one dense block in the numpy decoder: 8 MiB."""

_native: ModuleType | None
try:
    from pof_connector import _prefix_runs as _native
except ImportError:       # built without a C compiler, or a source checkout without build_ext
    _native = None
NATIVE: bool = _native is not None
"""Whether the native decoder runs (else numpy: same runs, slower)."""


@dataclass(frozen=True, slots=True)
class LeadingRuns:
    """What a lookup's reply says, per live holder of page 0."""

    held: int
    """Pages before the first one no node holds or whose value is malformed."""
    malformed: bool
    """A value was empty or not whole records (it ends every run)."""
    unknown: int
    """Records of the held pages in a medium code this build does not know (absent pages)."""
    heads: list[int]
    """The live incarnations holding page 0, ascending."""
    runs: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
    """Per head: the medium codes (uint8), slots (int64) and generations (int64) of its run."""


def leading_runs(vals: list[Any], alive: list[int], n_media: int, *, native: bool | None = None) -> LeadingRuns:
    """The runs in the ``HMGET`` reply ``vals`` of the live incarnations ``alive``, for a build that
    knows ``n_media`` medium codes. ``native``: force one implementation (``None``: the native one
    when it was built)."""
    if native or (native is None and _native is not None):
        if _native is None:
            raise RuntimeError("pof_connector._prefix_runs was not built")
        live = np.array(sorted({i for i in alive if 0 <= i < 1 << 32}), dtype="<u4")   # np.unique: ~3x the time
        held, malformed, unknown, heads, runs = _native.leading_runs(vals, live.tobytes(), n_media)
        return LeadingRuns(held, bool(malformed), unknown, heads,
                           [(np.frombuffer(m, dtype=np.uint8), np.frombuffer(s, dtype=np.int64),
                             np.frombuffer(g, dtype=np.int64)) for m, s, g in runs])
    return _numpy_runs(vals, alive, n_media)


def _lengths(vals: list[Any]) -> np.ndarray | None:
    """The length of every value; ``None`` when one is ``None`` (a page no node holds)."""
    try:
        return np.fromiter(map(len, vals), dtype=np.int64, count=len(vals))
    except TypeError:
        return None


def _numpy_runs(vals: list[Any], alive: list[int], n_media: int) -> LeadingRuns:
    # Passes in C over the values (a Python loop over 2,000 of them cost more than the server's work):
    # when the last page is held, most likely all are, and one pass gives every length.
    lens = _lengths(vals) if vals and vals[-1] is not None else None
    if lens is None:
        held = vals.index(None) if None in vals else len(vals)
        head = vals[:held]
        lens = np.fromiter(map(len, head), dtype=np.int64, count=held)
    else:
        head, held = vals, len(vals)
    bad = (lens == 0) | (lens % RECORD.itemsize != 0)
    malformed = bool(bad.any())
    if malformed:
        held = int(bad.argmax())
        head, lens = head[:held], lens[:held]
    if held == 0:
        return LeadingRuns(0, malformed, 0, [], [])
    recs = np.frombuffer(b"".join(head), dtype=RECORD)
    page = np.repeat(np.arange(held), lens // RECORD.itemsize)     # records are in page order
    # Contiguous copies of the packed fields: comparisons on 17-byte strided views are slow.
    inc = np.ascontiguousarray(recs["inc"])
    medium = np.ascontiguousarray(recs["medium"])
    known = medium < n_media
    unknown = int((~known).sum())
    # Only live nodes holding the first page can have a run: one row each, page by page.
    first = int(lens[0]) // RECORD.itemsize
    heads = sorted(set(inc[:first][known[:first]].tolist()).intersection(alive))
    if not heads:
        return LeadingRuns(held, malformed, unknown, [], [])
    order = np.array(heads, dtype=inc.dtype)
    row = np.minimum(np.searchsorted(order, inc), len(heads) - 1)
    sel = np.flatnonzero((order[row] == inc) & known)
    row, pg = row[sel], page[sel]
    idx: list[np.ndarray] = []
    step = max(1, MAX_CELLS // held)             # rows per dense block: memory stays bounded
    for r0 in range(0, len(heads), step):
        part = slice(None) if step >= len(heads) else (row >= r0) & (row < r0 + step)
        idx += block_runs(sel[part], row[part] - r0, pg[part], medium, min(step, len(heads) - r0), held)
    slot, gen = recs["slot"], recs["gen"]
    return LeadingRuns(held, malformed, unknown, heads,
                       [(medium[i], slot[i].astype(np.int64), gen[i].astype(np.int64)) for i in idx])


def block_runs(sel: np.ndarray, row: np.ndarray, pg: np.ndarray, medium: np.ndarray, rows: int,
                held: int) -> list[np.ndarray]:
    """Per row (holder), the records of its run of pages from page 0: ``sel`` are record numbers,
    ``row`` and ``pg`` their holder's row and page; of a page in two media of one holder, the
    lowest medium code (``medium``, by record number) wins."""
    pos = np.full((rows, held), -1, dtype=np.int64)        # row, page -> record; -1: none
    pos[row, pg] = sel
    filled = pos >= 0
    if int(filled.sum()) < len(sel):                       # a page in two media of one holder
        by = np.lexsort((medium[sel], pg, row))
        sel, row, pg = sel[by], row[by], pg[by]
        first = np.ones(len(sel), dtype=bool)
        first[1:] = (row[1:] != row[:-1]) | (pg[1:] != pg[:-1])
        pos[row[first], pg[first]] = sel[first]
    ends = np.where(filled.all(axis=1), held, filled.argmin(axis=1)).tolist()
    return [pos[k, :end] for k, end in enumerate(ends)]
