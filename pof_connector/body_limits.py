"""Request bodies the HTTP servers (locality API, `pof router`) accept: bounded in size and in time.

:class:`BodyLimits` is ASGI middleware that reads a request's whole body before the application
sees it: a body over ``max_bytes`` is refused (413; from its Content-Length before any of it is
read, else as soon as the bytes received pass it, which also bounds chunked bodies that declare
no length), and a body that has not all arrived ``timeout_s`` after the request began is answered
408. Both answers close the connection. So a client that sends headers and then trickles its body
(slowloris) holds a connection for ``timeout_s`` at most, and never holds anything the server
needs for other requests (each connection is its own task). :func:`server_config` bounds the
headers' time the same way.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
ErrorBody = Callable[[int, str], dict[str, Any]]
"""The JSON error body for (status, message), in the server's own error format."""


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class BodyLimits:
    """Reads each HTTP request's body whole, within ``max_bytes`` and ``timeout_s``, then hands
    the request to ``app`` (which receives the body as one message)."""

    def __init__(self, app: ASGIApp, *, max_bytes: int, timeout_s: float, error: ErrorBody,
                 settings: tuple[str, str] = ("", "")) -> None:
        """``settings``: the names of the settings for ``max_bytes`` and ``timeout_s``, quoted in
        the error messages (empty: none)."""
        self.app = app
        self._size_name, self._time_name = (f" ({n})" if n else "" for n in settings)
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.error = error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await asyncio.wait_for(self._read(scope, receive), self.timeout_s)
        except _Refused as e:
            await self._refuse(send, e.status, str(e))
            return
        except TimeoutError:
            await self._refuse(send, 408, f"the request body did not arrive within {self.timeout_s:g} s"
                                          f"{self._time_name}")
            return
        if body is None:             # the client left while sending it: nobody to answer
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()   # after the body: the disconnect the application may wait for

        await self.app(scope, replay, send)

    async def _read(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole body; ``None`` when the client disconnected. Raises :class:`_Refused`."""
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            raise _Refused(413, f"the request body is {int(declared)} bytes; at most {self.max_bytes} are accepted"
                                 f"{self._size_name}")
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            part = message.get("body", b"")
            size += len(part)
            if size > self.max_bytes:
                raise _Refused(413, f"the request body is over {self.max_bytes} bytes, the most accepted"
                               f"{self._size_name}")
            parts.append(part)
            if not message.get("more_body", False):
                return b"".join(parts)

    async def _refuse(self, send: Send, status: int, message: str) -> None:
        payload = json.dumps(self.error(status, message)).encode()
        # "connection: close": the unread rest of the body must not be taken for the next request
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


def server_config(app: Any, host: str, port: int, *, timeout_s: float) -> Any:
    """uvicorn's ``Config`` for a pof HTTP server: on top of :class:`BodyLimits` (which the app
    adds), a connection whose next request's headers have not all arrived ``timeout_s`` after it
    opened or after its last answer is closed. uvicorn has no such limit: a client trickling its
    headers (or sending none) held a connection for ever; only idle keep-alive ones were closed."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level="warning", http=_header_deadline(timeout_s))


def _header_deadline(timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools when installed, as uvicorn's "auto" picks, else h11) that
    closes a connection whose request has not begun ``timeout_s`` after it was armed."""
    base: type[Any]
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base

    class HeaderDeadline(base):  # type: ignore[misc]
        # uvicorn starts a new ``cycle`` for each request once its headers are in: the same cycle
        # still current at the deadline means no request began since the timer was armed
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._pof_arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._pof_arm()

        def _pof_arm(self) -> None:
            self.loop.call_later(timeout_s, self._pof_expire, self.cycle)

        def _pof_expire(self, armed: Any) -> None:
            if self.cycle is armed and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline
