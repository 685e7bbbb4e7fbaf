"""One prefix pin as the index records it.

A pin names the pages of a prompt prefix (their keys, in every namespace of the model: each TP
rank has its own) and asks every node holding them to keep them until ``expires_at`` (wall-clock
seconds): ``soft`` pages are evicted after every other page a store may evict, ``hard`` pages
are not evicted at all while the pin lives. A pinned page still counts against its tenant's
quota: a tenant whose quota is all hard-pinned stores nothing new in that tier until a pin ends.
The record lives in the locality index (routers see it) and in each node's :class:`PinBook`,
which writes it back after the index lost it. Records come from an untrusted store: parsing
refuses anything but what :meth:`Pin.to_json` writes.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from pof_connector.config.tenant_config import DEFAULT_TENANT
from pof_connector.pages.keys import DIGEST_BYTES, NAMESPACE_BYTES, PageKey

SOFT, HARD = "soft", "hard"
MAX_PIN_PAGES = 1 << 16
MAX_TTL_S = 30 * 86400.0
_ID_RE = re.compile(r"[0-9a-f]{16}")
_KEY_RE = re.compile(f"[0-9a-f]{{{2 * NAMESPACE_BYTES}}}:[0-9a-f]{{{2 * DIGEST_BYTES}}}")
_LABEL_RE = re.compile(r"[A-Za-z0-9_.:-]{0,64}")
_TENANT_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class PinError(ValueError):
    """A pin request or record that is not allowed (the message names the field)."""


@dataclass(frozen=True)
class Pin:
    """``keys``: the pinned pages; ``tokens``: how many prompt tokens they cover (per namespace);
    ``replicas``: how many nodes should hold the prefix whole (nodes copy it until that many do:
    :mod:`pof_connector.pool.pin_copies`); ``label``: the caller's name for it; ``tenant``: whose quota
    the copies count against (a tenant's name, never its salt; a name a node does not know counts
    as the default tenant there)."""

    pin_id: str
    keys: tuple[PageKey, ...]
    kind: str
    expires_at: float
    tokens: int = 0
    model: str = ""
    replicas: int = 1
    label: str = ""
    tenant: str = DEFAULT_TENANT

    @staticmethod
    def new_id() -> str:
        return secrets.token_hex(8)

    def live(self, now: float) -> bool:
        return now < self.expires_at

    def to_json(self) -> str:
        return json.dumps({"id": self.pin_id, "keys": [k.hex() for k in self.keys], "kind": self.kind,
                           "expires_at": self.expires_at, "tokens": self.tokens, "model": self.model,
                           "replicas": self.replicas, "label": self.label, "tenant": self.tenant},
                          separators=(",", ":"))

    def summary(self, now: float) -> dict[str, object]:
        """What listings show (keys counted, not spelled out)."""
        return {"id": self.pin_id, "kind": self.kind, "pages": len(self.keys), "tokens": self.tokens,
                "model": self.model, "replicas": self.replicas, "label": self.label, "tenant": self.tenant,
                "expires_in_s": max(0.0, round(self.expires_at - now, 1))}

    @classmethod
    def from_json(cls, raw: str | bytes) -> Pin:
        """Raises :class:`PinError` for anything :meth:`to_json` would not write."""
        try:
            d = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise PinError(f"pin record: not JSON: {e}") from None
        if not isinstance(d, dict):
            raise PinError("pin record: not a map")
        keys = d.get("keys")
        if not isinstance(keys, list) or len(keys) > MAX_PIN_PAGES or not all(
                isinstance(k, str) and _KEY_RE.fullmatch(k) for k in keys):
            raise PinError(f"pin record: keys must be up to {MAX_PIN_PAGES} 'namespace:digest' hex strings")
        pin_id, model, label = d.get("id"), d.get("model", ""), d.get("label", "")
        if not isinstance(pin_id, str) or not _ID_RE.fullmatch(pin_id):
            raise PinError("pin record: id must be 16 hex digits")
        if not isinstance(model, str) or len(model) > 256:
            raise PinError("pin record: model must be a string of up to 256 characters")
        if not isinstance(label, str) or not _LABEL_RE.fullmatch(label):
            raise PinError("pin record: label must be up to 64 characters of [A-Za-z0-9_.:-]")
        tenant = d.get("tenant", DEFAULT_TENANT)
        if not isinstance(tenant, str) or not _TENANT_RE.fullmatch(tenant):
            raise PinError("pin record: tenant must be a tenant's name (1-64 characters of [A-Za-z0-9_.-])")
        expires, tokens, replicas = d.get("expires_at"), d.get("tokens", 0), d.get("replicas", 1)
        if isinstance(expires, bool) or not isinstance(expires, (int, float)):
            raise PinError("pin record: expires_at must be a number")
        for name, v in (("tokens", tokens), ("replicas", replicas)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise PinError(f"pin record: {name} must be a non-negative integer")
        return cls(pin_id, tuple(PageKey.from_hex(k) for k in keys), check_kind(d.get("kind")), float(expires),
                   tokens, model, replicas, label, tenant)


def check_kind(kind: object) -> str:
    if kind not in (SOFT, HARD):
        raise PinError(f"kind: expected {SOFT!r} (evicted last) or {HARD!r} (not evicted while the pin lives), "
                       f"got {kind!r}")
    return str(kind)


def check_ttl(ttl_s: object) -> float:
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s <= MAX_TTL_S:
        raise PinError(f"ttl_s: expected a number of seconds > 0 and <= {MAX_TTL_S:.0f} (30 days), got {ttl_s!r}")
    return float(ttl_s)


def check_replicas(replicas: object) -> int:
    if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= 64:
        raise PinError(f"replicas: expected an integer 1..64, got {replicas!r}")
    return replicas


def check_label(label: object) -> str:
    if not isinstance(label, str) or not _LABEL_RE.fullmatch(label):
        raise PinError("label: expected up to 64 characters of [A-Za-z0-9_.:-]")
    return label


def check_tenant(tenant: object) -> str:
    if not isinstance(tenant, str) or not _TENANT_RE.fullmatch(tenant):
        raise PinError("tenant: expected a tenant's name as the pool config names it (1-64 characters of "
                       "[A-Za-z0-9_.-]), never its salt")
    return tenant
