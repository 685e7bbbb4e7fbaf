"""What one ``pof relay`` connects to and how often it looks at the pool (its command-line flags)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RelayConfig:
    """A relay's endpoints and periods; the pool node it serves comes from the engine's pof config.

    ``engine_events``: the engine's PUB endpoint to connect to. ``bind``: where routers connect
    (``tcp://127.0.0.1:0`` picks a port: read :attr:`Relay.endpoint`). ``replay_bind``: ``None``
    serves no replay. ``advertise_engine_events``: the engine endpoint as other hosts reach it
    (``None``: ``engine_events``). ``pool_residency=False`` forwards the engine's events only.
    ``engine_url``: the engine's HTTP base URL, whose ``/metrics`` give its load; ``None``
    publishes no load.
    """

    engine_events: str
    bind: str
    replay_bind: str | None = None
    engine_topic: str = ""
    advertise_engine_events: str | None = None
    pool_residency: bool = True
    poll_s: float = 0.5
    """How often the pool view is refreshed from the index."""
    refresh_s: float = 30.0
    """How often the whole pool view is re-sent, for routers that joined late."""
    buffer_steps: int = 10_000
    """Batches kept for vLLM's replay protocol."""
    max_pages: int = 1 << 16
    """Pages (with their tokens) remembered from KV events."""
    engine_url: str | None = None
    max_frame_bytes: int = 16 << 20
    """Largest message frame taken from an engine's event stream (ZMQ_MAXMSGSIZE): a larger one
    drops that link (ZMQ reconnects) instead of being buffered. A vLLM step's batch is far smaller
    (its token ids are bounded by the tokens scheduled per step)."""

    @property
    def advertised_engine_events(self) -> str:
        """The engine endpoint other hosts' relays follow."""
        return self.advertise_engine_events or self.engine_events
