"""The segment path of :class:`~.redis.RedisIndex`: writes of placed keys to segment summaries and
records (:mod:`.summary`), and the lookup that reads summaries only (one round trip; a second only
where a run may go on in per-page fields) with the loader's read of one holder's records."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from pof_connector.index.base import MEDIA, Location, Matches, PrefixMatch, Resolver
from pof_connector.index.keyspace import FLAG_MEMORY_S, LIVE_QUERY, flat_key, loc_key, records_key, segment_key
from pof_connector.index.live_set import Registry
from pof_connector.index.record_runs import FIELD_BYTES, LeadingRuns, leading_runs
from pof_connector.index.resp import frame, hmget_head, hmget_resp, page_fields, resp
from pof_connector.index.segments import MAX_TAGS, SegmentAnswer, SegmentPlan, SegmentQuery, segment_items
from pof_connector.index.summary import record_slots
from pof_connector.pages.keys import SEGMENT_PAGES, PageKey

T = TypeVar("T")


class SegmentPath:
    """Mixed into :class:`~.redis.RedisIndex` (and overridden in part by the cluster's), whose
    members it uses are declared here for type checking."""

    if TYPE_CHECKING:
        _flag_seen: dict[bytes, float]
        _inc_names: dict[int, str]
        _segment_publish: Any
        _segment_withdraw: Any

        def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any: ...
        def _send(self, packed: bytes, replies: int) -> list[Any]: ...
        def _send_then(self, packed: bytes, replies: int, meanwhile: Callable[[], T]) -> tuple[list[Any], T]: ...
        def _live(self, now: list[bytes], live: Registry) -> np.ndarray: ...
        def _names(self, incs: list[int]) -> dict[int, str]: ...
        def _refused(self, n: int, why: str) -> None: ...
        def _matches(self, found: LeadingRuns,
                     resolver: Callable[[int], Resolver] | None = None) -> dict[str, PrefixMatch]: ...

    def _write_segments(self, what: str, entries: Sequence[tuple[PageKey, Location]], incs: dict[str, int]) -> None:
        by_ns: dict[bytes, list[tuple[PageKey, int, int, int, int]]] = {}
        for key, loc in entries:
            if loc.node in incs:
                by_ns.setdefault(key.namespace, []).append(
                    (key, incs[loc.node], MEDIA.index(loc.medium), loc.slot, loc.generation))
        for ns, group in by_ns.items():
            self._run_segment_script(what, ns, segment_items(group))

    def _run_segment_script(self, what: str, ns: bytes, items: dict[bytes, bytes]) -> None:
        """The segment publish or withdraw script on ``items`` (segment field -> its items)."""
        args: list[bytes | int] = [MAX_TAGS] if what == "publish" else []
        for field, its in items.items():
            args += [field, its]
        script = self._segment_publish if what == "publish" else self._segment_withdraw
        self._call(what, script, keys=list(self._summary_hashes(ns, next(iter(items)))), args=args)

    def _summary_hashes(self, ns: bytes, field: bytes) -> tuple[str, str, str]:
        """The hashes of the segment ``field``: its summary's, its overflowed pages', its records'."""
        return segment_key(ns), loc_key(ns), records_key(ns)

    def _all_summary_hashes(self, ns: bytes) -> list[tuple[str, str, str]]:
        """Every (summary, per-page, records) hash triple of ``ns``."""
        return [(segment_key(ns), loc_key(ns), records_key(ns))]

    def _read_record_values(self, ns: bytes, fields: np.ndarray) -> list[Any]:
        """``HMGET`` of records ``fields`` (rows of 20 bytes: segment field + incarnation), pre-encoded:
        redis-py's encoding of 125 fields cost as much as the round trip."""
        (got,) = self._send(hmget_head(records_key(ns).encode(), len(fields)) + frame(fields), 1)
        vals: list[Any] = got
        return vals

    def _segment_lookup(self, ns: bytes, keys: Sequence[PageKey], plan: SegmentPlan) -> dict[str, PrefixMatch]:
        """Round 1 reads the segments and the namespace's placeless flag, and, where this client saw
        the flag within :data:`FLAG_MEMORY_S`, every page's per-page field too; round 2, only when
        a run may go on in per-page fields round 1 did not read (a marked offset where a run
        stops, or a flag not seen before), reads those fields; both are decoded together."""
        seen = self._flag_seen.get(ns)
        flagged = seen is not None and time.monotonic() - seen < FLAG_MEMORY_S
        now, live, flat, vals, more, query = self._segment_round(ns, keys, plan, flagged)
        if flat is not None:
            self._flag_seen[ns] = time.monotonic()
        else:
            self._flag_seen.pop(ns, None)
        live_incs = self._live(now, live)
        answer = query.decode(vals, live_incs, len(MEDIA))
        alive = live_incs.tolist()
        if flat is None and not answer.needs_pages():
            return self._summary_matches(ns, answer)
        if more is not None:
            wanted, got = np.arange(query.pages), more
        else:
            wanted = np.arange(query.pages) if flat is not None else answer.marked
            got = self._call("lookup", self._page_round, ns, keys, plan, wanted, flat is not None)
        merged = answer.page_values(alive, len(MEDIA))
        for i, v in zip(wanted.tolist(), got, strict=True):
            if v is not None:
                merged[i] = (merged[i] or b"") + v
        found = leading_runs(merged, alive, len(MEDIA))
        if answer.malformed:
            self._refused(1, "malformed")
        return self._matches(found, partial(partial, _Records(self, ns, answer).resolve_inc))

    def _segment_round(self, ns: bytes, keys: Sequence[PageKey], plan: SegmentPlan, flagged: bool
                       ) -> tuple[list[bytes], Registry, Any, list[Any], list[Any] | None, SegmentQuery]:
        """Round 1: ``TIME``, the leases, the placeless flag, the summaries, and with ``flagged``
        every page's per-page field; returns those replies (``None`` for the fields when not read)
        and the query."""
        packed = (LIVE_QUERY + resp(b"GET", flat_key(loc_key(ns)).encode())
                  + hmget_resp(segment_key(ns).encode(), plan.fields)
                  + (hmget_resp(loc_key(ns).encode(), page_fields(keys)) if flagged else b""))
        # The tags (a pass over every key) are computed while the server answers.
        (now, live, flat, vals, *more), query = self._call("lookup", self._send_then, packed, 5 if flagged else 4,
                                                           plan.query)
        return now, live, flat, vals, (more[0] if more else None), query

    def _page_round(self, ns: bytes, keys: Sequence[PageKey], plan: SegmentPlan, wanted: np.ndarray,
                    flagged: bool) -> list[Any]:
        """Round 2: the per-page fields of the query pages ``wanted`` (``flagged``: placeless pages
        may be among them), one value per page."""
        (got,) = self._send(hmget_resp(loc_key(ns).encode(), page_fields([keys[int(i)] for i in wanted])), 1)
        vals: list[Any] = got
        return vals

    def _summary_matches(self, ns: bytes, answer: SegmentAnswer) -> dict[str, PrefixMatch]:
        """Each live head's run from a summary reply: media now, slots when a loader asks."""
        if answer.malformed:
            self._refused(1, "malformed")
        if answer.unknown:
            self._refused(answer.unknown, "unknown_medium")
        if not answer.heads:
            return Matches(held=answer.held)
        nodes = list(map(self._inc_names.get, answer.heads))
        if None in nodes:                          # incarnations not seen before: their names, once
            known = self._names(answer.heads)
            nodes = [known.get(i) for i in answer.heads]
        # Lean: one match per holder, so this is the lookup's per-holder cost in Python.
        return PrefixMatch.from_source(nodes, answer.media.pages.tolist(), _Records(self, ns, answer), answer.held)


def _read_records(index: SegmentPath, ns: bytes, query: SegmentQuery, layers: np.ndarray, inc: int, media: np.ndarray,
                  slots: np.ndarray, gens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Slots and generations of the leading query pages held by ``inc`` in ``media``, from its
    records; pages already known (``gens`` >= 0, from per-page fields) are kept, and one whose record
    is not there gets generation -1."""
    slots = np.array(slots, dtype=np.int64)
    out = np.array(gens, dtype=np.int64)
    todo = np.flatnonzero(out < 0)
    if not len(todo):
        return slots, out
    base = int(query.first_page[0])
    segs = np.unique((todo - base) // SEGMENT_PAGES)
    fields = np.empty((len(segs), FIELD_BYTES + 4), dtype=np.uint8)
    fields[:, :FIELD_BYTES] = query.fields[segs]
    fields[:, FIELD_BYTES:] = np.frombuffer(inc.to_bytes(4, "little"), dtype=np.uint8)
    vals = index._read_record_values(ns, fields)
    record_slots(vals, segs, base, media, layers[:len(media)], slots, out)
    return slots, out


class _Records:
    """A summary lookup's matches' media and slots, when first asked for: the slots come from the
    holder's records (one ``HMGET`` per holder, the only read of slots: a lookup's reply carries none)."""

    __slots__ = ("answer", "index", "ns")

    def __init__(self, index: SegmentPath, ns: bytes, answer: SegmentAnswer) -> None:
        self.index, self.ns, self.answer = index, ns, answer

    def media_of(self, key: int) -> np.ndarray:
        return self.answer.media.media(key)

    def resolve(self, key: int, pages: int, media: np.ndarray, slots: np.ndarray,
                gens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.resolve_inc(self.answer.heads[key], pages, media, slots, gens)

    def resolve_inc(self, inc: int, pages: int, media: np.ndarray, slots: np.ndarray,
                    gens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        a, ix = self.answer, self.index
        result: tuple[np.ndarray, np.ndarray] = ix._call("records", _read_records, ix, self.ns, a.query, a.layers,
                                                        inc, media, slots, gens)
        return result
