"""The ``pd`` configuration key: prefill/decode disaggregation through the pool."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pof_connector.config.config_error import ConfigError

PD_KEYS = ("wait_s", "poll_s", "decode_saves")


@dataclass(frozen=True)
class PDConfig:
    """``wait_s``: how long a decode server holds a request whose prefill named pool pages
    (``kv_transfer_params.pof_tokens``) while they are not all in the index yet; the prefill's
    store thread publishes them a few milliseconds after its response, or later when its pool
    is busy. After ``wait_s`` the decode server loads what is there and computes the rest, so a
    prefill that died or pages that were evicted cost time, never a wrong or missing answer.
    ``poll_s``: how often the decode server asks the index again meanwhile. ``decode_saves``:
    the decode server stores the pages its generated tokens fill, so the next turn of the
    conversation hits the pool wherever it lands."""

    wait_s: float = 10.0
    poll_s: float = 0.02
    decode_saves: bool = True

    def to_mapping(self) -> dict[str, Any]:
        return {"wait_s": self.wait_s, "poll_s": self.poll_s, "decode_saves": self.decode_saves}


def parse_pd(raw: Any) -> PDConfig:
    """``pd`` from a config mapping; raises :class:`ConfigError` naming the key and what is allowed."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"pd: expected a mapping such as {{'wait_s': 10}}, got {raw!r}")
    for name in raw:
        if name not in PD_KEYS:
            raise ConfigError(f"pd: unknown option {name!r}; allowed: {', '.join(PD_KEYS)}")
    kw: dict[str, Any] = {}
    for name, lo in (("wait_s", 0.0), ("poll_s", 0.001)):
        if name in raw:
            v = raw[name]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= 3600:
                raise ConfigError(f"pd.{name}: expected a number of seconds from {lo} to 3600, got {v!r}")
            kw[name] = float(v)
    if "decode_saves" in raw:
        if not isinstance(raw["decode_saves"], bool):
            raise ConfigError(f"pd.decode_saves: expected true or false, got {raw['decode_saves']!r}")
        kw["decode_saves"] = raw["decode_saves"]
    return PDConfig(**kw)
