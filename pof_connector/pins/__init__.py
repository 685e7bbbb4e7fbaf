"""Prefix pins: a prompt prefix kept in the pool for a while (see :mod:`.pin`).

* :mod:`.pin` — a pin and its record in the index; :mod:`.pin_book` — a node's pinned slots (the
  pool's membership keeps them); :mod:`.pin_desk` — creating and listing pins (``pof pin``, the
  locality API's pin routes); :mod:`.cli` — the ``pof pin`` command.

May import: ``index``, ``pages``, ``tiers.slot_table``, ``locality`` and ``cli_support``. Never the pool.
"""

from pof_connector.pins.pin import HARD, SOFT, Pin, PinError
from pof_connector.pins.pin_book import PinBook

__all__ = ["HARD", "SOFT", "Pin", "PinBook", "PinError"]
