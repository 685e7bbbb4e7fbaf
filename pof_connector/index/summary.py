"""A segment's two structures in the index: its summary (which holder has which of its pages) and,
per holder, its slot records. A lookup reads summaries only, so its reply grows by a few bytes per
holder and segment, not by a record per holder and page; the loader reads the records of the one
holder it picked, for the pages it loads.

Summary (``pof:{pof}:seg:<ns>``, field: the segment's 16-byte field), little-endian::

    u16 marks                  bit o: offset o overflowed (other chains' pages there are in per-page fields)
    u8  L                      tag layers in use (0..LAYERS)
    L x u16 presence           layer l's bit o: a tag sits at (l, o)
    8 bytes per present tag    in (layer, offset) order: the page digest's first 8 bytes
    holders, 5 + 2L bytes each: u32 incarnation | u8 medium | L x u16 mask (bit o of layer l: it
                               holds the page of tag (l, o) in that medium)

An offset holds the pages of up to :data:`~.segments.MAX_TAGS` chains, one per layer; a linear
chain uses layer 0 only, so a holder costs 7 bytes per segment.

Records (``pof:{pof}:rec:<ns>``, field: segment field + u32 incarnation): groups of
``u8 medium | u8 layer | u16 mask`` followed by a ``u32 slot | u64 generation`` per set bit, in
offset order. A record is found by (medium, layer, offset); the scripts keep it and the summary's
bit together. A reader that reads them at different times may see them disagree: a missing record
is a miss, and a record that a later write moved to another chain's page fails the page header's
key check on load, a miss as well, never wrong KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from pof_connector.index import record_runs

LAYERS = 4
"""Tag layers of a summary: chains whose pages one offset holds at most."""
SENTINEL_SLOT = 0xFFFF_FFFF
"""The slot of a per-page record made from a summary (its slot is in the records, not read yet)."""
UNRESOLVED = -1
"""A generation (int64) whose slot and generation the records have not given yet."""


@dataclass
class Summary:
    marks: int
    layers: int
    tags: dict[int, int]
    """Position (layer * 16 + offset) -> tag."""
    holders: list[tuple[int, int, list[int]]]
    """(incarnation, medium, masks per layer)."""


_HOLDER = [np.dtype([("inc", "<u4"), ("medium", "u1"), ("masks", "<u2", (n,))]) for n in range(1, LAYERS + 1)]


@lru_cache(maxsize=4096)
def _offsets(presence: int) -> tuple[int, ...]:
    """The offsets of a 16-bit presence mask (cached: parsing is the Python decoder's main cost)."""
    return tuple(o for o in range(16) if presence >> o & 1)


def parse_summary(v: bytes) -> Summary | None:
    """``None`` when ``v`` is not a summary (cut short, padded: a broken or hostile writer)."""
    if len(v) < 3 or v[2] > LAYERS or len(v) < 3 + 2 * v[2]:
        return None
    marks, n_layers = int.from_bytes(v[:2], "little"), v[2]
    positions = [layer * 16 + o for layer in range(n_layers)
                 for o in _offsets(int.from_bytes(v[3 + 2 * layer:5 + 2 * layer], "little"))]
    p = 3 + 2 * n_layers
    if len(v) - p < 8 * len(positions):
        return None
    tags = dict(zip(positions, np.frombuffer(v, dtype="<u8", count=len(positions), offset=p).tolist(), strict=True))
    p += 8 * len(positions)
    rest = len(v) - p
    if (n_layers == 0 and rest) or (n_layers and rest % (5 + 2 * n_layers)):
        return None
    holders: list[tuple[int, int, list[int]]] = []
    if n_layers and rest:
        recs = np.frombuffer(v, dtype=_HOLDER[n_layers - 1], offset=p)
        holders = list(zip(recs["inc"].tolist(), recs["medium"].tolist(), recs["masks"].tolist(), strict=True))
    return Summary(marks, n_layers, tags, holders)


def locations(s: Summary) -> int:
    """(holder, page, medium) entries of a summary: the locations it stands for."""
    return sum(bin(m).count("1") for _, _, masks in s.holders for m in masks)


def parse_records(v: bytes | None) -> dict[tuple[int, int, int], tuple[int, int]]:
    """A holder's records of one segment: (medium, layer, offset) -> (slot, generation). A value cut
    short keeps what came before the cut (the rest are misses)."""
    out: dict[tuple[int, int, int], tuple[int, int]] = {}
    p, n = 0, len(v or b"")
    while v is not None and p + 4 <= n:
        medium, layer, mask = v[p], v[p + 1], int.from_bytes(v[p + 2:p + 4], "little")
        p += 4
        for o in range(16):
            if mask >> o & 1:
                if p + 12 > n:
                    return out
                out[medium, layer, o] = (int.from_bytes(v[p:p + 4], "little"), int.from_bytes(v[p + 4:p + 12],
                                                                                             "little", signed=True))
                p += 12
    return out


MediaRuns = tuple[bytes, bytes, bytes, bytes]
"""The heads' runs' media, flat: per head its run's pages (int64s), per head where its stretches start
in the next two (one more int64 at the end), the stretches' first pages (int64s) and their medium codes
(bytes). A stretch is consecutive pages of one code."""


@dataclass(frozen=True)
class Stretches:
    """:data:`MediaRuns` as arrays."""

    pages: np.ndarray
    offsets: np.ndarray
    starts: np.ndarray
    codes: np.ndarray

    @classmethod
    def of(cls, runs: MediaRuns) -> Stretches:
        pages, offsets, starts, codes = runs
        return cls(np.frombuffer(pages, dtype=np.int64), np.frombuffer(offsets, dtype=np.int64),
                   np.frombuffer(starts, dtype=np.int64), np.frombuffer(codes, dtype=np.uint8))

    def media(self, h: int) -> np.ndarray:
        """The medium code of each page of head ``h``'s run."""
        a, b = int(self.offsets[h]), int(self.offsets[h + 1])
        return np.repeat(self.codes[a:b], np.diff(np.append(self.starts[a:b], self.pages[h])))


def summary_runs(vals: Sequence[Any], first_page: np.ndarray, tags: np.ndarray, alive: Sequence[int], n_media: int,
                 segment_pages: int) -> tuple[int, bool, int, bytes, MediaRuns, bytes, np.ndarray]:
    """What the native ``summary_runs`` gives (its docstring in ``_prefix_runs.pyi``), in Python: for
    builds without a C compiler (the same answers, slower)."""
    pages = len(tags)
    limit, malformed = pages, False
    parsed: list[Summary | None] = []
    for s, v in enumerate(vals):
        got = None if v is None else parse_summary(v)
        if v is not None and got is None:
            limit, malformed = max(0, min(pages, int(first_page[s]))), True
            break
        parsed.append(got)
    layer = np.full(pages, 255, dtype=np.uint8)
    marked: list[int] = []
    # Per (incarnation, medium), the query pages it holds as one bit per page of a Python int: a
    # segment's entry costs a shift and an or, not a step per page.
    holds: dict[tuple[int, int], int] = {}
    unknowns: list[tuple[int, int]] = []           # (a segment's first page, its offsets), per unknown entry
    qtags = tags.tolist()
    for s, sm in enumerate(parsed):
        if sm is None:
            continue
        fp = int(first_page[s])
        qmask = [0] * sm.layers
        at = {}                                    # (offset, tag) -> its lowest layer
        for pos in sorted(sm.tags, reverse=True):
            at[pos % 16, sm.tags[pos]] = pos // 16
        for o in range(max(0, -fp), min(segment_pages, limit - fp)):
            q = fp + o
            if sm.marks >> o & 1:
                marked.append(q)
            lay = at.get((o, qtags[q]))
            if lay is not None:
                layer[q] = lay
                qmask[lay] |= 1 << o
        if not any(qmask):
            continue
        for inc, medium, masks in sm.holders:
            offs = 0
            for m, qm in zip(masks, qmask, strict=True):
                offs |= m & qm
            if offs:
                bits = offs << fp if fp >= 0 else offs >> -fp
                holds[inc, medium] = holds.get((inc, medium), 0) | bits
                if medium >= n_media:
                    unknowns.append((fp, offs))          # per entry: a repeat counts again
    covered = 0
    for (_, m), bits in holds.items():
        if m < n_media:
            covered |= bits
    held = min(_ones(covered), limit)
    bound = next((fp + segment_pages for fp in first_page[:len(parsed)].tolist() if fp <= held < fp + segment_pages),
                 limit)
    unknown = sum(bin(offs & ((1 << max(0, min(segment_pages, bound - fp))) - 1)).count("1") for fp, offs in unknowns)
    live = set(alive)
    heads = sorted({inc for (inc, m), bits in holds.items() if m < n_media and inc in live and bits & 1}
                   ) if held else []
    pages_of: list[int] = []
    offsets: list[int] = [0]
    starts: list[int] = []
    codes: list[int] = []
    for inc in heads:
        mine = sorted((m, bits) for (i, m), bits in holds.items() if i == inc and m < n_media)
        union = 0
        for _, bits in mine:
            union |= bits
        run = min(_ones(union), held)
        if len(mine) == 1:
            starts.append(0)
            codes.append(mine[0][0])
        else:                                    # a page in two media: the lowest code, page by page
            last = -1
            for q in range(run):
                m = next(m for m, bits in mine if bits >> q & 1)
                if m != last:
                    starts.append(q)
                    codes.append(m)
                    last = m
        pages_of.append(run)
        offsets.append(len(starts))
    media = (np.array(pages_of, np.int64).tobytes(), np.array(offsets, np.int64).tobytes(),
             np.array(starts, np.int64).tobytes(), bytes(codes))
    return (held, malformed, unknown, np.array(heads, dtype="<u4").tobytes(), media, layer.tobytes(),
            np.array(marked, dtype=np.int64))


def _ones(bits: int) -> int:
    """Trailing one bits of ``bits``: the pages from page 0 held."""
    return ((bits ^ (bits + 1)).bit_length() - 1) if bits >= 0 else 0


def encode_summary(s: Summary) -> bytes:
    """``s`` as the scripts write it (tests build replies with it; the scripts are the writers)."""
    out = bytearray(s.marks.to_bytes(2, "little") + bytes([s.layers]))
    tags = b""
    for layer in range(s.layers):
        presence = 0
        for o in range(16):
            if layer * 16 + o in s.tags:
                presence |= 1 << o
                tags += s.tags[layer * 16 + o].to_bytes(8, "little")
        out += presence.to_bytes(2, "little")
    out += tags
    for inc, medium, masks in s.holders:
        out += inc.to_bytes(4, "little") + bytes([medium])
        out += b"".join(m.to_bytes(2, "little") for m in masks[:s.layers])
    return bytes(out)


def record_slots(vals: list[Any], segs: np.ndarray, base: int, media: np.ndarray, layers: np.ndarray,
                 slots: np.ndarray, gens: np.ndarray) -> None:
    """Fill ``slots`` and ``gens`` (int64, in place) of the pages whose generation is negative from a
    holder's records ``vals`` of segments ``segs`` (query page q is offset (q - base) % 16 of segment
    (q - base) // 16): the record of (its medium, its tag's layer, its offset); without one it stays -1."""
    nat = record_runs._native         # read at each call: tests switch it off
    if nat is not None and hasattr(nat, "record_slots"):
        nat.record_slots(vals, np.ascontiguousarray(segs, dtype=np.int64), base, np.ascontiguousarray(media,
                         dtype=np.uint8), np.ascontiguousarray(layers, dtype=np.uint8), slots, gens)
        return
    for s, v in zip(segs.tolist(), vals, strict=True):
        recs = parse_records(v)
        for o in range(16):
            q = base + 16 * s + o
            if 0 <= q < len(media) and gens[q] < 0 and (got := recs.get((int(media[q]), int(layers[q]), o))):
                slots[q], gens[q] = got


def encode_records(recs: dict[tuple[int, int, int], tuple[int, int]]) -> bytes:
    """A holder's records of one segment as the scripts write them (for tests): the inverse of
    :func:`parse_records`."""
    out = b""
    for medium, layer in sorted({(m, la) for m, la, _ in recs}):
        offs = sorted(o for m, la, o in recs if (m, la) == (medium, layer))
        out += bytes([medium, layer]) + sum(1 << o for o in offs).to_bytes(2, "little")
        out += b"".join(recs[medium, layer, o][0].to_bytes(4, "little")
                        + recs[medium, layer, o][1].to_bytes(8, "little", signed=True) for o in offs)
    return out
