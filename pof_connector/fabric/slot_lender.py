"""The owner's side of spill: free slots of this node's tiers granted to other nodes' writers.

A grant is a lease. The owner bumps each slot's generation and zeroes its live generation word
before granting (:meth:`pof_connector.tiers.Tier.lend`); the writer writes the page with NIXL
WRITEs, its header's generation word last, and publishes the location in the index itself. The
owner only keeps the lease: when it ends without a renewal the slot is reclaimed — invalidated
first, so a reader still following the index misses — and free for the next grant.

After writing, the writer also tells the owner which page each slot holds (a ``written``
message), so the owner can withdraw the index entry of a slot it reclaims: a writer that died
leaves no entry behind that only leads readers to a miss.

The owner gives the lease one ``grace_s`` more than the writer counts with (the writer stops
writing one timeout before its end), so a write in time never meets a reclaimed slot; a write
that is late anyway lands in a slot whose generation moved on and is rejected by readers.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pof_connector.fabric.notifier import Message
from pof_connector.index import Location
from pof_connector.index.guarded import LogOnce
from pof_connector.pages.keys import PageKey
from pof_connector.tiers import Tier

log = logging.getLogger(__name__)

MAX_GRANT = 256
"""Most slots one request may ask for."""
MAX_SLOTS_NAMED = 4096
"""Most slots one renew, release or written message may name (writers send at most 1,000)."""
REFUSALS = ("malformed", "unauthorized", "not_leased", "writer_cap")
"""Why a message or part of one was refused (:attr:`SlotLender.refused`): not a valid request;
not from a live pool node's current agent; naming slots not leased to that writer; a grant over
the writer's share (``fabric.max_lent_fraction_per_writer``)."""


@dataclass
class Lease:
    """Slot ``slot`` of ``medium`` lent to ``writer`` (a node id) with ``generation`` until
    ``expires`` (monotonic); ``key`` is the page the writer says it put there (``None``: not
    said yet)."""

    writer: str
    medium: str
    slot: int
    generation: int
    expires: float
    key: PageKey | None = None


