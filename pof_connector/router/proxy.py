"""`pof router`: an OpenAI-compatible proxy in front of vLLM or SGLang servers.

``POST /v1/completions`` and ``/v1/chat/completions`` (streaming or not) go to the backend that
:class:`~pof_connector.router.router.Router` picks; the body is forwarded unchanged and the
answer streamed back with a header ``x-pof-backend`` naming the backend. A backend that refuses
the connection is taken out and the request goes to the next best one. ``GET /v1/models``,
``/health``, ``/metrics`` (Prometheus) and ``/pof/backends`` (the router's view) complete it;
every other path (``/tokenize``, ``/v1/responses``, ``/v1/embeddings``, ...) is passed to the
least loaded backend unchanged.

Hostile input is answered, not served: a body over ``max_body_bytes`` is refused (413) before it
is read whole, one not all received within ``read_timeout_s`` gets a 408 (slow clients), a body
that is not a JSON object (or nests too deeply) and token ids outside 0..2^32-1 get a 400 with
an OpenAI-style error, a text prompt over ``max_tokenize_chars`` is not tokenized (the backend's
own length check refuses it). A client that disconnects while its non-streamed answer is
computed closes the backend connection, so the engine aborts the request.

Prompt tokens: token-id prompts are used as given; text prompts are tokenized locally with the
model's ``tokenizer.json`` (:class:`~pof_connector.router.tokenizer_source.TokenizerSource`),
chat requests rendered with the model's chat template and tokenized locally too
(:class:`~pof_connector.router.chat_prompt.ChatPrompt`), or, those it does not render, by a backend's
``POST /tokenize`` (vLLM's; exact, chat template included). Without tokens the request still goes
through, to the least loaded backend.

Every routed answer says how it was routed: ``x-pof-backend``, ``x-pof-reason`` (policy),
``x-pof-route-reason`` (why this node, :attr:`Decision.route
<pof_connector.router.router.Decision.route>`), ``x-pof-estimated-ttft``, ``x-pof-displacement``
(:attr:`Decision.displacement_s <pof_connector.router.router.Decision.displacement_s>`), ``x-pof-kv-need-blocks``
/ ``x-pof-kv-free-blocks`` (the chosen node's admission), ``x-pof-saturated`` (backends full for
this request), ``x-pof-tokens`` (where the prompt's tokens came from) and
``x-pof-balance`` (``gain=G,margin=M``: the lowest estimate beat the least loaded backend's by G
seconds, and had to beat it by more than the estimates' measured error M, or the request goes to
the least loaded: route ``load-balanced``), ``x-pof-router-overhead`` (seconds the router spent
before the request was written to the backend: the router's own share of the TTFT), by stage in
``x-pof-router-stages`` (:mod:`~pof_connector.router.stage_clock`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from pof_connector.body_limits import BodyLimits
from pof_connector.locality.locator import Tokenizer
from pof_connector.pages.keys import shared_salt_of
from pof_connector.router.backend import Ticket
from pof_connector.router.chat_prompt import TOKENIZE_FIELDS
from pof_connector.router.forward import Answer, BackendError, Forwarder, Sent
from pof_connector.router.inline_gate import InlineGate
from pof_connector.router.openai_shapes import document
from pof_connector.router.pd_proxy import decode_body, prefill_half
from pof_connector.router.prefix_tokenizer import PrefixTokenizer
from pof_connector.router.proxy_metrics import ProxyMetrics
from pof_connector.router.request_body import (
    BadRequest,
    generation_limit,
    is_unicode,
    json_object,
    read_body,
    text_length,
    token_ids,
)
from pof_connector.router.router import Decision, NoBackend, Router
from pof_connector.router.side_requests import health_loop, load_loop, tokenize
from pof_connector.router.stage_clock import StageClock
from pof_connector.router.tokenizer_source import TokenizerSource

log = logging.getLogger("pof.router")
_FORWARD_HEADERS = ("content-type", "authorization", "accept")
INLINE_RENDER_MESSAGES = 64
"""Chat requests of up to this many messages are rendered on the event loop, longer ones on a thread."""
INLINE_TOKENIZE_CHARS = 2048
"""Text prompts up to this long are tokenized on the event loop (about a millisecond or less);
longer ones on a thread, so one huge prompt does not stall every other request."""
DISCONNECT_POLL_S = 0.25
"""How often a request waiting for its backend's answer checks that its client is still there."""
CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
"""The engine's count of prompt tokens it did not compute, in a streamed answer's final usage
chunk (vLLM: with ``--enable-prompt-tokens-details`` and ``stream_options.include_usage``)."""
TAIL_BYTES = 8192
"""Bytes of a streamed answer's end kept to find its usage."""


