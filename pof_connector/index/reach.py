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

from pof_connector.index.base import LOOKUP_ROUNDS, MEDIA, Location, PrefixMatch
from pof_connector.keys import PageKey

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
          own: list[Location] | None = None, length: int | None = None) -> Reach:
    """Which leading pages node ``me`` can load of ``runs`` (in the order the index gave them).

    ``near``: media of each holder ``me`` reads with plain loads (``me``'s own pages always are);
    ``far``: media it reads over the fabric. ``own``: leading pages already found in ``me``'s own
    tiers (taken as they are). ``length``: pages in the query (``None``: no bound but the runs)."""
    order = sorted(runs, key=lambda r: r[1].node != me)      # own first, else as the index gave them
    # Per run, as plain lists (a lookup walks thousands of pages): where it starts and stops, its
    # holder, media codes, slots, generations, and per code whether ``me`` reads it near / far.
    prepared: list[tuple[int, int, str, list[int], list[int], list[int], list[bool], list[bool]]] = []
    elsewhere: dict[str, int] = {}
    for at, m in order:
        near_media = near.get(m.node, ()) if m.node != me else MEDIA
        far_media = far.get(m.node, ()) if m.node != me else ()
        nr = [md != ENGINE and md in near_media for md in MEDIA]
        fr = [md != ENGINE and md in far_media for md in MEDIA]
        media = m.media.tolist()
        if any(not (nr[c] or fr[c]) for c in set(media)):
            elsewhere[m.node] = max(elsewhere.get(m.node, 0), at + m.pages)
        prepared.append((at, at + len(media), m.node, media, m.slots.tolist(), m.generations.tolist(), nr, fr))
    sources = list(own or [])
    fabric = [False] * len(sources)
    end = max((at + m.pages for at, m in runs), default=0)
    if length is not None:
        end = min(end, length)
    for i in range(len(sources), end):
        got: Location | None = None
        remote: Location | None = None
        for at, stop, node, media, slots, gens, nr, fr in prepared:
            if at <= i < stop:
                j = i - at
                c = media[j]
                if nr[c]:
                    got = Location(node, MEDIA[c], slots[j], gens[j])
                    break
                if remote is None and fr[c]:
                    remote = Location(node, MEDIA[c], slots[j], gens[j])
        if got is not None:
            sources.append(got)
            fabric.append(False)
        elif remote is not None:
            sources.append(remote)
            fabric.append(True)
        else:
            break
    return Reach(sources, fabric, elsewhere)


def gather_runs(keys: list[PageKey], ask: Callable[[list[PageKey]], Mapping[str, PrefixMatch]],
                covered: Callable[[list[Run]], int], *, rounds: int = LOOKUP_ROUNDS) -> list[Run]:
    """Ask the index for ``keys`` (``ask``: its ``longest_prefix``) in up to ``rounds`` queries.

    The index counts each node's pages from the first key it is asked for, so a chain whose head
    stayed on one node and whose tail lives on another (spilled, or evicted there and kept here)
    ends every run where the head's holder stops: it is asked again from ``covered(runs so far)``
    (one more round trip, only for a partial hit), until that covers every key or moves no further."""
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
        if nxt <= start:
            break
        start = nxt
    return runs
