"""One frozen, validated configuration for every entry point.

The same keys are accepted from vLLM's ``kv_connector_extra_config``, SGLang's
``--hicache-storage-backend-extra-config``, the ``pof`` CLI's YAML file and ``POF_CONFIG``.
Validation happens once, at start-up: an unknown key or a bad value raises
:class:`ConfigError` naming the key and what is allowed, so a typo never turns into a
silently disabled pool.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pof_connector.config.audit_config import AuditConfig, parse_audit
from pof_connector.config.cluster_url import ClusterUrl, is_cluster_url
from pof_connector.config.config_error import ConfigError
from pof_connector.config.credentials import INDEX_AUTH_KEYS, IndexAuth
from pof_connector.config.pd_config import PDConfig, parse_pd
from pof_connector.config.tenant_config import TenantsConfig, parse_tenants

KNOWN_MEDIA = ("cpu_dram", "cxl", "peer_hbm")
"""Tier media this build can use, in the order of the default preference."""

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}
SIZE_FORMS = "an integer number of bytes or a string such as '512MiB', '4GiB', '1.5GiB', '64KiB'"


def parse_size(value: Any, key: str) -> int:
    """Bytes from an int or a string like ``"4GiB"``; raises :class:`ConfigError` naming ``key``."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected {SIZE_FORMS}, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        unit = (match.group(2) or "").lower() if match else ""
        if match is None or unit not in _UNITS:
            raise ConfigError(f"{key}: expected {SIZE_FORMS}, got {value!r}")
        size = int(float(match.group(1)) * _UNITS[unit])
    else:
        raise ConfigError(f"{key}: expected {SIZE_FORMS}, got {value!r}")
    if size <= 0:
        raise ConfigError(f"{key}: must be positive, got {value!r}")
    return size


def format_size(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return f"{n}B"


@dataclass(frozen=True)
class TierConfig:
    """One storage medium of this node.

    ``path``: the CXL device (``/dev/daxX.Y``) or file (``/dev/shm/pof.cxl``); ``None`` for DRAM.
    ``partition``: which writer partition of a shared CXL region this node owns; ``None`` means
    "claim a free one with a lock" (only works between processes of one host).
    ``numa_node``: bind the mapping to this NUMA node (CXL memory usually shows up as a CPU-less
    node); ``None`` leaves placement to the kernel.
    ``device``: peer_hbm only, the torch device holding the region (``cuda:1``; ``cpu`` for tests
    and GPU-less hosts); ``None`` for the other media.
    ``trade``: cxl only, whether this writer trades slots with the region's other writers (a busy
    one takes the slots of a neighbour's cold pages, :mod:`pof_connector.tiers.cxl`); ``False``
    keeps it to the slots it owns.
    """

    medium: str
    size: int
    path: str | None = None
    partition: int | None = None
    partitions: int = 8
    numa_node: int | None = None
    device: str | None = None
    trade: bool = True


_DEVICE_RE = re.compile(r"cpu|cuda(:\d{1,3})?")
_TIER_KEYS: dict[str, tuple[str, ...]] = {
    "cpu_dram": ("size",),
    "cxl": ("size", "path", "partition", "partitions", "numa_node", "trade"),
    "peer_hbm": ("size", "device", "partition", "partitions"),
}


def _tier(medium: str, options: Any) -> TierConfig:
    key = f"tiers.{medium}"
    if medium not in KNOWN_MEDIA:
        raise ConfigError(f"tiers: unknown medium {medium!r}; allowed: {', '.join(KNOWN_MEDIA)}")
    if not isinstance(options, Mapping):
        raise ConfigError(f"{key}: expected a mapping of options such as {{'size': '4GiB'}}, got {options!r}")
    allowed = _TIER_KEYS[medium]
    for name in options:
        if name not in allowed:
            raise ConfigError(f"{key}: unknown option {name!r}; allowed: {', '.join(allowed)}")
    if "size" not in options:
        raise ConfigError(f"{key}.size is required ({SIZE_FORMS})")
    size = parse_size(options["size"], f"{key}.size")
    if medium == "cpu_dram":
        return TierConfig(medium=medium, size=size)
    partitions = _int(options.get("partitions", 8), f"{key}.partitions", lo=1, hi=4096)
    partition = options.get("partition", "auto")
    part: int | None = None
    if partition != "auto":
        part = _int(partition, f"{key}.partition", lo=0, hi=partitions - 1, extra="or 'auto'")
    if medium == "peer_hbm":
        device = options.get("device")
        if not isinstance(device, str) or not _DEVICE_RE.fullmatch(device):
            raise ConfigError(f"{key}.device is required: a torch device such as 'cuda:1' (a GPU of this node) "
                              f"or 'cpu' (tests, GPU-less hosts), got {device!r}")
        return TierConfig(medium, size, partition=part, partitions=partitions, device=device)
    path = options.get("path")
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{key}.path is required: a devdax device such as /dev/dax0.0 or a file such as "
                          f"/dev/shm/pof.cxl, got {path!r}")
    numa = options.get("numa_node")
    numa_node = None if numa is None else _int(numa, f"{key}.numa_node", lo=0, hi=1023)
    trade = options.get("trade", True)
    if not isinstance(trade, bool):
        raise ConfigError(f"{key}.trade: expected true or false, got {trade!r}; allowed: true (writers trade slots "
                          "as their use differs), false (this writer keeps to the slots it owns)")
    return TierConfig(medium, size, path, part, partitions, numa_node, trade=trade)


