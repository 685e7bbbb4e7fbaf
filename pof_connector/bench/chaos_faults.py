"""The faults of ``pof bench chaos``, injected from a seeded schedule while traffic runs.

Each kind is a method of :class:`Faults` that breaks something, waits until the break has had its
effect, repairs what an operator (or systemd) would repair, and returns a :class:`FaultRecord`.
While a fault takes a process down on purpose, its name is in ``cluster.planned_down``: a process
found dead at any other time is an unplanned crash.
"""

from __future__ import annotations

import os
import random
import signal
import struct
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pof_connector.bench.chaos import Cluster

KINDS = ("memd_kill", "index_restart", "flip_bytes", "tier_file_delete", "peer_stop", "link_cut",
         "eviction_storm", "vllm_restart")

FLIPPED_SLOTS = 8
"""Slots corrupted per flip_bytes fault: enough that a page a request loads is likely among them."""
_SUPER = struct.Struct("<8sIIQQQQ16s")   # the CXL region's superblock (pof_connector/tiers/cxl.py)


@dataclass
class FaultRecord:
    kind: str
    at_s: float
    end_s: float = 0.0
    detail: str = ""
    skipped: str = ""
    stats: dict[str, Any] = field(default_factory=dict)


def schedule(seed: int, rounds: int, duration_s: float, start_s: float,
             kinds: tuple[str, ...] = KINDS) -> list[tuple[float, str]]:
    """``rounds`` of each of ``kinds`` in a seeded random order, spread over ``duration_s`` after
    ``start_s`` with jitter: (time, kind) in time order."""
    rnd = random.Random(seed)
    planned: list[str] = []
    for _ in range(rounds):
        order = list(kinds)
        rnd.shuffle(order)
        planned += order
    gap = duration_s / (len(planned) + 1)
    return [(start_s + (i + 1) * gap + rnd.uniform(-gap / 4, gap / 4), k) for i, k in enumerate(planned)]


