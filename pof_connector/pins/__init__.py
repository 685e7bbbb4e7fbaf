"""Prefix pins: a prompt prefix kept in the pool for a while (see :mod:`.pin`)."""

from pof_connector.pins.pin import HARD, SOFT, Pin, PinError
from pof_connector.pins.pin_book import PinBook

__all__ = ["HARD", "SOFT", "Pin", "PinBook", "PinError"]
