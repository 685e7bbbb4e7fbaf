"""An engine's load as its own Prometheus endpoint reports it.

``pof relay --engine-url`` reads it every heartbeat and publishes it in its index node, so the
locality API can answer "node load" for engines that no pof router fronts. vLLM and SGLang name
the two gauges differently; both are summed over their label sets (one per model / DP rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running: int
    """Requests the engine is running (prefill or decode)."""
    waiting: int
    """Requests queued in the engine's scheduler."""

    def to_meta(self) -> dict[str, str]:
        return {"running": str(self.running), "waiting": str(self.waiting)}

    @classmethod
    def from_meta(cls, meta: dict[str, str]) -> EngineLoad | None:
        """The load a relay published; ``None`` when no relay reads the engine's metrics."""
        try:
            return cls(int(meta["running"]), int(meta["waiting"]))
        except (KeyError, ValueError):
            return None


def parse_engine_load(text: str) -> EngineLoad | None:
    """From Prometheus text; ``None`` when it carries neither engine's gauges."""
    running = waiting = 0.0
    seen = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in RUNNING:
                running += sample.value
                seen = True
            elif sample.name in WAITING:
                waiting += sample.value
                seen = True
    return EngineLoad(round(running), round(waiting)) if seen else None


def read_engine_load(base_url: str, client: httpx.Client) -> EngineLoad | None:
    """GET ``base_url/metrics``. Raises ``httpx.HTTPError`` when the engine does not answer;
    ``None`` when it answers without load gauges."""
    r = client.get(base_url.rstrip("/") + "/metrics")
    r.raise_for_status()
    return parse_engine_load(r.text)