OPEN_PATHS = frozenset({"/health", "/metrics"})
"""Paths answered without the API key, as vLLM leaves them open (probes and scrapers)."""


def make_app(router: Router, *, tokenizer: Tokenizer | None = None, prefill: Router | None = None) -> FastAPI:
    """The router's app. Its API key (``api_key_env`` / ``api_key_file``) and the backends' key
    are read here, once; a request without the key gets vLLM's 401 (``/health`` and
    ``/metrics`` stay open). With a backend key, the client's ``Authorization`` is replaced by
    it; without one, the client's header is passed on unchanged. ``tokenizer``: the text
    tokenizer to use (``None``: the config's ``tokenizer``, see
    :class:`~pof_connector.router.tokenizer_source.TokenizerSource`). ``prefill``: P/D mode, the
    prefill group's router (``router``'s backends are then the decode group; see
    :mod:`~pof_connector.router.pd_proxy`)."""
    cfg = router.config
    gate = InlineGate()
    metrics = ProxyMetrics(router, gate)
    tokens_source = TokenizerSource(cfg.tokenizer if tokenizer is None else "backend", cfg.chat_template)
    if tokenizer is not None:
        tokens_source.tokenizer, tokens_source.origin = tokenizer, "local"
    state: dict[str, httpx.AsyncClient] = {}       # health, /metrics, /tokenize, /v1/models
    forwarder: list[Forwarder] = []                 # the routed requests' client, made in the event loop
    expected = f"Bearer {key}".encode() if (key := cfg.api_key()) is not None else None
    backend_key = cfg.backend_api_key()
    backend_headers = {"authorization": f"Bearer {backend_key}"} if backend_key is not None else {}
    forward = _FORWARD_HEADERS if backend_key is None else tuple(h for h in _FORWARD_HEADERS if h != "authorization")

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
        state["client"] = httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout_s, connect=5.0), limits=limits,
                                            headers=backend_headers)
        forwarder.append(Forwarder(cfg.request_timeout_s, backend_headers))
        tasks = []
        for group in (router, prefill) if prefill is not None else (router,):
            tasks.append(asyncio.create_task(health_loop(group, state["client"], tokens_source)))
            if cfg.policy == "pof" and cfg.capacity.enabled:
                tasks.append(asyncio.create_task(load_loop(group, state["client"])))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await state["client"].aclose()
            await forwarder.pop().aclose()

    app = FastAPI(title="pof router", version="1", description=__doc__, lifespan=lifespan)
    app.add_middleware(BodyLimits, max_bytes=cfg.max_body_bytes, timeout_s=cfg.read_timeout_s, error=_error_body,
                       settings=("max_body_bytes", "read_timeout_s"))

    if expected is not None:
        app.add_middleware(_RequireKey, expected=expected)

    async def prompt_tokens(path: str, body: dict[str, Any]) -> tuple[list[int] | None, str]:
        """The prompt's token ids to route on and where they came from ('request', 'local',
        'backend'); ``None``, 'none': route without them (no prompt, a prompt too long to
        tokenize first, or no tokenizer answered). Raises :class:`BadRequest`."""
        if path.endswith("/completions") and "chat" not in path:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
                prompt = prompt[0]            # a batch: route on its first prompt
            if isinstance(prompt, list):
                return token_ids(prompt), "request"
            if not isinstance(prompt, str) or len(prompt) > cfg.max_tokenize_chars:
                return None, "none"
            local = tokens_source.tokenizer
            if local is not None:
                return await local_ids(local, prompt, True), "local"
            got = await tokenize(router, state["client"], {"model": body.get("model"), "prompt": prompt})
            return got, "backend" if got is not None else "none"
        messages = body.get("messages")
        if not isinstance(messages, list) or text_length(messages) > cfg.max_tokenize_chars:
            return None, "none"
        chat, local = tokens_source.chat, tokens_source.tokenizer
        if chat is not None and isinstance(local, PrefixTokenizer):
            # Rendering walks every message: a long conversation (or a hostile list of empty
            # messages, which the length check lets through) renders on a thread.
            rendered = chat.render(body) if len(messages) <= INLINE_RENDER_MESSAGES else \
                await asyncio.to_thread(chat.render, body)
            if rendered is not None:
                return await local_ids(local, *rendered), "local"
        ask = {k: body[k] for k in TOKENIZE_FIELDS if k in body}
        got = await tokenize(router, state["client"], ask)
        return got, "backend" if got is not None else "none"

    async def local_ids(local: Tokenizer, text: str, special_tokens: bool) -> list[int]:
        """``text``'s ids from the local tokenizer (``special_tokens``: added, as for a completions
        prompt). Short texts in the event loop: a thread hop costs more than they do (so does a
        long one whose leading text the tokenizer has cached)."""
        if isinstance(local, PrefixTokenizer):
            if len(text) <= INLINE_TOKENIZE_CHARS or local.uncached_chars(text) <= INLINE_TOKENIZE_CHARS:
                return local(text, special_tokens)
            return await asyncio.to_thread(local, text, special_tokens)
        return local(text) if len(text) <= INLINE_TOKENIZE_CHARS else await asyncio.to_thread(local, text)

    async def proxy(request: Request, path: str, *, route_by_prompt: bool = True) -> Response:
        """Forward ``request`` to the backend the router picks, routing on the prompt when
        ``route_by_prompt`` (completions and chat) and least-loaded otherwise."""
        clock = StageClock()
        try:
            raw = await read_body(request, cfg.max_body_bytes)
            body = json_object(raw) if route_by_prompt else None
            clock.lap("parse")
            tokens, source = await prompt_tokens(path, body) if body is not None else (None, "none")
            clock.lap("tokenize")
        except BadRequest as e:
            return _error(e.status, str(e))
        max_tokens = generation_limit(body)
        streamed = body is not None and body.get("stream") is True
        session = request.headers.get(cfg.sticky_header) if cfg.sticky_header else None
        salt = body.get("cache_salt") if body is not None and isinstance(body.get("cache_salt"), str) else None
        if salt is not None and not is_unicode(salt):
            return _error(400, "'cache_salt' is not valid Unicode (it holds a lone UTF-16 surrogate)")
        shared_salt, shared_tokens = shared_salt_of(body.get("kv_transfer_params") if body is not None else None)
        if shared_salt is not None and not is_unicode(shared_salt):
            return _error(400, "'kv_transfer_params.pof_shared_salt' is not valid Unicode")
        shared = (shared_salt, shared_tokens) if shared_salt is not None and shared_tokens > 0 else None
        headers = {k: v for k, v in request.headers.items() if k.lower() in forward}
        target = path + (f"?{request.url.query}" if request.url.query else "")
        pd_header: dict[str, str] = {}
        if prefill is not None and body is not None and route_by_prompt:
            if tokens is not None and len(tokens) < cfg.pd_min_prefill_tokens:
                pd_header["x-pof-prefill"] = "none:short-prompt"      # computed on the decode server
            else:
                handoff, pd_header["x-pof-prefill"] = await prefill_half(prefill, forwarder[0], target, body,
                                                                        tokens, headers, salt)
                raw = decode_body(body, handoff)
                clock.skip()
        tried: set[str] = set()
        while True:
            try:
                decision = await gate.run(functools.partial(router.choose, tokens, cache_salt=salt, session=session,
                                                            exclude=frozenset(tried), max_tokens=max_tokens,
                                                            shared=shared))
            except NoBackend as e:
                return _error(503, str(e))
            b = decision.backend
            ticket = b.admit(decision.prefill_tokens, decision.kv_blocks, decision.chain)
            sent = clock.lap("choose")
            clock.move(decision.lookup_s, source="choose", target="lookup")
            written = Sent()
            try:
                resp = await _send_unless_gone(forwarder[0].send(request.method, b.url + target, raw or None, headers,
                                                                 written), request)
            except BackendError as e:
                clock.lap("proxy")
                b.finish(ticket)
                b.check_failed(str(e), now=True)
                metrics.errors.labels(b.name).inc()
                tried.add(b.name)
                continue
            except _ClientGone:
                # A non-streamed answer has no headers until it is complete: the client left while
                # the backend computed it. Dropping the connection makes the engine abort it.
                b.finish(ticket)
                metrics.abandoned.labels(b.name).inc()
                return Response(status_code=499)
            clock.lap("proxy", written.at)
            metrics.requests.labels(b.name, decision.reason).inc()
            metrics.observe_stages(clock)
            if route_by_prompt:
                metrics.tokens_from.labels(source).inc()
            out_headers = {"x-pof-backend": b.name, "x-pof-reason": decision.reason,
                           "x-pof-router-overhead": f"{clock.total:.6f}", "x-pof-router-stages": clock.header(),
                           "x-pof-tokens": source, **pd_header}
            if decision.route:
                metrics.routes.labels(b.name, decision.route).inc()
                out_headers["x-pof-route-reason"] = decision.route
            if decision.estimate is not None:
                out_headers["x-pof-estimated-ttft"] = f"{decision.estimate.ttft_s:.4f}"
                out_headers["x-pof-displacement"] = f"{decision.displacement_s:.4f}"
            if decision.balance is not None:
                out_headers["x-pof-balance"] = "gain={:.4f},margin={:.4f}".format(*decision.balance)
            if decision.admission is not None:
                out_headers["x-pof-kv-need-blocks"] = str(decision.admission.need_blocks)
                if decision.admission.free_blocks is not None:
                    out_headers["x-pof-kv-free-blocks"] = str(decision.admission.free_blocks)
            if decision.saturated:
                out_headers["x-pof-saturated"] = ",".join(decision.saturated)
            return StreamingResponse(_relay(resp, decision, ticket, sent, streamed, tokens),
                                     status_code=resp.status, headers=out_headers,
                                     media_type=resp.headers.get("content-type"))

    async def _relay(resp: Answer, decision: Decision, ticket: Ticket,
                     sent: float, streamed: bool, tokens: list[int] | None) -> AsyncIterator[bytes]:
        b = decision.backend
        ttft: float | None = None
        tail = b""
        try:
            async for chunk in resp.chunks():
                if not ticket.first_token_seen:
                    ttft = time.perf_counter() - sent
                    b.first_token(ticket)
                    metrics.ttft.labels(b.name).observe(ttft)
                tail = (tail + chunk)[-TAIL_BYTES:]
                yield chunk
        except BackendError as e:
            b.check_failed(f"broken response: {e}", now=True)
            metrics.errors.labels(b.name).inc()
        finally:
            b.finish(ticket)
            resp.close()
            # After the answer, off its path: what this backend was sent before, then this prompt.
            guess = router.sent.cached_then_record(b.name, tokens) if tokens else 0
            # Only a streamed answer's first chunk is its first token (a non-streamed one arrives
            # whole); learnt once the stream ended, with the cached tokens its usage reports, else
            # the prefix this router sent the backend before (what its engine probably caches).
            est = decision.estimate
            if streamed and ttft is not None and est is not None and resp.status == 200:
                found = CACHED_TOKENS.findall(tail)
                cached = int(found[-1]) if found else max(guess, est.prompt_tokens - est.recompute_tokens)
                router.cost.observe(est, ttft, cached)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        for b in router.healthy():
            try:
                r = await state["client"].get(b.url + "/v1/models")
                return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
            except httpx.TransportError as e:
                b.check_failed(str(e), now=True)
        return _error(503, "no healthy backend")

    @app.get("/health")
    def health() -> JSONResponse:
        n = len(router.healthy())
        return JSONResponse({"ok": n > 0, "healthy_backends": n}, status_code=200 if n else 503)

    @app.get("/pof/backends")
    def backends() -> dict[str, Any]:
        return {"policy": cfg.policy, "cost": {"overhead_s": router.cost.overhead_s,
                                               "prefill_s_per_token": router.cost.s_per_token,
                                               "s_per_decoding_request": router.cost.s_per_decoding,
                                               "fetch_factor": router.cost.fetch_factor,
                                               "estimate_error_s": router.cost.error_s,
                                               "observed": router.cost.observed},
                "tokenizer": tokens_source.origin,
                "backends": [b.state() for b in router.backends]}

    @app.get("/metrics")
    def prom() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type="text/plain; version=0.0.4")

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    async def passthrough(request: Request, path: str) -> Response:
        """The rest of the engine's API (``/tokenize``, ``/v1/responses``, ``/v1/embeddings``, ...)
        goes to the least loaded healthy backend, unchanged."""
        return await proxy(request, "/" + path, route_by_prompt=False)

    document(app)
    return app


