"""Which leading pages of a query a node can load, and from whom: the one rule that
:meth:`Pool.lookup <pof_connector.pool.Pool.lookup>` loads by and the locator
(:mod:`pof_connector.locality.locator`) routes by.

Pure: the index's answers (runs of pages per holder) and what the asking node knows of the
holders go in, the choice comes out. :func:`gather_runs` drives the index queries around it.

The rule: page by page, from the first holder of that page the node reads with plain loads (its
own pages first, then a tier it shares, e.g. one CXL region), else from the first holder it
reads over the fabric; the run stops at the first page no readable holder has. The ``engine``
medium (an engine's own prefix cache) is never loadable.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from pof_connector.index.base import LOOKUP_ROUNDS, MEDIA, Location, Matches, PrefixMatch
from pof_connector.pages.keys import PageKey

Run = tuple[int, PrefixMatch]
"""A holder's run of pages of a query, and the page of the query it starts at."""
Readable = Mapping[str, Collection[str]]
"""Per holder node, the media the asking node reads of it (a holder not named: none)."""
ENGINE = "engine"


@dataclass(frozen=True)
class Reach:
    """The leading pages a node can load: page ``i`` from ``sources[i]``; ``fabric[i]``: only over
    the fabric. ``elsewhere`` counts, per holder, the leading pages (from page 0 of the query) of a
    run with a page this node cannot read (yet): routers use it, loaders ignore it."""

    sources: list[Location]
    fabric: list[bool]
    elsewhere: dict[str, int] = field(default_factory=dict)

    @property
    def pages(self) -> int:
        return len(self.sources)

    @property
    def near_pages(self) -> int:
        """Leading pages loaded without the fabric."""
        return next((i for i, f in enumerate(self.fabric) if f), len(self.fabric))


def reach(me: str, runs: list[Run], *, near: Readable, far: Readable,
          own: list[Location] | None = None, length: int | None = None, slots: bool = True) -> Reach:
    """Which leading pages node ``me`` can load of ``runs`` (in the order the index gave them).

    ``near``: media of each holder ``me`` reads with plain loads (``me``'s own pages always are);
    ``far``: media it reads over the fabric. ``own``: leading pages already found in ``me``'s own
    tiers (taken as they are). ``length``: pages in the query (``None``: no bound but the runs).
    ``slots``: read the chosen holders' slot records (:meth:`PrefixMatch.resolve`, for the pages
    taken from each; a record gone since the lookup ends the sources there); ``False``: a router's
    count, whose sources carry slot and generation -1."""
    if all(m.node != me and not near.get(m.node) and not far.get(m.node) for _, m in runs):
        # Nothing here is readable by ``me`` (most nodes for most prompts in a router's count):
        # what the tables below would conclude, without building them.
        elsewhere: dict[str, int] = {}
        for at, m in runs:
            if m.pages:          # not len(m.media): that builds the media of every holder
                elsewhere[m.node] = max(elsewhere.get(m.node, 0), at + m.pages)
        return Reach(list(own or []), [False] * len(own or []), elsewhere)
    order, elsewhere, run_of, j_of, far_of = _pick(me, runs, near, far, len(own or []), length)
    picks: list[tuple[int, int, bool]] = list(zip(run_of.tolist(), j_of.tolist(), far_of.tolist(), strict=True))
    prepared = [(m, m.media) for _, m in order]
    if slots:
        # Only the pages taken from each holder are read, and a record gone since the lookup cuts there.
        need: dict[int, int] = {}
        for r, j, _ in picks:
            need[r] = max(need.get(r, 0), j + 1)
        good = {r: prepared[r][0].resolve(n) for r, n in need.items()}
        cut = next((k for k, (r, j, _) in enumerate(picks) if j >= good[r]), len(picks))
        picks = picks[:cut]
    sources = list(own or [])
    fabric = [False] * len(sources)
    known = {r: (*(a.tolist() for a in prepared[r][0].known()), prepared[r][1].tolist())
             for r in {r for r, _, _ in picks}}
    for r, j, far_read in picks:
        sl, gens, media = known[r]
        sources.append(Location(prepared[r][0].node, MEDIA[media[j]], sl[j], gens[j]))
        fabric.append(far_read)
    return Reach(sources, fabric, elsewhere)


