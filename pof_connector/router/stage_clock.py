"""Where `pof router`'s own time on one request goes, by stage (issue 42).

The stages, in the order a request passes them (a request that fails over to another backend
passes ``choose`` and ``proxy`` again; its time adds up per stage):

- ``parse``: reading the body and parsing its JSON;
- ``tokenize``: the prompt's token ids (checked id lists, the local tokenizer, or a backend's
  ``/tokenize``);
- ``lookup``: the locality index's answer (:meth:`Locator.locate
  <pof_connector.locality.locator.Locator.locate>`: prefix hashes, the index round trips);
- ``choose``: the rest of the decision (the request's routing fields, the cost estimate and KV
  admission per backend, the ticket);
- ``proxy``: from the decision until the request is written to the backend's connection (handed
  whole to the socket: aiohttp's trace of its last chunk sent, :class:`~pof_connector.router.forward.Sent`;
  a connection opened for it included, the backend's answer not).

Their sum is the router's overhead (header ``x-pof-router-overhead``); the stages go out in the
header ``x-pof-router-stages`` and the histogram ``pof_router_stage_seconds{stage}``.
"""

from __future__ import annotations

import time

STAGES = ("parse", "tokenize", "lookup", "choose", "proxy")
BUCKETS = (0.00005, 0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.02,
           0.05)
"""50 us to 50 ms: the stages of a healthy router are tens to hundreds of microseconds."""


class StageClock:
    """Seconds per stage of one request, lapped as the request moves on."""

    __slots__ = ("began", "last", "seconds")

    def __init__(self) -> None:
        self.began = self.last = time.perf_counter()
        self.seconds = dict.fromkeys(STAGES, 0.0)

    def lap(self, stage: str, now: float | None = None) -> float:
        """Count the time since the last lap (or the start) to ``stage``, up to ``now`` (``None``:
        this instant); returns ``now``."""
        at = time.perf_counter() if now is None else now
        self.seconds[stage] += at - self.last
        self.last = at
        return at

    def skip(self) -> None:
        """Leave the time since the last lap out of every stage and of :attr:`total` (P/D mode's
        prefill half: an engine's time, not the router's)."""
        now = time.perf_counter()
        self.began += now - self.last
        self.last = now

    def move(self, seconds: float, *, source: str, target: str) -> None:
        """Count ``seconds`` of ``source``'s time to ``target`` instead (a part timed inside it)."""
        self.seconds[source] -= seconds
        self.seconds[target] += seconds

    @property
    def total(self) -> float:
        """Seconds from the start to the last lap: the sum of the stages."""
        return self.last - self.began

    def header(self) -> str:
        return ",".join(f"{k}={v:.6f}" for k, v in self.seconds.items())


def parse_header(text: str | None) -> dict[str, float]:
    """Seconds per stage from a ``x-pof-router-stages`` value (:meth:`StageClock.header`); {} for
    ``None`` or an empty one. Raises ``ValueError`` for a stage whose seconds are not a number."""
    out: dict[str, float] = {}
    for part in filter(None, (text or "").split(",")):
        name, _, value = part.partition("=")
        out[name.strip()] = float(value)
    return out
