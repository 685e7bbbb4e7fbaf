"""A node's view of the live prefix pins: what its tiers ask on eviction, kept in step with the index."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pof_connector.index import LocalityIndex
from pof_connector.pages.keys import PageKey
from pof_connector.pins.pin import HARD, Pin, PinError
from pof_connector.tiers.slot_table import KEEP_HARD, KEEP_NONE, KEEP_SOFT

log = logging.getLogger("pof_connector.pool")
SYNC_EVERY_S = 2.0
"""How often a node reads the index's pins (a new pin holds on a node from its next read on)."""


class PinBook:
    """The pins a node knows: :meth:`keep` answers the tiers (under their locks: a dict read),
    :meth:`sync` reads the index's pins, drops expired ones and writes back the ones the index
    lost (an index restart), so pins outlive the index's and the nodes' restarts alike."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._pins: dict[str, Pin] = {}
        self._levels: dict[PageKey, int] = {}
        self._expiry = float("inf")        # the earliest end of a pin known: rebuild the levels then
        self._next_sync = 0.0
        self._lock = threading.Lock()

    def keep(self, key: PageKey) -> int:
        if self._clock() >= self._expiry:
            self._rebuild()
        return self._levels.get(key, KEEP_NONE)

    def pins(self) -> list[Pin]:
        with self._lock:
            return list(self._pins.values())

    def set(self, pins: list[Pin]) -> None:
        """Replace the known pins with ``pins`` (expired ones left out)."""
        with self._lock:
            self._pins = {p.pin_id: p for p in pins}
        self._rebuild()

    def due(self) -> bool:
        """Whether :data:`SYNC_EVERY_S` passed since the last :meth:`sync`."""
        return self._clock() >= self._next_sync

    def sync(self, index: LocalityIndex, *, write_back: bool = False) -> None:
        """Adopt the index's live pins; with ``write_back`` (the index lost its data), pins this
        node knew that the index lacks are written back to it (without it, a pin missing from the
        index was removed: a removal through the API is a removal, not a loss). Raises
        ``IndexUnavailable``."""
        now = self._clock()
        self._next_sync = now + SYNC_EVERY_S
        found: dict[str, Pin] = {}
        for pin_id, raw in index.pins().items():
            try:
                pin = Pin.from_json(raw)
            except PinError as e:
                log.warning("pof: ignoring a pin record in the index: %s", e)
                continue
            if pin.pin_id != pin_id:
                continue
            if pin.live(now):
                found[pin_id] = pin
            else:
                index.remove_pin(pin_id)          # its time is up: whoever reads it first tidies up
        if write_back:
            for pin in self.pins():
                if pin.live(now) and pin.pin_id not in found:
                    index.put_pin(pin.pin_id, pin.to_json())
                    found[pin.pin_id] = pin
        self.set(list(found.values()))

    def _rebuild(self) -> None:
        now = self._clock()
        with self._lock:
            self._pins = {i: p for i, p in self._pins.items() if p.live(now)}
            levels: dict[PageKey, int] = {}
            for p in self._pins.values():
                level = KEEP_HARD if p.kind == HARD else KEEP_SOFT
                for k in p.keys:
                    if levels.get(k, KEEP_NONE) < level:
                        levels[k] = level
            self._levels = levels
            self._expiry = min((p.expires_at for p in self._pins.values()), default=float("inf"))
