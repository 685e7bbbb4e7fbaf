"""The routed requests' client (pof_connector.router.forward) against raw loopback servers: what it
sends, its one retry on a stale connection, and what it raises."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable

import pytest

from pof_connector.router.forward import BackendError, Forwarder, Sent

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _head(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request's head and body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                   if line.startswith(b"content-length:")), 0)
    return head, await reader.readexactly(length)


def _run(handler: Handler, scenario: Callable[[str], Awaitable[None]]) -> None:
    async def main() -> None:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        try:
            await scenario(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        finally:
            server.close()
    asyncio.run(main())


def test_bodies_pass_through_as_bytes_both_ways() -> None:
    """The request's body and headers as given (no Content-Type or Accept-Encoding of the client's
    own), the answer's body as sent: a gzip-encoded one is not decompressed."""
    heads: list[bytes] = []
    gz = b"\x1f\x8b not really gzip"

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, body = await _head(reader)
        heads.append(head + body)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n%s" % (len(gz), gz))
        await writer.drain()
        writer.close()

    async def scenario(url: str) -> None:
        f = Forwarder(5.0, {"authorization": "Bearer k"})
        try:
            sent = Sent()
            before = time.perf_counter()
            answer = await f.send("POST", url + "/v1/completions", b'{"prompt": [1]}', {"x-a": "1"}, sent)
            assert sent.at is not None and before < sent.at <= time.perf_counter()
            assert answer.status == 200 and answer.headers["content-encoding"] == "gzip"
            assert b"".join([c async for c in answer.chunks()]) == gz
            answer.close()
        finally:
            await f.aclose()

    _run(handler, scenario)
    head = heads[0].lower()
    assert head.startswith(b"post /v1/completions http/1.1\r\n") and head.endswith(b'\r\n\r\n{"prompt": [1]}')
    assert b"authorization: bearer k\r\n" in head and b"x-a: 1\r\n" in head
    assert b"content-type" not in head and b"accept-encoding" not in head


def test_a_request_on_a_stale_connection_is_sent_once_more() -> None:
    """A backend that closes the connection on a request without answering (a kept-alive one it
    has just dropped) gets the request a second time, on a new connection; twice is a failure."""
    seen: list[int] = []

    def closing(answer_after: int) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _head(reader)
            seen.append(1)
            if len(seen) > answer_after:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
            writer.close()
        return handler

    async def once(url: str) -> None:
        f = Forwarder(5.0)
        try:
            answer = await f.send("POST", url + "/v1/completions", b"{}", {})
            assert await answer.read() == b"ok"
        finally:
            await f.aclose()

    async def never(url: str) -> None:
        f = Forwarder(5.0)
        try:
            with pytest.raises(BackendError, match="ServerDisconnected"):
                await f.send("POST", url + "/v1/completions", b"{}", {})
        finally:
            await f.aclose()

    _run(closing(answer_after=1), once)
    assert len(seen) == 2
    seen.clear()
    _run(closing(answer_after=99), never)
    assert len(seen) == 2


def test_a_refused_connection_fails_at_once_and_a_silent_backend_times_out() -> None:
    with socket.socket() as s:           # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _head(reader)
        await asyncio.sleep(5)           # never answers in time

    async def scenario(url: str) -> None:
        f = Forwarder(0.3)
        try:
            with pytest.raises(BackendError, match="Connect"):
                await f.send("POST", f"http://127.0.0.1:{port}/v1/completions", b"{}", {})
            began = time.monotonic()
            with pytest.raises(BackendError):
                await f.send("POST", url + "/v1/completions", b"{}", {})
            assert time.monotonic() - began < 2.0
        finally:
            await f.aclose()

    _run(handler, scenario)


def test_an_answer_left_unread_closes_its_connection() -> None:
    """A client that leaves a stream: closing its unfinished answer closes the backend connection
    (the engine aborts the request), it does not go back to the pool."""
    gone = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        if await reader.read() == b"":        # the router's end closed
            gone.set()

    async def scenario(url: str) -> None:
        f = Forwarder(5.0)
        try:
            answer = await f.send("POST", url + "/v1/completions", b"{}", {})
            chunks = answer.chunks()
            assert await anext(chunks) == b"first"
            await chunks.aclose()
            answer.close()
            await asyncio.wait_for(gone.wait(), 2.0)
        finally:
            await f.aclose()

    _run(handler, scenario)
