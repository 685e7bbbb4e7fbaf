"""Built-in workloads (seeded), in the trace's terms (:class:`~pof_connector.sim.workload.SimRequest`).

Token counts are stated for the reference node, 800K KV tokens (``h200``), and scaled by
``kv_tokens / 800K`` for a profile with more or less KV memory, so a mix stresses memory the same
way on any profile. Arrivals are Poisson at ``per_node_rps x nodes`` (the goodput search scales
them); a session's later turns follow its previous one after an exponential think time.

- ``long-context``: the problem statement's case: a few long multi-turn sessions whose context grows
  to 64K-128K tokens (about 5 % of the requests are their turns) beside short one-off requests of
  0.5-4K tokens from 8 tenants (one per node on more than 8 nodes) with 512-2048-token system
  prompts;
- ``prefix-heavy``: 16 tenants (two per node on more than 8 nodes) of Zipf-skewed popularity with
  2K-8K-token system prompts, sessions of 1-2 short turns;
- ``uniform``: the control: one-off 1-2K-token prompts sharing nothing.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from pof_connector.config import ConfigError
from pof_connector.sim.workload import SimRequest

REFERENCE_KV_TOKENS = 800_000


def _tokens(n: float, scale: float) -> int:
    return max(1, round(n * scale))


LONG_SHARE = 0.05
"""Share of ``long-context``'s requests that are long sessions' turns (``--long-share`` changes it)."""


def long_context(rnd: random.Random, requests: int, rps: float, scale: float, tenants: int = 8,
                 long_share: float = LONG_SHARE) -> list[SimRequest]:
    out: list[SimRequest] = []
    at = 0.0
    k = 0
    while len(out) < requests:
        at += rnd.expovariate(rps)
        if rnd.random() < long_share / 8:              # a long session starts (8 turns on average)
            turns = rnd.randint(6, 10)
            t = at
            system = _tokens(2048, scale)
            for _ in range(turns):
                out.append(SimRequest(round(t, 4), f"long{k}", f"L{k % 4}", system,
                                      _tokens(rnd.uniform(6_000, 14_000), scale),
                                      _tokens(rnd.randint(256, 512), scale)))
                t += rnd.expovariate(1 / 20.0)
        else:
            tenant = rnd.randrange(tenants)
            system = _tokens(512 + 512 * (tenant % 4), scale)
            out.append(SimRequest(round(at, 4), f"short{k}", f"T{tenant}", system,
                                  _tokens(rnd.uniform(0, 2048), scale), _tokens(rnd.randint(128, 512), scale)))
        k += 1
    out.sort(key=lambda r: r.at)
    return out[:requests]


def prefix_heavy(rnd: random.Random, requests: int, rps: float, scale: float, tenants: int = 16) -> list[SimRequest]:
    weights = [1 / (i + 1) for i in range(tenants)]
    systems = [_tokens(rnd.uniform(2_000, 8_000), scale) for _ in range(tenants)]
    out: list[SimRequest] = []
    at = 0.0
    k = 0
    while len(out) < requests:
        at += rnd.expovariate(rps / 1.5)             # sessions of 1.5 turns on average
        tenant = rnd.choices(range(tenants), weights)[0]
        t = at
        for _ in range(rnd.randint(1, 2)):
            out.append(SimRequest(round(t, 4), f"p{k}", f"T{tenant}", systems[tenant],
                                  _tokens(rnd.uniform(100, 500), scale), _tokens(rnd.randint(128, 256), scale)))
            t += rnd.expovariate(1 / 10.0)
        k += 1
    out.sort(key=lambda r: r.at)
    return out[:requests]


def uniform(rnd: random.Random, requests: int, rps: float, scale: float, tenants: int = 0) -> list[SimRequest]:
    """``tenants``: unused (every request is its own tenant)."""
    out: list[SimRequest] = []
    at = 0.0
    for k in range(requests):
        at += rnd.expovariate(rps)
        out.append(SimRequest(round(at, 4), f"u{k}", f"U{k}", 0, _tokens(rnd.uniform(1_000, 2_000), scale),
                              _tokens(256, scale)))
    return out


MIXES: dict[str, Callable[[random.Random, int, float, float, int], list[SimRequest]]] = {
    "long-context": long_context, "prefix-heavy": prefix_heavy, "uniform": uniform}
PER_NODE_RPS = {"long-context": 2.0, "prefix-heavy": 4.0, "uniform": 4.0}
"""Arrival rate per node at rate factor 1 (requests / s)."""
TENANTS_PER_NODE = {"long-context": 1, "prefix-heavy": 2, "uniform": 0}
"""Tenants of one-off requests per node (8 and 16 at least): a cluster grows with its tenants, and
``static`` places a one-off request by its tenant, so a fixed tenant count would leave most of a
large cluster to the long sessions alone."""
MIN_TENANTS = {"long-context": 8, "prefix-heavy": 16, "uniform": 0}


def make_mix(name: str, *, nodes: int, requests: int, seed: int, kv_tokens: int,
             long_share: float | None = None) -> list[SimRequest]:
    """``long_share``: the share of long sessions' turns (``long-context`` only; ``None``: its default)."""
    if name not in MIXES:
        raise ConfigError(f"--mix: {name!r} is not a built-in mix; mixes: {', '.join(MIXES)}")
    rnd, rps, scale = random.Random(seed), PER_NODE_RPS[name] * nodes, kv_tokens / REFERENCE_KV_TOKENS
    tenants = max(MIN_TENANTS[name], TENANTS_PER_NODE[name] * nodes)
    if long_share is not None:
        if name != "long-context":
            raise ConfigError(f"--long-share: only mix long-context has long sessions, not {name!r}")
        if not 0 < long_share < 1:
            raise ConfigError(f"--long-share: a share between 0 and 1 (exclusive) is required, got {long_share}")
        return long_context(rnd, requests, rps, scale, tenants, long_share)
    return MIXES[name](rnd, requests, rps, scale, tenants)