def reach_media(me: str, runs: list[Run], *, near: Readable, far: Readable) -> tuple[np.ndarray, np.ndarray]:
    """A router's count of :func:`reach` (``slots=False``), without a :class:`Location` per page:
    per leading page node ``me`` can load, its medium code and whether it comes over the fabric."""
    readable = [(at, m) for at, m in runs if m.node == me or near.get(m.node) or far.get(m.node)]
    if not readable:
        return np.zeros(0, dtype=np.uint8), np.zeros(0, dtype=bool)
    if len(readable) == 1 and readable[0][0] == 0 and readable[0][1].node == me:
        # Its own run alone (a holder, most of the time): its pages as they are, to the first in a
        # medium it cannot load, which is what the table below concludes (a router counts this per
        # holder per request; the table cost 10 us of numpy calls)
        media = readable[0][1].media
        ok = _table(MEDIA)[media]
        n = len(media) if ok.all() else int(ok.argmin())
        return media[:n], np.zeros(n, dtype=bool)
    order, _, run_of, j_of, far_of = _pick(me, runs, near, far, 0, None)
    codes = np.zeros(len(run_of), dtype=np.uint8)
    for r in np.unique(run_of).tolist():
        taken = run_of == r
        codes[taken] = order[r][1].media[j_of[taken]]
    return codes, far_of


def _pick(me: str, runs: list[Run], near: Readable, far: Readable, first: int, length: int | None
          ) -> tuple[list[Run], dict[str, int], np.ndarray, np.ndarray, np.ndarray]:
    """:func:`reach`'s choice from page ``first`` on: (the runs in the order picked from, the
    ``elsewhere`` counts, and per page taken: its run in that order, its page in the run, whether
    over the fabric)."""
    order = sorted(runs, key=lambda r: r[1].node != me)      # own first, else as the index gave them
    # Per run, whether ``me`` reads each medium code near / far, as lookup tables; the pick is made
    # on a (runs x pages) table in numpy: a loop over pages and runs cost 3 ms at 64 holders.
    elsewhere: dict[str, int] = {}
    end = max((at + m.pages for at, m in runs), default=0)
    if length is not None:
        end = min(end, length)
    width = max(end - first, 0)
    near_ok = np.zeros((len(order), width), dtype=bool)
    far_ok = np.zeros((len(order), width), dtype=bool)
    for r, (at, m) in enumerate(order):
        near_media = near.get(m.node, ()) if m.node != me else MEDIA
        far_media = far.get(m.node, ()) if m.node != me else ()
        nr, fr = _table(near_media), _table(far_media)
        media = m.media
        if len(media) and not (nr | fr)[media].all():
            elsewhere[m.node] = max(elsewhere.get(m.node, 0), at + m.pages)
        lo, hi = max(at, first), min(at + len(media), end)
        if hi > lo:
            near_ok[r, lo - first:hi - first] = nr[media[lo - at:hi - at]]
            far_ok[r, lo - first:hi - first] = fr[media[lo - at:hi - at]]
    if not (order and width):
        empty = np.zeros(0, dtype=np.int64)
        return order, elsewhere, empty, empty, np.zeros(0, dtype=bool)
    has_near = np.asarray(near_ok.any(axis=0))
    has_far = np.asarray(far_ok.any(axis=0))
    readable = has_near | has_far
    stop = int(np.argmin(readable)) if not readable.all() else width
    run_of = np.where(has_near, near_ok.argmax(axis=0), far_ok.argmax(axis=0))[:stop]
    at_of = np.array([at for at, _ in order], dtype=np.int64)
    j_of = np.arange(first, first + stop) - at_of[run_of]
    return order, elsewhere, run_of, j_of, ~has_near[:stop]


@lru_cache(maxsize=256)
def _readable(media: frozenset[str]) -> np.ndarray:
    """Per medium code (256 of them, so any byte indexes it), whether it is in ``media`` and loadable."""
    out = np.zeros(256, dtype=bool)
    out[[c for c, md in enumerate(MEDIA) if md != ENGINE and md in media]] = True
    out.flags.writeable = False
    return out


def _table(media: Collection[str]) -> np.ndarray:
    return _readable(media if isinstance(media, frozenset) else frozenset(media))


def gather_runs(keys: list[PageKey], ask: Callable[[list[PageKey]], Mapping[str, PrefixMatch]],
                covered: Callable[[list[Run]], int], *, rounds: int = LOOKUP_ROUNDS) -> list[Run]:
    """Ask the index for ``keys`` (``ask``: its ``longest_prefix``) in up to ``rounds`` queries.

    The index counts each node's pages from the first key it is asked for, so a chain whose head
    stayed on one node and whose tail lives on another (spilled, or evicted there and kept here)
    ends every run where the head's holder stops: it is asked again from ``covered(runs so far)``
    (one more round trip, only for a partial hit), until that covers every key or moves no further,
    or the answer says that no one holds the page where the next round would start
    (:attr:`~.base.Matches.held`: most partial hits, a known prefix and a new turn, end there)."""
    runs: list[Run] = []
    start = 0
    for _ in range(rounds):
        if start >= len(keys):
            break
        more = ask(keys[start:])
        if not more:
            break             # nothing further: the runs so far are the answer
        runs += [(start, m) for m in more.values()]
        nxt = covered(runs)
        held = more.held if isinstance(more, Matches) else None
        if nxt <= start or (held is not None and start + held <= nxt):
            break
        start = nxt
    return runs
