"""The ``audit`` configuration key."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pof_connector.config.config_error import ConfigError

DEFAULT_BOUNDS: dict[str, float] = {"float32": 1e-3, "float16": 3e-2, "bfloat16": 6e-2}
"""Largest normalised error (see :func:`pof_connector.audit.tolerance.normalised_error`) a
recomputed page may show against the pool's copy and still count as the same KV, per KV dtype.
Measured (``pof bench audit``, docs/bench/issue41-audit-2026-12-05.json): 2,028 clean pages of the
tiny model recomputed on another server, alone and in batches, differed by at most 4.6e-7 in
float32 and 0 in bfloat16 (this CPU has no AMX); the subtlest injected fault, a silently failed
load (only the second of two layers differs), by 0.12, every other fault by 1.4 or more. The
bfloat16 bound leaves room for GPU kernels and AMX, whose results depend on the batch."""

AUDIT_KEYS = ("sample_rate", "quarantine_after", "tolerance", "seed")


@dataclass(frozen=True)
class AuditConfig:
    """``sample_rate``: the fraction of pool hits (requests whose prefix the pool holds) whose
    pages the engine computes itself and compares with the pool's (0 turns the audit off).
    ``quarantine_after``: after this many mismatched pages from one writer node, this node no
    longer loads that writer's pages until it registers again (0: never). ``tolerance``: per KV
    dtype, the largest normalised error that still counts as a match (defaults:
    :data:`DEFAULT_BOUNDS`). ``seed``: the sampler's seed (``None``: random). A P/D decode request
    is never audited: it would prefill its whole prompt on the decode server."""

    sample_rate: float = 0.01
    quarantine_after: int = 0
    tolerance: tuple[tuple[str, float], ...] = tuple(DEFAULT_BOUNDS.items())
    seed: int | None = None

    def bound(self, dtype: str) -> float:
        """The tolerance for KV of ``dtype`` (``torch.bfloat16`` or ``bfloat16``); 0 (bytes must be
        equal) for a dtype without one."""
        return dict(self.tolerance).get(dtype.removeprefix("torch."), 0.0)

    def to_mapping(self) -> dict[str, Any]:
        return {"sample_rate": self.sample_rate, "quarantine_after": self.quarantine_after,
                "tolerance": dict(self.tolerance), "seed": self.seed}


def parse_audit(raw: Any) -> AuditConfig:
    """``audit`` from a config mapping; raises :class:`ConfigError` naming the key and what is allowed."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"audit: expected a mapping such as {{'sample_rate': 0.01}}, got {raw!r}")
    for name in raw:
        if name not in AUDIT_KEYS:
            raise ConfigError(f"audit: unknown option {name!r}; allowed: {', '.join(AUDIT_KEYS)}")
    kw: dict[str, Any] = {}
    if "sample_rate" in raw:
        rate = raw["sample_rate"]
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise ConfigError(f"audit.sample_rate: expected a number from 0 (off) to 1 (every hit), got {rate!r}")
        kw["sample_rate"] = float(rate)
    if "quarantine_after" in raw:
        k = raw["quarantine_after"]
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ConfigError(f"audit.quarantine_after: expected an integer >= 0 (0: never), got {k!r}")
        kw["quarantine_after"] = k
    if "tolerance" in raw:
        tol = raw["tolerance"]
        if not isinstance(tol, Mapping):
            raise ConfigError(f"audit.tolerance: expected a mapping dtype -> bound, e.g. {{'bfloat16': 0.06}}, "
                              f"got {tol!r}")
        bounds = dict(DEFAULT_BOUNDS)
        for dtype, bound in tol.items():
            if dtype not in DEFAULT_BOUNDS:
                raise ConfigError(f"audit.tolerance: unknown dtype {dtype!r}; allowed: {', '.join(DEFAULT_BOUNDS)}")
            if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not 0 <= bound < 1:
                raise ConfigError(f"audit.tolerance.{dtype}: expected a number >= 0 and < 1, got {bound!r}")
            bounds[dtype] = float(bound)
        kw["tolerance"] = tuple(bounds.items())
    if raw.get("seed") is not None:
        seed = raw["seed"]
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"audit.seed: expected an integer or null, got {seed!r}")
        kw["seed"] = seed
    return AuditConfig(**kw)
