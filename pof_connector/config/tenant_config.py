"""The ``tenants`` configuration key: who a page belongs to, and how much of each tier they may hold.

::

    tenants:
      default_quota: {cpu_dram: 2GiB}        # for tiers a tenant names no quota for, and for the
                                              # "default" tenant (no salt, or one no tenant maps)
      named:
        acme:   {salt_sha256: "<64 hex>", quota: {cpu_dram: 8GiB, cxl: 64GiB}}
        globex: {salt: "the salt itself", quota: {cpu_dram: 1GiB}}

A tenant is found from a request's ``cache_salt``: ``salt_sha256`` is the salt's plain sha256
(``printf %s "$SALT" | sha256sum``), so the salt need not sit in the config at all; ``salt`` is
hashed at start-up and then forgotten. Only the digest is kept, and nothing prints or exports it:
a tenant's *name* is what tables, metrics and logs show, and a name never reveals its salt
(``to_mapping`` writes the digest, never ``salt``). A tier with no quota for a tenant (its own or
the default) is unlimited for it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pof_connector.config.config_error import ConfigError

DEFAULT_TENANT = "default"
"""The tenant of pages stored without a salt, or with one no named tenant maps."""

TENANTS_KEYS = ("default_quota", "named")
TENANT_KEYS = ("salt", "salt_sha256", "quota")
_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_HEX64_RE = re.compile(r"[0-9a-f]{64}")


def salt_digest(salt: str) -> bytes:
    """The digest a tenant is mapped by: sha256 of the salt's UTF-8 bytes."""
    return hashlib.sha256(salt.encode("utf-8")).digest()


@dataclass(frozen=True)
class Tenant:
    """``name``: shown everywhere; ``salt_sha256``: the digest of its salt (``repr=False``: a
    config printed in a log or an error shows no salt material at all)."""

    name: str
    salt_sha256: bytes = field(repr=False)
    quota: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class TenantsConfig:
    named: tuple[Tenant, ...] = ()
    default_quota: tuple[tuple[str, int], ...] = ()

    @property
    def enabled(self) -> bool:
        """Whether any tenant or quota is configured (else every page is the default tenant's)."""
        return bool(self.named or self.default_quota)

    def tenant_of(self, cache_salt: str | None) -> str:
        """The tenant a request's salt maps to; :data:`DEFAULT_TENANT` for none or an unknown one."""
        if cache_salt is None or not self.named:
            return DEFAULT_TENANT
        digest = salt_digest(cache_salt)
        return next((t.name for t in self.named if t.salt_sha256 == digest), DEFAULT_TENANT)

    def names(self) -> list[str]:
        return [DEFAULT_TENANT] + [t.name for t in self.named]

    def quota(self, tenant: str, medium: str) -> int | None:
        """Bytes ``tenant`` may hold in ``medium``; ``None``: unlimited."""
        own = next((dict(t.quota) for t in self.named if t.name == tenant), {})
        if medium in own:
            return own[medium]
        return dict(self.default_quota).get(medium)

    def quotas_for(self, medium: str) -> dict[str, int]:
        """Every tenant with a quota in ``medium`` (the default tenant included), in bytes."""
        out = {}
        for name in self.names():
            q = self.quota(name, medium)
            if q is not None:
                out[name] = q
        return out

    def to_mapping(self) -> dict[str, Any]:
        """Plain data; the salt's digest only, never a salt."""
        return {"default_quota": dict(self.default_quota),
                "named": {t.name: {"salt_sha256": t.salt_sha256.hex(), "quota": dict(t.quota)} for t in self.named}}


def parse_tenants(raw: Any, media: tuple[str, ...], parse_size: Any) -> TenantsConfig:
    """``tenants`` from a config mapping; raises :class:`ConfigError` naming the key and what is
    allowed (never quoting a salt). ``media``: the tier media a quota may name; ``parse_size``:
    the config's size parser (passed in: :mod:`pof_connector.config` imports this module)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"tenants: expected a mapping with {' and/or '.join(TENANTS_KEYS)}, got {type(raw).__name__}")
    for name in raw:
        if name not in TENANTS_KEYS:
            raise ConfigError(f"tenants: unknown option {name!r}; allowed: {', '.join(TENANTS_KEYS)}")
    default = _quota(raw.get("default_quota") or {}, "tenants.default_quota", media, parse_size)
    named_raw = raw.get("named") or {}
    if not isinstance(named_raw, Mapping):
        raise ConfigError("tenants.named: expected a mapping tenant name -> {salt_sha256 or salt, quota}")
    named: list[Tenant] = []
    seen: dict[bytes, str] = {}
    for name, opts in named_raw.items():
        key = f"tenants.named.{name}"
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name == DEFAULT_TENANT:
            raise ConfigError(f"tenants.named: a tenant name is 1-64 characters of [A-Za-z0-9_.-] and not "
                              f"{DEFAULT_TENANT!r} (reserved for pages of no named tenant), got {name!r}")
        if not isinstance(opts, Mapping):
            raise ConfigError(f"{key}: expected a mapping with salt_sha256 (or salt) and quota")
        for opt in opts:
            if opt not in TENANT_KEYS:
                raise ConfigError(f"{key}: unknown option {opt!r}; allowed: {', '.join(TENANT_KEYS)}")
        digest = _digest(opts, key)
        if digest in seen:
            raise ConfigError(f"{key}: the same salt as tenant {seen[digest]!r}; allowed: one tenant per salt")
        seen[digest] = name
        named.append(Tenant(name, digest, _quota(opts.get("quota") or {}, f"{key}.quota", media, parse_size)))
    return TenantsConfig(tuple(named), default)


def _digest(opts: Mapping[str, Any], key: str) -> bytes:
    has_salt, has_digest = "salt" in opts, "salt_sha256" in opts
    if has_salt == has_digest:
        raise ConfigError(f"{key}: expected exactly one of salt_sha256 (the salt's sha256, 64 lower-case hex "
                          f"digits) or salt")
    if has_salt:
        salt = opts["salt"]
        if not isinstance(salt, str) or not salt:
            raise ConfigError(f"{key}.salt: expected a non-empty string")     # never echo the value
        return salt_digest(salt)
    text = opts["salt_sha256"]
    if not isinstance(text, str) or not _HEX64_RE.fullmatch(text):
        raise ConfigError(f"{key}.salt_sha256: expected 64 lower-case hex digits (sha256 of the salt)")
    return bytes.fromhex(text)


def _quota(raw: Any, key: str, media: tuple[str, ...], parse_size: Any) -> tuple[tuple[str, int], ...]:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{key}: expected a mapping tier medium -> size, e.g. {{'cpu_dram': '4GiB'}}, got {raw!r}")
    out = []
    for medium, size in raw.items():
        if medium not in media:
            raise ConfigError(f"{key}: unknown medium {medium!r}; allowed: {', '.join(media)}")
        if isinstance(size, int) and not isinstance(size, bool) and size == 0:
            out.append((str(medium), 0))      # 0: the tenant stores nothing in this tier
            continue
        out.append((str(medium), parse_size(size, f"{key}.{medium}")))
    return tuple(out)
