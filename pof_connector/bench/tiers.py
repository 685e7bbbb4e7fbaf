"""``pof bench tiers``: page store and load through a tier, against plain memcpy.

The workload is what a pool node does all day: put pages into a tier that is too small, so
half of them are evicted and their slots reused, then load every page still there. "Ours"
goes through the :class:`~pof_connector.tiers.Tier` API (slot books, generations, checksums,
the seqlock-style header write, pin/unpin on read). The baseline replays the very same slots
and buffers with nothing but ``numpy.copyto``: the cost of the bytes alone. The ratio of the
two is what the bookkeeping and validation cost, independent of how fast this host's memory is.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from pof_connector.bench import BenchError, Progress, geomean, quiet
from pof_connector.config import TierConfig, format_size
from pof_connector.pages.keys import DIGEST_BYTES, NAMESPACE_BYTES, PageKey
from pof_connector.pages.layout import PageSpec
from pof_connector.tiers import CpuDramTier, CxlTier, Tier

Buffer = npt.NDArray[np.uint8]

MEDIA = ("cpu_dram", "cxl")
DEFAULT_SIZES = (64 << 10, 256 << 10, 1 << 20, 2 << 20)
DEFAULT_TIER_SIZE = 256 << 20
NUM_LAYERS = 8
PAGE_TOKENS = 64
BUFFERS = 32
"""Distinct source pages and destination buffers: more than one, so caches do not flatter either side."""
BASELINE = "numpy.copyto of the same bytes, same slots, same run"


@dataclass(frozen=True)
class Plan:
    """The slots one put+get pass used, in order; the baseline replays exactly these."""

    put_slots: list[int]
    get_slots: list[int]


@dataclass(frozen=True)
class Row:
    """One (medium, page size) result; ``ratio`` = ours GB/s / memcpy GB/s (1.0 = free bookkeeping)."""

    medium: str
    page_bytes: int
    slots: int
    pages_put: int
    pages_got: int
    bytes: int
    ours_s: float
    memcpy_s: float

    @property
    def ratio(self) -> float:
        return self.memcpy_s / self.ours_s

    def to_json(self) -> dict[str, object]:
        return {
            "medium": self.medium, "page_bytes": self.page_bytes, "page_size": format_size(self.page_bytes),
            "slots": self.slots, "pages_put": self.pages_put, "pages_got": self.pages_got, "bytes": self.bytes,
            "ours_s": round(self.ours_s, 6), "memcpy_s": round(self.memcpy_s, 6),
            "ours_gbps": round(self.bytes / self.ours_s / 1e9, 3),
            "memcpy_gbps": round(self.bytes / self.memcpy_s / 1e9, 3),
            "ratio": round(self.ratio, 4),
        }


@dataclass(frozen=True)
class Buffers:
    """Source layer segments (``sources[i][layer]``) and destination pages of one page size."""

    sources: list[list[Buffer]]
    dsts: list[Buffer]


def run(
    media: Sequence[str] = MEDIA,
    sizes: Sequence[int] = DEFAULT_SIZES,
    tier_size: int = DEFAULT_TIER_SIZE,
    repeat: int = 3,
    progress: Progress = quiet,
) -> dict[str, Any]:
    """Every (medium, page size) row and the headline ratios, as ``--json`` prints them."""
    _check_args(media, sizes, repeat)
    rows = [_row(medium, size, tier_size, repeat, progress) for medium in media for size in sizes]
    ratios = [row.ratio for row in rows]
    return {
        "bench": "tiers",
        "ratio": round(geomean(ratios), 4),
        "min_ratio": round(min(ratios), 4),
        "rows": [row.to_json() for row in rows],
        "baseline": BASELINE,
        "tier_size": tier_size,
        "repeat": repeat,
    }


def _check_args(media: Sequence[str], sizes: Sequence[int], repeat: int) -> None:
    unknown = [m for m in media if m not in MEDIA]
    if unknown or not media:
        raise BenchError(f"--media: unknown {unknown or 'empty list'}; allowed: {', '.join(MEDIA)}")
    small = [s for s in sizes if s < NUM_LAYERS]
    if small or not sizes:
        raise BenchError(f"--sizes: each page must be at least {NUM_LAYERS} bytes (one per layer), got "
                         f"{small or 'an empty list'}")
    if repeat < 1:
        raise BenchError(f"--repeat: expected at least 1, got {repeat}")


def _row(medium: str, size: int, tier_size: int, repeat: int, progress: Progress) -> Row:
    """Best-of-``repeat`` times of ours and the baseline, run alternately on one tier."""
    spec = PageSpec(num_layers=NUM_LAYERS, segment_bytes=size // NUM_LAYERS, page_tokens=PAGE_TOKENS)
    buffers = _buffers(spec)
    with _tier(medium, spec, tier_size) as tier:
        tier.region.fill(0)       # fault the region in now, or the first timed pass pays for it
        slots = tier.capacity_slots
        progress(f"tiers: {medium} {format_size(size)} pages, {slots} slots, {repeat} x put+get of "
                 f"{2 * slots} pages")
        ours_s, base_s = float("inf"), float("inf")
        plan = Plan([], [])
        for r in range(repeat):
            keys = _keys(2 * slots, salt=r)
            elapsed, plan = _ours(tier, keys, buffers)
            ours_s = min(ours_s, elapsed)
            base_s = min(base_s, _baseline(tier, plan, buffers))
    payload = spec.num_layers * spec.segment_bytes
    moved = payload * (len(plan.put_slots) + len(plan.get_slots))
    return Row(medium, size, slots, len(plan.put_slots), len(plan.get_slots), moved, ours_s, base_s)


@contextmanager
def _tier(medium: str, spec: PageSpec, size: int) -> Iterator[Tier]:
    """A fresh tier; a CXL one lives in a temporary file under /dev/shm that is removed after."""
    if medium == "cpu_dram":
        yield CpuDramTier(spec, size)
        return
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="pof-bench-", dir=shm) as tmp:
        # One partition: this process may write every slot, like the DRAM tier.
        config = TierConfig("cxl", size, path=os.path.join(tmp, "region.cxl"), partition=0, partitions=1)
        tier = CxlTier(spec, config, os.path.join(tmp, "run"))
        try:
            yield tier
        finally:
            tier.close()


def _buffers(spec: PageSpec) -> Buffers:
    """Random source pages cut into layer views, and zeroed (already faulted-in) destinations."""
    rng = np.random.default_rng(0)
    seg = spec.segment_bytes
    pool = rng.integers(0, 256, size=(BUFFERS, spec.num_layers * seg), dtype=np.uint8)
    sources = [[pool[i, layer * seg:(layer + 1) * seg] for layer in range(spec.num_layers)]
               for i in range(BUFFERS)]
    dsts = np.empty((BUFFERS, spec.page_bytes), dtype=np.uint8)
    dsts.fill(0)
    return Buffers(sources, list(dsts))


def _keys(n: int, salt: int) -> list[PageKey]:
    """``n`` distinct keys; a new ``salt`` per pass, so no key of an earlier pass is still stored."""
    namespace = salt.to_bytes(NAMESPACE_BYTES, "little")
    return [PageKey(namespace, i.to_bytes(DIGEST_BYTES, "little")) for i in range(n)]


def _ours(tier: Tier, keys: list[PageKey], buffers: Buffers) -> tuple[float, Plan]:
    """Put every key through the Tier API, then get every key still stored; returns the time."""
    sources, dsts = buffers.sources, buffers.dsts
    put_slots: list[int] = []
    get_slots: list[int] = []
    t0 = time.perf_counter()
    for i, key in enumerate(keys):
        got = tier.prepare_store(key)
        if got is None:
            raise BenchError(f"{tier.medium}: prepare_store found no slot for page {i}")
        ref = got[0]
        tier.write(ref, key, sources[i % BUFFERS])
        tier.complete_store(key, True)
        put_slots.append(ref.slot)
    for key in keys:
        found = tier.find(key, pin=True)
        if found is None:
            continue          # evicted by a later put
        try:
            tier.read(found, key, dsts[len(get_slots) % BUFFERS])
        finally:
            tier.unpin(found.slot)
        get_slots.append(found.slot)
    elapsed = time.perf_counter() - t0
    if len(get_slots) != tier.capacity_slots:
        raise BenchError(f"{tier.medium}: read back {len(get_slots)} pages, the tier holds {tier.capacity_slots}")
    return elapsed, Plan(put_slots, get_slots)


def _baseline(tier: Tier, plan: Plan, buffers: Buffers) -> float:
    """The same bytes, slots and buffers as :func:`_ours`, moved by ``np.copyto`` alone."""
    spec = tier.spec
    region, sources, dsts = tier.region, buffers.sources, buffers.dsts
    seg, page = spec.segment_bytes, spec.page_bytes
    offsets = [spec.segment_offset(layer) for layer in range(spec.num_layers)]
    t0 = time.perf_counter()
    for i, slot in enumerate(plan.put_slots):
        base = tier.slot_offset(slot)
        for off, src in zip(offsets, sources[i % BUFFERS], strict=True):
            np.copyto(region[base + off:base + off + seg], src)
    for j, slot in enumerate(plan.get_slots):
        base = tier.slot_offset(slot)
        np.copyto(dsts[j % BUFFERS], region[base:base + page])
    return time.perf_counter() - t0
