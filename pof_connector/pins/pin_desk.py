"""Making, listing and removing pins through an index: what ``pof pin`` and the locality API's
``/v1/pins`` share."""

from __future__ import annotations

import time
from collections.abc import Callable

from pof_connector.config.tenant_config import DEFAULT_TENANT
from pof_connector.index import LocalityIndex
from pof_connector.locality.locator import Locator
from pof_connector.pages.keys import PageKey, page_keys
from pof_connector.pins.pin import (
    MAX_PIN_PAGES,
    Pin,
    PinError,
    check_kind,
    check_label,
    check_replicas,
    check_tenant,
    check_ttl,
)


class PinDesk:
    """Pins of ``index``; ``locator`` turns a prompt into the model's keys."""

    def __init__(self, index: LocalityIndex, locator: Locator, clock: Callable[[], float] = time.time) -> None:
        self.index = index
        self.locator = locator
        self._clock = clock

    def pin(self, tokens: list[int], *, model: str | None, cache_salt: str | None, ttl_s: float, kind: str,
            replicas: int = 1, label: str = "", tenant: str = DEFAULT_TENANT) -> Pin:
        """Pin the full pages of ``tokens`` (under ``cache_salt``) in every namespace the model's
        live pool nodes use. Raises :class:`PinError`, and the locator's ``ModelRequired`` /
        ``UnknownModel`` / ``IndexUnavailable``."""
        kind, ttl_s, replicas, label = check_kind(kind), check_ttl(ttl_s), check_replicas(replicas), check_label(label)
        tenant = check_tenant(tenant)
        model, spaces = self.locator.spaces(model)
        keys: list[PageKey] = []
        covered = 0
        for namespace, page_tokens in spaces:
            got = page_keys(namespace, tokens, page_tokens, cache_salt=cache_salt)
            keys += got
            covered = max(covered, len(got) * page_tokens)
        if not keys:
            raise PinError(f"tokens: {len(tokens)} tokens fill no page of {model!r} (pages of "
                           f"{min(p for _, p in spaces) if spaces else '?'} tokens): nothing to pin")
        if len(keys) > MAX_PIN_PAGES:
            raise PinError(f"tokens: the prefix is {len(keys)} pages over all ranks; allowed: {MAX_PIN_PAGES}")
        pin = Pin(Pin.new_id(), tuple(keys), kind, self._clock() + ttl_s, covered, model, replicas, label, tenant)
        self.index.put_pin(pin.pin_id, pin.to_json())
        return pin

    def list(self) -> list[Pin]:
        """The live pins, soonest to end first (malformed and expired records left out)."""
        now = self._clock()
        out = []
        for raw in self.index.pins().values():
            try:
                pin = Pin.from_json(raw)
            except PinError:
                continue
            if pin.live(now):
                out.append(pin)
        return sorted(out, key=lambda p: p.expires_at)

    def now(self) -> float:
        return self._clock()

    def remove(self, pin_id: str) -> bool:
        return self.index.remove_pin(pin_id)
