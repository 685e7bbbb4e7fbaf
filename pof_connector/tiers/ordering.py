"""The memory-ordering assumption of the tier seqlock, stated and checked.

A tier's writer zeroes a slot's live generation, writes the segments, then writes the header
with the new generation last; a reader copies the header, then the segments, then re-reads the
live generation (:mod:`pof_connector.tiers.base`). These are plain ``numpy`` stores and loads:
nothing issues a fence. The protocol is sound only where the CPU keeps stores in program order
and loads in program order, i.e. total store order: x86 and x86-64. (glibc's ``memcpy``, which
``numpy`` copies go through, ends its non-temporal store loop with ``sfence``, so big copies keep
that order too.) ARM and POWER reorder both: a reader there, or a writer there read by anyone,
could see the new generation before the new segment bytes and accept a torn page with every
check passing. Those need release/acquire fences around the generation word, and Python offers
no documented full barrier that ``numpy`` code could issue (``threading`` locks order only
accesses made under the same lock), so tiers refuse to start on such CPUs rather than risk it.
"""

from __future__ import annotations

import platform

TSO_MACHINES = frozenset({"x86_64", "amd64", "x64", "i386", "i486", "i586", "i686", "x86"})
"""``platform.machine()`` names (lower-cased) of CPUs with total store order."""


class UnsupportedPlatform(RuntimeError):
    """The CPU's memory model does not give the ordering the tier seqlock relies on."""


def require_store_order() -> None:
    """Raise :class:`UnsupportedPlatform` unless this CPU is x86 (total store order)."""
    machine = platform.machine()
    if machine.lower() in TSO_MACHINES:
        return
    raise UnsupportedPlatform(
        f"pof tiers need an x86-64 CPU; this one is {machine or 'unknown'!r}. The page seqlock (generation "
        f"zeroed, segments written, header with the generation written last; readers re-check the "
        f"generation after copying) uses plain numpy loads and stores and relies on x86's total store "
        f"order. ARM and POWER reorder stores and loads, and numpy issues no fences, so a reader could "
        f"accept a torn page with every check passing; refusing to create the tier instead.")