class _RequireKey:
    """401 for an HTTP request without ``Authorization: Bearer <key>``, but on :data:`OPEN_PATHS`.
    Plain ASGI, not Starlette's BaseHTTPMiddleware: that one hides a client's disconnect from the
    endpoint, which then could not cancel the backend request."""

    def __init__(self, app: ASGIApp, expected: bytes) -> None:
        self.app = app
        self.expected = expected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not secrets.compare_digest(given, self.expected):
                refusal = _error(401, "Unauthorized: send the router's API key as 'Authorization: Bearer KEY'",
                                 kind="authentication_error", headers={"WWW-Authenticate": "Bearer"})
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _ClientGone(Exception):
    """The client disconnected before the backend's answer began."""


async def _send_unless_gone(sending: Coroutine[Any, Any, Answer], request: Request) -> Answer:
    """Await ``sending`` (a request until its answer's headers), unless ``request``'s client
    disconnects first (then the send is cancelled, closing the backend connection, and
    :class:`_ClientGone`)."""
    send = asyncio.ensure_future(sending)
    while True:
        done, _ = await asyncio.wait({send}, timeout=DISCONNECT_POLL_S)
        if done:
            return send.result()
        if await request.is_disconnected():
            send.cancel()
            with contextlib.suppress(asyncio.CancelledError, BackendError):
                late = await send
                late.close()    # it arrived just before the cancel: unclosed, its connection would leak
            raise _ClientGone()


def _error_body(status: int, message: str, kind: str = "pof_router") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": status}}


def _error(status: int, message: str, *, kind: str = "pof_router",
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(_error_body(status, message, kind), status_code=status, headers=headers)
