"""A memory-only pool node (``pof memd``): tiers, a NIXL agent and heartbeats, no engine.

It contributes its CPU-DRAM / CXL capacity to the cluster: it registers its tiers over NIXL,
publishes them in the index with ``fabric.lend`` set, grants slots to spilling writers with
leases, and reclaims the slots whose lease ended. It stores no page of its own.

Its slots must hold the writers' pages: ``slot_bytes`` is at least their page size (a region
with smaller slots is ignored by writers), so a memory node serves one page geometry, typically
one model's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading

from pof_connector.config import ConfigError, PofConfig, format_size
from pof_connector.pages.layout import PageSpec, header_bytes_for
from pof_connector.pool.pool import Pool

log = logging.getLogger("pof_connector.memd")     # its name before the move to pool/: filters keep working

ROLE_KEY = "pof.role"
"""Node meta: ``"memory"`` for a memory node (``pof stats`` shows it)."""
NAMESPACE = hashlib.sha256(b"pof memory node").digest()[:16]
"""A memory node has no model: its own (unused) key namespace."""


def memory_spec(slot_bytes: int) -> PageSpec:
    """The geometry whose pages fill a slot of ``slot_bytes`` exactly (one segment)."""
    segment = slot_bytes - header_bytes_for(1)
    if segment < 1:
        raise ConfigError(f"--slot-size: {slot_bytes} bytes cannot hold a page header "
                          f"({header_bytes_for(1)} bytes); allowed: a writer's page size, e.g. 2MiB")
    return PageSpec(num_layers=1, segment_bytes=segment, page_tokens=1)


class MemoryNode:
    """Runs until :meth:`stop`; the pool's heartbeat thread does the work (heartbeats, reclaims),
    control messages are served by the fabric's notifier thread."""

    def __init__(self, config: PofConfig, slot_bytes: int) -> None:
        fabric = config.fabric
        if not fabric.enabled:
            raise ConfigError("fabric.enabled: a memory node serves its tiers over the fabric; "
                              "allowed: true for pof memd")
        if fabric.spill_lease_s <= 2 * fabric.timeout_s:
            raise ConfigError(f"fabric.spill_lease_s: expected a number > 2 * fabric.timeout_s "
                              f"({2 * fabric.timeout_s}), got {fabric.spill_lease_s}")
        # A memory node always lends: that is what it is for, whatever fabric.spill says.
        config = dataclasses.replace(config, fabric=dataclasses.replace(fabric, spill=True))
        self.config = config
        self.pool = Pool(config, memory_spec(slot_bytes), NAMESPACE, meta={ROLE_KEY: "memory"})
        self._stop = threading.Event()
        tiers = ", ".join(f"{t.medium} {format_size(t.capacity_slots * t.slot_bytes)} "
                          f"({t.capacity_slots} slots of {format_size(t.slot_bytes)})" for t in self.pool.tiers)
        log.info("pof memd: node %s serves %s over NIXL agent %s; index %s; leases up to %gs",
                 config.node_id, tiers, self.pool.meta.get("fabric.agent"), config.index_url,
                 fabric.spill_lease_s)

    def usage(self) -> dict[str, tuple[int, int, int]]:
        """Per medium: (slots lent, capacity in slots, writers holding leases)."""
        fabric = self.pool.fabric
        lent = {} if fabric is None or fabric.lender is None else fabric.lender.usage()
        return {t.medium: (lent.get(t.medium, (0, 0))[0], t.capacity_slots, lent.get(t.medium, (0, 0))[1])
                for t in self.pool.tiers}

    def run(self, report_s: float = 10.0) -> None:
        """Serve until :meth:`stop`, logging the occupancy when it changed (at most every ``report_s``)."""
        last: dict[str, tuple[int, int, int]] | None = None
        while not self._stop.wait(report_s):
            now = self.usage()
            if now != last:
                log.info("pof memd: %s", "; ".join(f"{m} {lent}/{cap} slots lent to {w} writer(s)"
                                                   for m, (lent, cap, w) in now.items()))
                last = now

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        """Leave the index and release the tiers (granted slots are gone with them)."""
        self.pool.close()
        log.info("pof memd: node %s stopped", self.config.node_id)
