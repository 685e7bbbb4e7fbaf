"""A node profile: how much KV memory an engine node has, what computing and moving KV costs.

Loaded from YAML (``profiles/<name>.yaml`` ships ``h200`` and ``cpu-bench``); every key is
required unless marked, and a bad file fails naming the key. Cost model of one node:

- prefill of ``n`` new tokens after ``s`` tokens of context:
  ``n * (prefill_s_per_token + prefill_s_per_token_ctx * (s + n / 2))`` (attention grows with context);
- one decode step of ``B`` requests holding ``C`` tokens of context in all:
  ``decode_step_s + decode_s_per_seq * B + decode_s_per_ctx_token * C``;
- a load of ``n`` tokens from a pool tier: ``latency_us + n * kv_bytes_per_token / gbps``;
- every TTFT also counts ``request_latency_s`` (optional, 0), which occupies no engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from pof_connector.config import ConfigError


@dataclass(frozen=True)
class TierProfile:
    name: str
    gbps: float
    """Load bandwidth, GB/s."""
    latency_us: float
    capacity_gb: float = 0.0
    """Per node (0: this tier only carries loads from other nodes, it stores nothing)."""

    def load_s(self, nbytes: float) -> float:
        return self.latency_us * 1e-6 + nbytes / (self.gbps * 1e9)


@dataclass(frozen=True)
class Profile:
    name: str
    kv_blocks: int
    """KV blocks per node."""
    block_tokens: int
    kv_bytes_per_token: int
    max_running: int
    """Requests a node runs at once (vLLM ``max_num_seqs``)."""
    max_batched_tokens: int
    """Prefill tokens scheduled in one iteration (vLLM ``max_num_batched_tokens``; a single prompt
    longer than this still prefills in one iteration: chunking is not modelled)."""
    prefill_s_per_token: float
    prefill_s_per_token_ctx: float
    decode_step_s: float
    decode_s_per_seq: float
    decode_s_per_ctx_token: float
    local_tier: TierProfile
    """Where a node's pool stores its pages (and loads its own back from)."""
    remote_tier: TierProfile
    """How a node loads pages another node's pool stores."""
    request_latency_s: float = 0.0
    """Added to every TTFT without occupying the engine: the API server's own work per request
    (HTTP, tokenising, detokenising the first token), which a CPU host's bench shows and a GPU
    node's costs leave out (0)."""
    host_slowdown: float = 0.0
    """Nodes share one host's cores (a bench of CPU servers on one machine): an iteration takes
    ``1 + host_slowdown x`` the other nodes running one when it starts, this much longer (0: every
    node a host of its own, as in a GPU cluster)."""
    slo_multiple: float = 4.0
    """The TTFT SLO is this many times the unloaded p90 TTFT of the workload (as ``pof bench capacity``)."""

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.block_tokens

    @property
    def pool_tokens(self) -> int:
        return int(self.local_tier.capacity_gb * 1e9 // self.kv_bytes_per_token)

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def cold_ttft_s(self, prompt_tokens: int) -> float:
        """TTFT of a prompt sent alone to an idle node with nothing cached (how the bench measures
        the SLO's base): the API latency, one step and the prefill of the whole prompt."""
        return self.request_latency_s + self.decode_step_s + self.prefill_s(prompt_tokens, 0)

    def prefill_s(self, new_tokens: int, context: int) -> float:
        return new_tokens * (self.prefill_s_per_token + self.prefill_s_per_token_ctx * (context + new_tokens / 2))

    def decode_s(self, batch: int, context_tokens: int) -> float:
        return self.decode_step_s + self.decode_s_per_seq * batch + self.decode_s_per_ctx_token * context_tokens

    def load_s(self, tier: TierProfile, tokens: int) -> float:
        return tier.load_s(tokens * self.kv_bytes_per_token)


_NUMBERS = {f.name for f in fields(Profile)} - {"name", "local_tier", "remote_tier"}
_INTS = {"kv_blocks", "block_tokens", "kv_bytes_per_token", "max_running", "max_batched_tokens"}
_OPTIONAL = {"slo_multiple", "request_latency_s", "host_slowdown"}


def _number(raw: dict[str, Any], key: str, where: str, *, integer: bool, positive: bool) -> float:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where}: {key}: a number is required, got {value!r}")
    if integer and value != int(value):
        raise ConfigError(f"{where}: {key}: a whole number is required, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ConfigError(f"{where}: {key}: must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return value


def _tier(raw: Any, key: str, where: str) -> TierProfile:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise ConfigError(f"{where}: {key}: a map with name, gbps, latency_us (and capacity_gb) is required")
    unknown = sorted(set(raw) - {"name", "gbps", "latency_us", "capacity_gb"})
    if unknown:
        raise ConfigError(f"{where}: {key}.{unknown[0]}: unknown; allowed: name, gbps, latency_us, capacity_gb")
    at = f"{where}: {key}"
    return TierProfile(raw["name"], _number(raw, "gbps", at, integer=False, positive=True),
                       _number(raw, "latency_us", at, integer=False, positive=False),
                       _number(raw, "capacity_gb", at, integer=False, positive=False) if "capacity_gb" in raw
                       else 0.0)


def profile_from_mapping(raw: Any, name: str, where: str) -> Profile:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: a profile is a map of keys, got {type(raw).__name__}")
    allowed = _NUMBERS | {"local_tier", "remote_tier"}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ConfigError(f"{where}: {unknown[0]}: unknown key; allowed: {', '.join(sorted(allowed))}")
    values: dict[str, Any] = {}
    for key in sorted(_NUMBERS):
        if key in _OPTIONAL and key not in raw:
            continue
        n = _number(raw, key, where, integer=key in _INTS,
                    positive=key in _INTS or key in ("prefill_s_per_token", "slo_multiple"))
        values[key] = int(n) if key in _INTS else float(n)
    local = _tier(raw.get("local_tier"), "local_tier", where)
    if local.capacity_gb <= 0:
        raise ConfigError(f"{where}: local_tier.capacity_gb: must be > 0 (the pool's room per node)")
    return Profile(name=name, local_tier=local, remote_tier=_tier(raw.get("remote_tier"), "remote_tier", where),
                   **values)


def builtin_profiles() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("pof_connector.sim").joinpath("profiles").iterdir()
                  if p.name.endswith(".yaml"))


def load_profile(spec: str) -> Profile:
    """``spec``: a YAML file, or the name of a shipped profile (``h200``, ``cpu-bench``)."""
    path = Path(spec)
    if not path.is_file():
        shipped = resources.files("pof_connector.sim").joinpath("profiles", f"{spec}.yaml")
        if not shipped.is_file():
            raise ConfigError(f"profile {spec!r}: no such file, and no shipped profile of that name "
                              f"(shipped: {', '.join(builtin_profiles())})")
        text, name, where = shipped.read_text(), spec, f"profile {spec}"
    else:
        text, name, where = path.read_text(), path.stem, str(path)
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not YAML: {e}") from None
    return profile_from_mapping(raw, name, where)
