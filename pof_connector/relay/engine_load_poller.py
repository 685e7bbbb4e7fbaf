"""Reads an engine's load in the background, for `pof relay --engine-url`."""

from __future__ import annotations

import logging
import threading

import httpx

from pof_connector.locality.engine_load import EngineLoad, MetricsPage, read_engine_load

log = logging.getLogger(__name__)


class EngineLoadPoller:
    """GETs ``engine_url/metrics`` every ``period_s`` on a thread of its own, so an engine slow to
    answer never holds up the relay's event loop (which forwards KV events between its reads)."""

    def __init__(self, engine_url: str, period_s: float, timeout_s: float = 2.0) -> None:
        self.engine_url = engine_url
        self.page = MetricsPage(engine_url)
        self.period_s = period_s
        self._client = httpx.Client(timeout=timeout_s)
        self._latest: EngineLoad | None = None
        self._failing = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pof-relay-engine-load", daemon=True)

    @property
    def latest(self) -> EngineLoad | None:
        """The last reading; ``None`` before the first, and while ``/metrics`` fails or carries no
        request gauges (then the index shows no load rather than a stale one)."""
        return self._latest

    def start(self) -> EngineLoadPoller:
        self._thread.start()
        return self

    def read_once(self) -> EngineLoad | None:
        """One reading, also kept as :attr:`latest`."""
        try:
            load = read_engine_load(self.page, self._client)
        except httpx.HTTPError as e:
            if not self._failing:
                log.warning("pof relay: cannot read the engine's load from %s/metrics (%s); publishing none "
                            "until it answers", self.engine_url, e)
            self._failing = True
            load = None
        else:
            if self._failing:
                log.warning("pof relay: reading the engine's load again")
            self._failing = False
            if load is None:
                log.warning("pof relay: %s/metrics has no vLLM or SGLang request gauges; publishing no load",
                            self.engine_url)
        self._latest = load
        return load

    def _run(self) -> None:
        while not self._stop.is_set():
            self.read_once()
            self._stop.wait(self.period_s)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._client.close()
