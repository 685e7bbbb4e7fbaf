"""`pof router`'s client for the requests it routes: an :class:`aiohttp.ClientSession` (issue 42).

httpx's send cost the router about 0.45 ms per request (its ``proxy`` stage); aiohttp's client,
whose HTTP parser is in C, costs less. Only the routed requests (completions, chat, the passthrough
paths and P/D mode's prefill half) go through here; health checks, ``/metrics`` readings,
``/tokenize`` and ``/v1/models`` stay on the proxy's httpx client, off the requests' path.

Bodies pass through as bytes, both ways: the request's unchanged, the answer's as the backend sent
it (chunked transfer coding undone, nothing decompressed). The session asks for no compression
(no ``Accept-Encoding``), so there is none to pass on unannounced, and adds no ``Content-Type`` of
its own (vLLM's FastAPI reads a body without one as JSON, one with ``application/octet-stream``
not).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from types import SimpleNamespace

import aiohttp

STALE = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
"""What a request sent on a kept-alive connection that the backend has just closed fails with (a
server closes one after an internal error, or at its keep-alive timeout): such a request is sent
once more, on a new connection, before the backend counts as failed. Only errors before any
answer: a backend that answered nothing has done nothing the client saw. Not a refused or failed
connect (:class:`aiohttp.ClientConnectorError`, an ``ClientOSError`` too): that backend is down."""
FAILED = (aiohttp.ClientError, asyncio.TimeoutError)
"""Everything aiohttp raises for a backend that did not answer, or broke its answer off."""


class BackendError(Exception):
    """The backend refused the connection, closed it, timed out or broke its answer off."""


class Sent:
    """When a request was last written whole to its backend connection (aiohttp's
    ``on_request_chunk_sent`` trace: the end of the router's ``proxy`` stage); ``None`` until it
    is. A body goes out in one write, so its one chunk is the whole request; a request without a
    body has no chunk, and is sent when its headers are (``on_request_headers_sent``)."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at: float | None = None


async def _mark_sent(_: aiohttp.ClientSession, ctx: SimpleNamespace, __: object) -> None:
    sent: Sent | None = ctx.trace_request_ctx
    if sent is not None:
        sent.at = time.perf_counter()


class Answer:
    """A backend's answer whose headers are in: its status, headers and body as it arrives."""

    __slots__ = ("_resp", "headers", "status")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status = resp.status
        self.headers: Mapping[str, str] = resp.headers

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body, each piece as it arrives (a streamed answer's chunks); raises
        :class:`BackendError` when the backend breaks it off."""
        content = self._resp.content
        try:
            while chunk := await content.readany():
                yield chunk
        except FAILED as e:
            raise BackendError(f"{type(e).__name__}: {e}") from e

    async def read(self) -> bytes:
        """The whole body; raises :class:`BackendError` when the backend breaks it off."""
        try:
            return await self._resp.read()
        except FAILED as e:
            raise BackendError(f"{type(e).__name__}: {e}") from e

    def close(self) -> None:
        """Done with it: a connection whose answer was read whole goes back to the pool, one whose
        answer was not is closed (so the engine aborts a request its client left)."""
        self._resp.release()


class Forwarder:
    """The routed requests' connection pool: up to 512 connections, kept alive between requests.
    ``timeout_s`` bounds the wait for each read from the backend (a non-streamed answer's whole
    computation, a stream's gaps), as httpx's read timeout did; connecting gets 5 seconds.
    ``headers`` go with every request (the backends' API key). Create it in a running event loop."""

    def __init__(self, timeout_s: float, headers: Mapping[str, str] | None = None) -> None:
        trace = aiohttp.TraceConfig()
        trace.on_request_chunk_sent.append(_mark_sent)
        trace.on_request_headers_sent.append(_mark_sent)
        self.session = aiohttp.ClientSession(
            # idle connections dropped after 4 s: before vLLM's uvicorn drops them (5 s), which would
            # cost a request the stale-connection retry
            connector=aiohttp.TCPConnector(limit=512, limit_per_host=0, keepalive_timeout=4.0),
            timeout=aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_connect=5.0, sock_read=timeout_s),
            headers=headers, skip_auto_headers=("Accept-Encoding", "Content-Type"), auto_decompress=False,
            trace_configs=[trace], cookie_jar=aiohttp.DummyCookieJar())

    async def send(self, method: str, url: str, body: bytes | None, headers: Mapping[str, str],
                   sent: Sent | None = None) -> Answer:
        """Send a request and wait for its answer's headers; a request that meets a stale
        kept-alive connection (:data:`STALE`) is sent once more. ``sent`` learns when the request
        was written. Raises :class:`BackendError`; cancelled, it closes the connection."""
        try:
            try:
                resp = await self._request(method, url, body, headers, sent)
            except aiohttp.ClientConnectorError:
                raise
            except STALE:
                resp = await self._request(method, url, body, headers, sent)
        except FAILED as e:
            raise BackendError(f"{type(e).__name__}: {e}") from e
        return Answer(resp)

    async def _request(self, method: str, url: str, body: bytes | None, headers: Mapping[str, str],
                       sent: Sent | None) -> aiohttp.ClientResponse:
        # no redirects: a backend's 3xx is the client's to follow, as httpx left it
        return await self.session.request(method, url, data=body, headers=headers, allow_redirects=False,
                                          trace_request_ctx=sent)

    async def aclose(self) -> None:
        await self.session.close()