def _int(value: Any, key: str, lo: int, hi: int | None = None, extra: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        more = f" {extra}" if extra else ""
        raise ConfigError(f"{key}: expected an integer {bound}{more}, got {value!r}")
    return value


def _float(value: Any, key: str, lo: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < lo:
        raise ConfigError(f"{key}: expected a number >= {lo}, got {value!r}")
    return float(value)


UCX_TRANSPORTS = (
    "all", "tcp", "rc", "rc_v", "rc_x", "rc_mlx5", "ud", "ud_v", "ud_x", "ud_mlx5", "dc", "dc_x", "dc_mlx5",
    "ib", "sm", "shm", "mm", "posix", "sysv", "xpmem", "knem", "cma", "self", "cuda", "cuda_copy", "cuda_ipc",
    "gdr_copy", "rocm", "rocm_copy", "rocm_ipc", "srd",
)
"""UCX transport names accepted in ``fabric.tls`` (each may carry UCX's ``^`` exclusion prefix)."""
_UCX_DEVICES_RE = re.compile(r"[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*")
_FABRIC_KEYS = ("enabled", "ucx_devices", "tls", "timeout_s", "staging_size", "spill", "spill_lease_s",
                "progress_wakeup_ms", "max_lent_fraction_per_writer")


@dataclass(frozen=True)
class FabricConfig:
    """Remote page reads between nodes over NIXL (UCX), for tiers no shared region connects.

    ``ucx_devices``: UCX's NET_DEVICES for pof's agent (e.g. ``mlx5_0:1``, ``eth0``); ``None``
    lets UCX choose. ``tls``: UCX transports, e.g. ``tcp`` or ``rc,sm``; ``None`` lets UCX choose
    (InfiniBand/RoCE when present). Both go to pof's own agent only, never to the engine's
    environment. ``timeout_s``: deadline of each remote READ request (a load's layer parts
    each get it); a peer that does not answer in time gives misses (recompute), never a hang.
    ``staging_size``: local memory that remote pages land in before they are validated (the
    most remote bytes one load can fetch).
    ``spill``: pages evicted from the last tier are written into another node's free slots (a
    neighbour's or a memory node's, granted with a lease) instead of being dropped, and this
    node grants its own free slots to others. ``spill_lease_s``: how long a grant lasts unless
    the writer renews it; the owner then reclaims the slot and readers miss.
    ``progress_wakeup_ms``: the longest the NIXL agent's progress thread sleeps between checks
    when UCX signals nothing (it wakes on UCX's events at once); 0 polls without sleeping, which
    is NIXL's own default and costs a whole CPU core per agent, idle or not.
    ``max_lent_fraction_per_writer``: the most of one tier's slots this node lends to one writer
    (0 < f <= 1), so one writer cannot take a lender's whole memory.
    """

    enabled: bool = False
    ucx_devices: str | None = None
    tls: str | None = None
    timeout_s: float = 2.0
    staging_size: int = 64 << 20
    spill: bool = False
    spill_lease_s: float = 30.0
    progress_wakeup_ms: int = 1
    max_lent_fraction_per_writer: float = 0.5


def _fabric(raw: Any) -> FabricConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"fabric: expected a mapping of options such as {{'enabled': true}}, got {raw!r}")
    for name in raw:
        if name not in _FABRIC_KEYS:
            raise ConfigError(f"fabric: unknown option {name!r}; allowed: {', '.join(_FABRIC_KEYS)}")
    kw: dict[str, Any] = {}
    for flag in ("enabled", "spill"):
        if flag in raw:
            if not isinstance(raw[flag], bool):
                raise ConfigError(f"fabric.{flag}: expected true or false, got {raw[flag]!r}")
            kw[flag] = raw[flag]
    devices = raw.get("ucx_devices")
    if devices is not None:
        if not isinstance(devices, str) or not _UCX_DEVICES_RE.fullmatch(devices):
            raise ConfigError(f"fabric.ucx_devices: expected a comma-separated list of UCX devices such as "
                              f"'mlx5_0:1' or 'eth0,eth1' (or 'all', or null), got {devices!r}")
        kw["ucx_devices"] = devices
    tls = raw.get("tls")
    if tls is not None:
        names = tls.split(",") if isinstance(tls, str) else [None]
        if not all(isinstance(n, str) and n.lstrip("^") in UCX_TRANSPORTS for n in names):
            raise ConfigError(f"fabric.tls: expected a comma-separated list of UCX transports (or null); "
                              f"allowed: {', '.join(UCX_TRANSPORTS)}; got {tls!r}")
        kw["tls"] = tls
    if "timeout_s" in raw:
        kw["timeout_s"] = _float(raw["timeout_s"], "fabric.timeout_s", lo=0.01)
    if "staging_size" in raw:
        kw["staging_size"] = parse_size(raw["staging_size"], "fabric.staging_size")
    if "spill_lease_s" in raw:
        kw["spill_lease_s"] = _float(raw["spill_lease_s"], "fabric.spill_lease_s", lo=0.1)
    if "progress_wakeup_ms" in raw:
        kw["progress_wakeup_ms"] = _int(raw["progress_wakeup_ms"], "fabric.progress_wakeup_ms", 0, 1000)
    if "max_lent_fraction_per_writer" in raw:
        f = raw["max_lent_fraction_per_writer"]
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ConfigError(f"fabric.max_lent_fraction_per_writer: expected a number > 0 and <= 1 (the share of "
                              f"a tier's slots one writer may hold), got {f!r}")
        kw["max_lent_fraction_per_writer"] = float(f)
    config = FabricConfig(**kw)
    if config.spill and not config.enabled:
        raise ConfigError("fabric.spill: spilling writes over the fabric; allowed: false, or true with "
                          "fabric.enabled: true")
    if config.spill and config.spill_lease_s <= 2 * config.timeout_s:
        # A writer stops using a grant one timeout before it ends, and the owner reclaims one
        # timeout after: a shorter lease leaves no time to write.
        raise ConfigError(f"fabric.spill_lease_s: expected a number > 2 * fabric.timeout_s "
                          f"({2 * config.timeout_s}), got {config.spill_lease_s}")
    return config


def _default_runtime_dir() -> str:
    return os.path.join(os.environ.get("XDG_RUNTIME_DIR") or "/tmp", f"pof-{os.getuid()}")


@dataclass(frozen=True)
class PofConfig:
    """The whole configuration of one pool node.

    ``page_tokens``: tokens per pool page; ``None`` adopts the engine's block (vLLM) or page
    (SGLang) size. ``index_url``: ``embedded`` (a private Redis-protocol server shared by the
    processes of this host, started on demand), ``local`` (in-process, single process only) or
    ``redis://host:port/db`` / ``unix:///path.sock``, or a Redis Cluster
    (``redis+cluster://host:port[,host:port...]``, see :mod:`pof_connector.index.redis_cluster`).
    ``namespace``: an operator-chosen string mixed into every key, for isolating tenants or
    deployments that share one index.
    ``tiers``: preference order — pages are stored in the first; pages evicted from a tier move
    to the next one. ``fabric``: reads of other nodes' tiers over NIXL (off by default).
    ``index_auth``: the index server's ACL user, where its password is and TLS files, given as
    the flat keys ``index_username``, ``index_password_env`` / ``index_password_file``,
    ``index_tls_ca_file`` (and ``index_tls_cert_file`` / ``index_tls_key_file``).
    """

    node_id: str = field(default_factory=socket.gethostname)
    index_url: str = "embedded"
    page_tokens: int | None = None
    namespace: str = ""
    model: str | None = None
    tiers: tuple[TierConfig, ...] = (TierConfig("cpu_dram", 1 << 30),)
    runtime_dir: str = field(default_factory=_default_runtime_dir)
    heartbeat_s: float = 1.0
    node_ttl_s: float = 5.0
    index_timeout_s: float = 1.0
    """How long one index call may take before it counts as failed (a lookup then misses, a
    publish is sent again on a later heartbeat). Short: engines call the index on their paths."""
    io_threads: int = 2
    load_timeout_s: float = 10.0
    fabric: FabricConfig = field(default_factory=FabricConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    """Sampled shadow recompute of pool hits (see :mod:`pof_connector.audit`)."""
    pd: PDConfig = field(default_factory=PDConfig)
    """Prefill/decode disaggregation through the pool (see :mod:`pof_connector.config.pd_config`)."""
    index_auth: IndexAuth = field(default_factory=IndexAuth)
    tenants: TenantsConfig = field(default_factory=TenantsConfig)
    """Tenants (mapped from their salt) and their byte quotas per tier
    (see :mod:`pof_connector.config.tenant_config`)."""

    def tier(self, medium: str) -> TierConfig | None:
        """The options of ``medium``; ``None`` when this node has no such tier."""
        return next((t for t in self.tiers if t.medium == medium), None)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], *, source: str = "config") -> PofConfig:
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{source}: expected a mapping of keys, got {type(raw).__name__}")
        allowed = tuple(k for k in cls.__dataclass_fields__ if k != "index_auth") + INDEX_AUTH_KEYS
        for key in raw:
            if key not in allowed:
                raise ConfigError(f"{source}: unknown key {key!r}; allowed keys: {', '.join(allowed)}")
        kw: dict[str, Any] = {}
        if "node_id" in raw:
            node_id = raw["node_id"]
            if not isinstance(node_id, str) or not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", node_id):
                raise ConfigError(f"node_id: expected 1-64 characters of [A-Za-z0-9_.:-], got {node_id!r}")
            kw["node_id"] = node_id
        if "index_url" in raw:
            kw["index_url"] = _index_url(raw["index_url"])
        if raw.get("page_tokens") is not None:
            kw["page_tokens"] = _int(raw["page_tokens"], "page_tokens", lo=1, hi=1 << 16, extra="or null")
        for key in ("namespace", "model", "runtime_dir"):
            if key in raw and raw[key] is not None:
                if not isinstance(raw[key], str):
                    raise ConfigError(f"{key}: expected a string, got {raw[key]!r}")
                kw[key] = raw[key]
        if "tiers" in raw:
            tiers = raw["tiers"]
            if not isinstance(tiers, Mapping) or not tiers:
                raise ConfigError("tiers: expected a non-empty mapping medium -> options, e.g. "
                                  "{'cpu_dram': {'size': '4GiB'}}; allowed media: " + ", ".join(KNOWN_MEDIA))
            kw["tiers"] = tuple(_tier(str(m), o) for m, o in tiers.items())
        if "heartbeat_s" in raw:
            kw["heartbeat_s"] = _float(raw["heartbeat_s"], "heartbeat_s", lo=0.05)
        if "node_ttl_s" in raw:
            kw["node_ttl_s"] = _float(raw["node_ttl_s"], "node_ttl_s", lo=0.1)
        if "index_timeout_s" in raw:
            kw["index_timeout_s"] = _float(raw["index_timeout_s"], "index_timeout_s", lo=0.01)
        if "load_timeout_s" in raw:
            kw["load_timeout_s"] = _float(raw["load_timeout_s"], "load_timeout_s", lo=0.01)
        if "io_threads" in raw:
            kw["io_threads"] = _int(raw["io_threads"], "io_threads", lo=1, hi=64)
        if raw.get("fabric") is not None:
            kw["fabric"] = _fabric(raw["fabric"])
        if raw.get("audit") is not None:
            kw["audit"] = parse_audit(raw["audit"])
        if raw.get("pd") is not None:
            kw["pd"] = parse_pd(raw["pd"])
        if raw.get("tenants") is not None:
            kw["tenants"] = parse_tenants(raw["tenants"], KNOWN_MEDIA, parse_size)
        kw["index_auth"] = IndexAuth.from_mapping(raw, kw.get("index_url", "embedded"))
        config = cls(**kw)
        if config.node_ttl_s <= config.heartbeat_s:
            raise ConfigError(f"node_ttl_s ({config.node_ttl_s}) must be larger than heartbeat_s "
                              f"({config.heartbeat_s}), or nodes expire between heartbeats")
        return config

    @classmethod
    def from_json(cls, text: str, *, source: str = "config") -> PofConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{source}: not valid JSON: {e}") from None
        return cls.from_mapping(raw, source=source)

    @classmethod
    def from_file(cls, path: str | Path) -> PofConfig:
        """Read a YAML (or JSON, which is YAML) file."""
        text = Path(path).read_text()
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        return cls.from_mapping(raw, source=str(path))

    def to_mapping(self) -> dict[str, Any]:
        """The config as plain data; ``from_mapping(to_mapping())`` gives an equal config."""
        tiers: dict[str, dict[str, Any]] = {}
        for t in self.tiers:
            opts: dict[str, Any] = {"size": t.size}
            if t.medium == "cxl":
                opts.update(path=t.path, partition="auto" if t.partition is None else t.partition,
                            partitions=t.partitions, numa_node=t.numa_node, trade=t.trade)
            elif t.medium == "peer_hbm":
                opts.update(device=t.device, partition="auto" if t.partition is None else t.partition,
                            partitions=t.partitions)
            tiers[t.medium] = opts
        return {
            "node_id": self.node_id, "index_url": self.index_url, "page_tokens": self.page_tokens,
            "namespace": self.namespace, "model": self.model, "tiers": tiers,
            "runtime_dir": self.runtime_dir, "heartbeat_s": self.heartbeat_s,
            "node_ttl_s": self.node_ttl_s, "io_threads": self.io_threads,
            "load_timeout_s": self.load_timeout_s,
            "fabric": {"enabled": self.fabric.enabled, "ucx_devices": self.fabric.ucx_devices,
                       "tls": self.fabric.tls, "timeout_s": self.fabric.timeout_s,
                       "staging_size": self.fabric.staging_size, "spill": self.fabric.spill,
                       "spill_lease_s": self.fabric.spill_lease_s,
                       "max_lent_fraction_per_writer": self.fabric.max_lent_fraction_per_writer},
            "audit": self.audit.to_mapping(),
            "pd": self.pd.to_mapping(),
            "tenants": self.tenants.to_mapping(),
            **self.index_auth.to_mapping(),
        }


def redact_url(url: str) -> str:
    """``url`` with its password (``redis://user:PASSWORD@host``) replaced by ``***``: for logs,
    errors and tables, which must never carry a secret."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{host}"


INDEX_URL_FORMS = ("'embedded', 'local', 'redis://host:port/db', 'rediss://…', 'unix:///path/to.sock' or "
                   "'redis+cluster://host:port[,host:port...]' / 'rediss+cluster://…'")


def _index_url(value: Any) -> str:
    if isinstance(value, str) and is_cluster_url(value):
        try:
            ClusterUrl.parse(value)
        except ValueError as e:
            raise ConfigError(f"index_url: {e}, got {redact_url(value)!r}") from None
        return value
    if isinstance(value, str) and (
        value in ("embedded", "local") or value.startswith(("redis://", "rediss://", "unix://"))
    ):
        return value
    shown = redact_url(value) if isinstance(value, str) else value
    raise ConfigError(f"index_url: expected {INDEX_URL_FORMS}, got {shown!r}")
