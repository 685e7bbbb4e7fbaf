"""The locality query API: where does a prompt's prefix live?

``POST /v1/locality`` takes a prompt (token ids, or text when a tokenizer for the model was
given) and answers, per live node, how many leading tokens it holds and in which tiers, with the
node's free capacity and its engine's load (when a relay reads it). ``GET /v1/nodes`` lists live
nodes, ``/metrics`` is Prometheus, ``/healthz`` says whether the index answers, ``/docs`` and
``/openapi.json`` describe it all.

The answer comes from :class:`~pof_connector.locality.locator.Locator`, which `pof router` uses
too. Served by ``pof index serve`` on 127.0.0.1 by default; a bearer token can be
required (``/healthz`` stays open for probes).
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest
from pydantic import BaseModel, Field, model_validator

from pof_connector.body_limits import BodyLimits
from pof_connector.index import IndexUnavailable, LocalityIndex, NodeInfo
from pof_connector.locality.engine_load import EngineLoad
from pof_connector.locality.index_health import IndexHealth
from pof_connector.locality.locator import Locator, ModelRequired, Tokenizer, UnknownModel, load_tokenizer
from pof_connector.locality.pin_routes import add_pin_routes
from pof_connector.pins.pin_desk import PinDesk

log = logging.getLogger("pof.api")

MAX_TOKENS = 1 << 20          # a 1M-token prompt is 4 MiB of JSON: beyond that, refuse
MAX_TOKEN_ID = 0xFFFFFFFF
MAX_BODY_BYTES = 16 << 20
"""Larger bodies are refused (413): from their Content-Length before they are read, else once
that many bytes arrived (:class:`~pof_connector.body_limits.BodyLimits`). The longest valid
query (MAX_TOKENS ids of 10 digits, or 8 x MAX_TOKENS characters of text) is smaller."""
READ_TIMEOUT_S = 30.0
MAX_ERRORS = 10
"""Validation errors listed in a 422 (a million wrong token ids would be a million errors)."""


class LocalityQuery(BaseModel):
    model: str | None = Field(None, description="model as the engines' pof config names it; optional when "
                                                "the index holds exactly one model")
    tokens: list[int] | None = Field(None, max_length=MAX_TOKENS, description="prompt token ids")
    text: str | None = Field(None, max_length=8 * MAX_TOKENS, description="prompt text (needs a tokenizer)")
    cache_salt: str | None = Field(None, max_length=256)
    shared_salt: str | None = Field(None, max_length=256, description="two salts: the organisation's salt, for "
                                                                      "the first shared_tokens tokens")
    shared_tokens: int = Field(0, ge=0, description="two salts: the tokens of the shared prefix")

    @model_validator(mode="after")
    def one_prompt(self) -> LocalityQuery:
        if (self.tokens is None) == (self.text is None):
            raise ValueError("give exactly one of 'tokens' and 'text'")
        if self.tokens is not None and any(t < 0 or t > MAX_TOKEN_ID for t in self.tokens):
            raise ValueError(f"token ids must be in 0..{MAX_TOKEN_ID}")
        return self


class TierTokens(BaseModel):
    tokens: int
    capacity_bytes: int = 0
    free_bytes: int = 0


class NodeLoad(BaseModel):
    running: int = Field(description="requests the engine is running")
    waiting: int = Field(description="requests queued in the engine's scheduler")
    kv_usage: float | None = Field(None, description="fraction of the engine's KV cache held by requests (vLLM "
                                                     "kv_cache_usage_perc, SGLang token_usage); null: not exported")
    kv_capacity_tokens: int | None = Field(None, description="tokens the engine's KV cache holds; null: unknown")
    block_tokens: int | None = Field(None, description="tokens per KV block; null: unknown")
    preemptions: int | None = Field(None, description="requests preempted (vLLM) or retracted (SGLang) since the "
                                                      "engine started; null: unknown")


class NodeLocality(BaseModel):
    node_id: str
    matched_tokens: int = Field(description="leading prompt tokens this node holds (pool or engine)")
    tiers: dict[str, int] = Field(description="held tokens per tier; 'engine' is the engine's own prefix cache")
    usable_tokens: int = Field(description="leading tokens this node's pool can load, own or shared tiers")
    usable: dict[str, int] = Field(description="usable tokens per tier they come from")
    free_bytes: dict[str, int] = Field(description="free capacity per tier")
    load: NodeLoad | None = Field(None, description="the engine's load as its relay last read it (about once a "
                                                    "heartbeat); null when no relay reads it (pof relay --engine-url)")
    meta: dict[str, str]


class LocalityAnswer(BaseModel):
    model: str
    prompt_tokens: int
    page_tokens: int
    nodes: list[NodeLocality] = Field(description="nodes holding a prefix, longest first")


class NodeView(BaseModel):
    node_id: str
    tiers: dict[str, TierTokens]
    meta: dict[str, str]


def make_app(index: LocalityIndex, *, token: str | None = None,
             tokenizers: dict[str, Tokenizer] | None = None, read_timeout_s: float = READ_TIMEOUT_S) -> FastAPI:
    """The API over ``index``; ``token`` requires ``Authorization: Bearer <token>``; a request
    body not all received ``read_timeout_s`` after the request began is answered 408."""
    app = FastAPI(title="pof locality API", version="1", description=__doc__)
    registry = CollectorRegistry()
    requests = Counter("pof_api_requests", "Locality API requests", ["endpoint", "status"], registry=registry)
    locator = Locator(index, tokenizers=tokenizers, nodes_ttl_s=0.0)
    health = IndexHealth("pof locality API", log)
    registry.register(health)

    def refused(status: int, message: str) -> dict[str, Any]:
        requests.labels("(body)", str(status)).inc()
        return {"detail": message}

    app.add_middleware(BodyLimits, max_bytes=MAX_BODY_BYTES, timeout_s=read_timeout_s, error=refused)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own 422 echoes each wrong value ("input"): a 50 MB query got a 52 MB answer.
        errors = exc.errors()
        detail: list[dict[str, Any]] = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", ""))[:300],
                                         "type": e.get("type", "")} for e in errors[:MAX_ERRORS]]
        if len(errors) > MAX_ERRORS:
            detail.append({"loc": [], "msg": f"and {len(errors) - MAX_ERRORS} more errors", "type": "truncated"})
        requests.labels(request.url.path, "422").inc()
        return JSONResponse({"detail": detail}, status_code=422)

    def unavailable(e: IndexUnavailable) -> HTTPException:
        health.lost(type(e).__name__, str(e), "answering 503 until it is back")
        return HTTPException(503, f"the locality index is unreachable: {e}",
                             headers={"x-pof-reason": f"fallback:{type(e).__name__}"})

    def lookup_error(e: ModelRequired | UnknownModel | IndexUnavailable) -> HTTPException:
        """The answer to a lookup's failure: the locality query's and the pin routes' alike."""
        if isinstance(e, IndexUnavailable):
            return unavailable(e)
        return HTTPException(404 if isinstance(e, UnknownModel) else 422, str(e))

    def authorized(request: Request) -> None:
        if token is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {token}".encode()):
            requests.labels(request.url.path, "401").inc()
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    def live_nodes() -> list[NodeInfo]:
        try:
            found = index.nodes()
        except IndexUnavailable as e:
            raise unavailable(e) from None
        health.ok()
        return found

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        return {"ok": True, "nodes": len(live_nodes())}

    @app.get("/v1/nodes", dependencies=[Depends(authorized)])
    def nodes() -> list[NodeView]:
        requests.labels("/v1/nodes", "200").inc()
        return [NodeView(node_id=n.node_id, meta=n.meta,
                         tiers={m: TierTokens(tokens=0, capacity_bytes=t.capacity_bytes, free_bytes=t.free_bytes)
                                for m, t in n.tiers.items()})
                for n in live_nodes()]

    @app.post("/v1/locality", dependencies=[Depends(authorized)])
    def locality(query: LocalityQuery) -> LocalityAnswer:
        try:
            live = locator.nodes()                # one node list for the whole answer
            model = locator.pick_model(query.model, nodes=live)
            tokens = query.tokens if query.tokens is not None else locator.tokenize(model, query.text or "")
            if tokens is None:
                raise HTTPException(422, f"no tokenizer for {model!r} on this server: send 'tokens', or start it "
                                         f"with --tokenizer {model}=DIR")
            found = locator.locate(tokens, model, query.cache_salt, nodes=live, shared_salt=query.shared_salt,
                                   shared_tokens=query.shared_tokens)
        except (ModelRequired, UnknownModel, IndexUnavailable) as e:
            raise lookup_error(e) from None
        health.ok()
        answer = [NodeLocality(node_id=n.node_id, matched_tokens=max(n.held_tokens, n.engine_tokens),
                               tiers={**n.held, **({"engine": n.engine_tokens} if n.engine_tokens else {})},
                               usable_tokens=n.usable_tokens, usable=n.usable,
                               free_bytes={m: t.free_bytes for m, t in n.info.tiers.items()} if n.info else {},
                               load=_node_load(n.load),
                               meta=n.info.meta if n.info else {})
                  for n in found.nodes.values() if n.held_tokens or n.engine_tokens or n.usable_tokens]
        requests.labels("/v1/locality", "200").inc()
        return LocalityAnswer(model=found.model, prompt_tokens=found.prompt_tokens, page_tokens=found.page_tokens,
                              nodes=sorted(answer, key=lambda n: (-n.matched_tokens, -n.usable_tokens, n.node_id)))

    add_pin_routes(app, PinDesk(index, locator), has_token=token is not None, authorized=authorized,
                   lookup_error=lookup_error, tokenize=locator.tokenize)

    @app.get("/metrics", dependencies=[Depends(authorized)])
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(registry).decode(), media_type="text/plain; version=0.0.4")

    return app


def _node_load(load: EngineLoad | None) -> NodeLoad | None:
    if load is None:
        return None
    return NodeLoad(running=load.running, waiting=load.waiting, kv_usage=load.kv_usage,
                    kv_capacity_tokens=load.kv_capacity_tokens, block_tokens=load.block_tokens,
                    preemptions=load.preemptions)


__all__ = ["load_tokenizer", "make_app"]