class Faults:
    def __init__(self, cluster: Cluster, seed: int) -> None:
        self.c = cluster
        self.rnd = random.Random(seed + 1)
        self._restarts = 0

    def inject(self, kind: str, at_s: float) -> FaultRecord:
        record = FaultRecord(kind, at_s)
        getattr(self, kind)(record)
        record.end_s = self.c.now()
        return record

    def _hold(self) -> float:
        """Long enough that every read of a stalled peer times out, twice."""
        return 2 * self.c.fabric_timeout_s + 1.0

    # ---- the kinds -----------------------------------------------------------------------

    def memd_kill(self, r: FaultRecord) -> None:
        with self.c.planned("memd"):
            self.c.memd.kill()
            time.sleep(1.0)
            self.c.start_memd()
        r.detail = "SIGKILL, restarted after 1 s"

    def index_restart(self, r: FaultRecord) -> None:
        with self.c.planned("index"):
            self.c.redis.stop()
            time.sleep(2.0)
            self.c.redis.start()
        r.detail = "index server stopped for 2 s, restarted empty (owners publish again)"

    def flip_bytes(self, r: FaultRecord) -> None:
        # A region just re-made (after a removal or a restart) holds nothing yet: wait for pages.
        deadline = time.monotonic() + 60
        live = {p: live_slots(p) for p in self.c.region_files() if p.exists()}
        while not any(live.values()) and time.monotonic() < deadline:
            time.sleep(2)
            live = {p: live_slots(p) for p in self.c.region_files() if p.exists()}
        if not any(live.values()):
            r.skipped = "no written slot in any region file for 60 s"
            return
        path = max(live, key=lambda p: len(live[p]))        # where most pages are, so one is likely read
        flipped = flip_live_slots(path, self.rnd, slots=FLIPPED_SLOTS)
        r.detail = f"{path.name}: flipped one bit in each of slots {flipped}"

    def tier_file_delete(self, r: FaultRecord) -> None:
        # Alternately the memory node's region (its supervisor restarts it) and the engines' shared
        # region (they keep serving from their other tiers until they restart).
        memd_turn = self.rnd.random() < 0.5 or not self.c.shared_region.exists()
        if memd_turn:
            self.c.memd_region.unlink(missing_ok=True)
            time.sleep(self._hold())
            with self.c.planned("memd"):
                self.c.memd.stop(grace_s=10)
                self.c.start_memd()
            r.detail = f"removed {self.c.memd_region.name}; memd restarted {self._hold():.0f} s later"
        else:
            self.c.shared_region.unlink()
            time.sleep(self._hold())
            r.detail = f"removed {self.c.shared_region.name} (the engines' shared CXL region)"

    def peer_stop(self, r: FaultRecord) -> None:
        hold = self._hold()
        pid = self.c.memd.pid
        assert pid is not None, "memd is not running"
        with self.c.planned("memd"):
            os.killpg(pid, signal.SIGSTOP)
            try:
                time.sleep(hold)
            finally:
                os.killpg(pid, signal.SIGCONT)
        r.detail = f"memd SIGSTOPped for {hold:.0f} s (fabric.timeout_s {self.c.fabric_timeout_s:g})"

    def link_cut(self, r: FaultRecord) -> None:
        if self.c.netns is None:
            r.skipped = self.c.netns_why
            return
        ns, dev = self.c.netns
        hold = self._hold()
        subprocess.run(["ip", "-n", ns, "link", "set", dev, "down"], check=True, timeout=10)
        try:
            time.sleep(hold)
        finally:
            subprocess.run(["ip", "-n", ns, "link", "set", dev, "up"], check=True, timeout=10)
        r.detail = f"memd's link {dev} down for {hold:.0f} s"

    def eviction_storm(self, r: FaultRecord) -> None:
        n = self.c.storm_requests()
        self.c.sessions.storm(n)
        deadline = time.monotonic() + 900
        while self.c.sessions.storming() and time.monotonic() < deadline:
            time.sleep(0.5)
        r.detail = f"{n} unique prompts of {self.c.sessions.storm_tokens} tokens (more than every tier holds)"

    def vllm_restart(self, r: FaultRecord) -> None:
        i = self._restarts % len(self.c.servers)
        self._restarts += 1
        name = f"n{i}"
        with self.c.planned(name):
            self.c.kill_server(i)
            t0 = time.monotonic()
            self.c.start_server(i)
        r.detail = f"{name} SIGKILLed, back in {time.monotonic() - t0:.0f} s"


def _geometry(f: Any) -> tuple[int, int, int, int] | None:
    """(slot_bytes, num_slots, gens_at, data_at) of an open region file; None if it has no superblock."""
    raw = f.read(_SUPER.size)
    if len(raw) < _SUPER.size:
        return None
    _, _, _, slot_bytes, num_slots, gens_at, data_at, _ = _SUPER.unpack(raw)
    return slot_bytes, num_slots, gens_at, data_at


def live_slots(path: Path) -> list[int]:
    """Slots of a region file that were ever written (generation not 0)."""
    with open(path, "rb") as f:
        geometry = _geometry(f)
        if geometry is None:
            return []
        _, num_slots, gens_at, _ = geometry
        f.seek(gens_at)
        gens = struct.unpack(f"<{num_slots}Q", f.read(8 * num_slots))
    return [i for i, g in enumerate(gens) if g]


def flip_live_slots(path: Path, rnd: random.Random, slots: int) -> list[int]:
    """Flip one random bit in each of up to ``slots`` random slots that were ever written, through
    the file: as a stray write or a bad DIMM would."""
    live = live_slots(path)
    chosen = rnd.sample(live, min(slots, len(live)))
    with open(path, "r+b") as f:
        geometry = _geometry(f)
        if geometry is None:
            return []
        slot_bytes, _, _, data_at = geometry
        for s in chosen:
            at = data_at + s * slot_bytes + rnd.randrange(slot_bytes)
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ (1 << rnd.randrange(8))]))
    return sorted(chosen)
