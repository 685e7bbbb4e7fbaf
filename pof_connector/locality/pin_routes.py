"""``/v1/pins`` of the locality API: pin a prompt prefix, list pins, remove one.

Pins change what the pool keeps, so these routes answer only on an API started with a bearer
token (403 otherwise), and only to requests that carry it (401)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI, HTTPException
from pydantic import BaseModel, Field, model_validator

from pof_connector.config.tenant_config import DEFAULT_TENANT
from pof_connector.index import IndexUnavailable
from pof_connector.locality.locator import ModelRequired, UnknownModel
from pof_connector.pins.pin import MAX_TTL_S, PinError
from pof_connector.pins.pin_desk import PinDesk

MAX_PIN_TOKENS = 1 << 20


class PinRequest(BaseModel):
    model: str | None = Field(None, description="model as the engines' pof config names it")
    tokens: list[int] | None = Field(None, max_length=MAX_PIN_TOKENS, description="the prefix's token ids")
    text: str | None = Field(None, max_length=8 * MAX_PIN_TOKENS, description="the prefix as text (needs a tokenizer)")
    cache_salt: str | None = Field(None, max_length=256, description="the salt its requests carry")
    ttl_s: float = Field(gt=0, le=MAX_TTL_S, description="how long the pin lives")
    kind: str = Field("soft", description="'soft': evicted last; 'hard': not evicted while the pin lives")
    replicas: int = Field(1, ge=1, le=64, description="nodes that should hold it whole (copied until that many do)")
    label: str = Field("", max_length=64, description="a name to list it by")
    tenant: str = Field(DEFAULT_TENANT, max_length=64, description="whose quota its copies count against (a name)")

    @model_validator(mode="after")
    def one_prefix(self) -> PinRequest:
        if (self.tokens is None) == (self.text is None):
            raise ValueError("give exactly one of 'tokens' and 'text'")
        if self.tokens is not None and any(t < 0 or t > 0xFFFFFFFF for t in self.tokens):
            raise ValueError("token ids must be in 0..4294967295")
        return self


def add_pin_routes(app: FastAPI, desk: PinDesk, *, has_token: bool, authorized: Callable[..., None],
                   lookup_error: Callable[[ModelRequired | UnknownModel | IndexUnavailable], HTTPException],
                   tokenize: Callable[[str, str], list[int] | None]) -> None:
    def pins_allowed() -> None:
        if not has_token:
            raise HTTPException(403, "pins change what the pool keeps: start the API with --token (or "
                                     "--token-env / --token-file) to allow them")

    guards = [Depends(pins_allowed), Depends(authorized)]

    @app.post("/v1/pins", dependencies=guards, status_code=201)
    def create(req: PinRequest) -> dict[str, Any]:
        try:
            tokens = req.tokens
            if tokens is None:
                model, _ = desk.locator.spaces(req.model)
                tokens = tokenize(model, req.text or "")
                if tokens is None:
                    raise HTTPException(422, f"no tokenizer for {model!r} on this server: send 'tokens'")
            pin = desk.pin(tokens, model=req.model, cache_salt=req.cache_salt, ttl_s=req.ttl_s, kind=req.kind,
                           replicas=req.replicas, label=req.label, tenant=req.tenant)
        except PinError as e:
            raise HTTPException(422, str(e)) from None
        except (ModelRequired, UnknownModel, IndexUnavailable) as e:
            raise lookup_error(e) from None
        return pin.summary(desk.now())

    @app.get("/v1/pins", dependencies=guards)
    def listing() -> list[dict[str, Any]]:
        try:
            pins = desk.list()
        except IndexUnavailable as e:
            raise lookup_error(e) from None
        now = desk.now()
        return [p.summary(now) for p in pins]

    @app.delete("/v1/pins/{pin_id}", dependencies=guards)
    def remove(pin_id: str) -> dict[str, Any]:
        try:
            gone = desk.remove(pin_id)
        except IndexUnavailable as e:
            raise lookup_error(e) from None
        if not gone:
            raise HTTPException(404, f"no pin {pin_id!r}")
        return {"removed": pin_id}
