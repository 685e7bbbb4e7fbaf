"""One log line per kind of trouble, until it clears: a relay that cannot reach the index for an
hour must not write a line per poll."""

from __future__ import annotations

import logging


class LogOnce:
    """Logs a message the first time its ``what`` comes up; :meth:`clear` re-arms it and says
    whether it had fired (so the caller can log the recovery)."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._logged: set[str] = set()

    def __call__(self, what: str, level: int, msg: str, *args: object) -> None:
        if what not in self._logged:
            self._logged.add(what)
            self._log.log(level, msg, *args)

    def clear(self, what: str) -> bool:
        """Re-arm ``what``; ``True`` when it had been logged."""
        if what not in self._logged:
            return False
        self._logged.discard(what)
        return True