class SlotLender:
    """Leases of this node's free slots. ``authorize(writer node, sender agent)`` says whether a
    request really comes from that node's current agent (a live pool node in the index) and makes
    sure we can answer it (its metadata loaded); a request it refuses gets no reply at all (the
    writer times out). ``max_lent_fraction``: the most of a tier's slots one writer may hold.
    Every refusal is counted in :attr:`refused` (by :data:`REFUSALS` reason) and logged once."""

    def __init__(self, node_id: str, tiers: Sequence[Tier], lease_s: float, grace_s: float,
                 authorize: Callable[[str, str], bool], max_lent_fraction: float = 1.0) -> None:
        self.node_id = node_id
        self._tiers = {t.medium: t for t in tiers}
        self.lease_s = lease_s
        self.grace_s = grace_s
        self.max_lent_fraction = max_lent_fraction
        self._authorize = authorize
        self._leases: dict[tuple[str, int], Lease] = {}      # (medium, slot) → lease
        self._lock = threading.Lock()
        self.granted_total = 0
        self.reclaimed_total = 0
        self.refused: dict[str, int] = dict.fromkeys(REFUSALS, 0)
        self._log_once = LogOnce(log)

    # ---- the verbs ---------------------------------------------------------------------------

    def can_grant(self, medium: str, n: int = 1) -> bool:
        tier = self._tiers.get(medium)
        return tier is not None and n >= 1 and tier.free_slots >= n

    def grant(self, writer: str, medium: str, n: int, lease_s: float) -> list[tuple[int, int]]:
        """Lend up to ``n`` free slots of ``medium`` for ``min(lease_s, spill_lease_s)``; returns
        (slot, generation) pairs, empty when the tier is full (our own pages are never evicted
        for a grant)."""
        tier = self._tiers.get(medium)
        if tier is None or n < 1:
            return []
        expires = time.monotonic() + min(lease_s, self.lease_s) + self.grace_s
        with self._lock:
            share = max(1, int(self.max_lent_fraction * tier.num_slots))
            held = sum(1 for lease in self._leases.values() if lease.writer == writer and lease.medium == medium)
            if held >= share:
                self._refuse("writer_cap", "%s already holds %d of %s's %d %s slots (its share: "
                             "fabric.max_lent_fraction_per_writer %g); granted nothing more", writer, held,
                             self.node_id, tier.num_slots, medium, self.max_lent_fraction)
                return []
            refs = tier.lend(min(n, MAX_GRANT, share - held))
            for ref in refs:
                self._leases[(medium, ref.slot)] = Lease(writer, medium, ref.slot, ref.generation, expires)
            self.granted_total += len(refs)
        return [(r.slot, r.generation) for r in refs]

    def renew(self, writer: str, medium: str, slots: Sequence[int], lease_s: float) -> list[int]:
        """Extend ``writer``'s leases of ``slots``; returns those renewed (a slot already reclaimed
        or lent to someone else is not: the writer withdraws it)."""
        expires = time.monotonic() + min(lease_s, self.lease_s) + self.grace_s
        renewed = []
        with self._lock:
            for slot in slots:
                lease = self._leases.get((medium, slot))
                if lease is not None and lease.writer == writer:
                    lease.expires = expires
                    renewed.append(slot)
        self._not_leased(writer, "renew", len(slots) - len(renewed))
        return renewed

    def release(self, writer: str, medium: str, slots: Sequence[int]) -> int:
        """The writer no longer needs ``slots``: reclaim them now."""
        with self._lock:
            mine = [s for s in slots if (lease := self._leases.get((medium, s))) is not None and lease.writer == writer]
            for s in mine:
                del self._leases[(medium, s)]
        for s in mine:
            self._tiers[medium].take_back(s)
        self._not_leased(writer, "release", len(slots) - len(mine))
        return len(mine)

    def written(self, writer: str, medium: str, pages: Sequence[tuple[int, PageKey]]) -> int:
        """``writer`` put these pages into these slots of its leases; returns how many it holds."""
        n = 0
        with self._lock:
            for slot, key in pages:
                lease = self._leases.get((medium, slot))
                if lease is not None and lease.writer == writer:
                    lease.key = key
                    n += 1
        self._not_leased(writer, "written", len(pages) - n)
        return n

    def reclaim_expired(self) -> list[tuple[PageKey, Location]]:
        """Invalidate and free every slot whose lease ended; returns the index entries of the
        pages that were in them (the writer published them as ours: withdraw them)."""
        now = time.monotonic()
        with self._lock:
            ended = [lease for lease in self._leases.values() if lease.expires <= now]
            for lease in ended:
                del self._leases[(lease.medium, lease.slot)]
            self.reclaimed_total += len(ended)
        for lease in ended:
            self._tiers[lease.medium].take_back(lease.slot)
        if ended:
            log.info("pof spill: reclaimed %d slot(s) whose lease ended (%s)", len(ended),
                     ", ".join(sorted({lease.writer for lease in ended})))
        return [(lease.key, Location(self.node_id, lease.medium, lease.slot, lease.generation))
                for lease in ended if lease.key is not None]

    def reclaim_all(self) -> None:
        """Take every lent slot back (closing)."""
        with self._lock:
            leases = list(self._leases.values())
            self._leases.clear()
        for lease in leases:
            self._tiers[lease.medium].take_back(lease.slot)

    def usage(self) -> dict[str, tuple[int, int]]:
        """Per medium: (slots lent now, writers holding leases)."""
        with self._lock:
            leases = list(self._leases.values())
        out: dict[str, tuple[int, int]] = {}
        for medium in self._tiers:
            mine = [lease for lease in leases if lease.medium == medium]
            out[medium] = (len(mine), len({lease.writer for lease in mine}))
        return out

    # ---- messages (see :mod:`.notifier`) -------------------------------------------------------

    def handle(self, sender: str, message: Mapping[str, object]) -> Message | None:
        """Answer a ``grant``, ``renew`` or ``release`` request; ``None`` for what is not ours to
        answer (unknown op, malformed, or not from the node's current agent)."""
        op, writer, medium = message.get("op"), message.get("node"), message.get("medium")
        lease_s = message.get("lease_s", self.lease_s)
        if (op not in ("grant", "renew", "release", "written") or not isinstance(writer, str)
                or not isinstance(medium, str) or medium not in self._tiers or isinstance(lease_s, bool)
                or not isinstance(lease_s, (int, float)) or not math.isfinite(lease_s) or lease_s <= 0):
            return self._malformed(sender, message)
        if not self._authorize(writer, sender):
            self._refuse("unauthorized", "ignored a %s request from %s (not the current agent of a live pool "
                         "node %r, or unreachable)", op, sender, writer)
            return None
        if op == "grant":
            n = message.get("n")
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                return self._malformed(sender, message)
            slots = self.grant(writer, medium, n, float(lease_s))
            if slots:
                log.debug("pof spill: lent %d %s slot(s) to %s", len(slots), medium, writer)
            return {"slots": slots, "lease_s": min(float(lease_s), self.lease_s)}
        if op == "written":
            got = _pages(message.get("pages"))
            if got is None:
                return self._malformed(sender, message)
            pages, bad = got
            if bad:
                self._refuse("malformed", "skipped %d malformed item(s) of a written message from %s", bad, sender)
            return {"written": self.written(writer, medium, pages)}
        raw = message.get("slots")
        if (not isinstance(raw, list) or len(raw) > MAX_SLOTS_NAMED
                or not all(isinstance(s, int) and not isinstance(s, bool) for s in raw)):
            return self._malformed(sender, message)
        if op == "renew":
            return {"slots": self.renew(writer, medium, raw, float(lease_s)),
                    "lease_s": min(float(lease_s), self.lease_s)}
        return {"released": self.release(writer, medium, raw)}


    def _malformed(self, sender: str, message: Mapping[str, object]) -> Message | None:
        """Count and log a malformed request; ``None``: it gets no reply."""
        self._refuse("malformed", "ignored a malformed %r request from %s", message.get("op"), sender)
        return None

    def _not_leased(self, writer: str, op: str, n: int) -> None:
        if n > 0:
            self.refused["not_leased"] += n
            self._log_once("refused-not_leased", logging.WARNING, "pof spill: a %s from %s named %d slot(s) not "
                           "leased to it; refused. Further ones are counted in refused[not_leased]", op, writer, n)

    def _refuse(self, reason: str, fmt: str, *args: object) -> None:
        self.refused[reason] += 1
        self._log_once(f"refused-{reason}", logging.WARNING, "pof spill: " + fmt + ". Further ones are counted in "
                       f"refused[{reason}]", *args)


def _pages(raw: object) -> tuple[list[tuple[int, PageKey]], int] | None:
    """Decode a ``written`` message's ``[[slot, *PageKey.wire()], ...]``: the good items and how
    many were not (skipped); ``None`` when it is no such list."""
    if not isinstance(raw, list) or len(raw) > MAX_SLOTS_NAMED:
        return None
    out = []
    for item in raw:
        if not isinstance(item, list) or not item or isinstance(item[0], bool) or not isinstance(item[0], int):
            continue
        try:
            out.append((item[0], PageKey.from_wire(item[1:])))
        except ValueError:
            continue
    return out, len(raw) - len(out)
