"""Slow clients (slowloris: a body, or the headers, trickled a byte at a time) against `pof router`
and the locality API, each served by a real uvicorn configured as the commands do: others are
answered meanwhile, and the slow connections are closed after ``read_timeout_s`` (those whose
request began, i.e. whose headers are in, with a 408)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from pof_connector.index.redis import RedisIndex
from pof_connector.index.server import RedisServer
from pof_connector.locality.api import make_app as locality_app
from pof_connector.router.proxy import make_app as router_app
from pof_connector.router.serve import build
from tests.http_server import serve
from tests.router.test_proxy import StandInEngine, engines, router_config  # noqa: F401  (fixture)

TIMEOUT_S = 1.0
SLOW = 4


def slow_client(url: str, path: str, stop: threading.Event) -> socket.socket:
    """A connection that sent its headers (announcing a 1000-byte body) and one body byte; a
    thread sends one more byte every 0.2 s until ``stop``, the server closes it, or shortly
    before the server's deadline (bytes sent after the server closed would reset the connection,
    which drops the answer unread)."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: 1000\r\n\r\n{{".encode())

    def trickle() -> None:
        end = time.monotonic() + TIMEOUT_S - 0.3
        while not stop.wait(0.2) and time.monotonic() < end:
            try:
                s.sendall(b" ")
            except OSError:
                return
    threading.Thread(target=trickle, daemon=True).start()
    return s


def slow_headers(url: str, path: str, stop: threading.Event) -> socket.socket:
    """A connection that trickles its request line and headers, a byte every 0.2 s."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n".encode())

    def trickle() -> None:
        end = time.monotonic() + TIMEOUT_S - 0.3
        while not stop.wait(0.2) and time.monotonic() < end:
            try:
                s.sendall(b"X")
            except OSError:
                return
    threading.Thread(target=trickle, daemon=True).start()
    return s


def answer_and_close(s: socket.socket, within_s: float) -> tuple[bytes, float]:
    """What the server sent until it closed the connection, and when it closed it."""
    start = time.monotonic()
    s.settimeout(within_s)
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except TimeoutError:
        pytest.fail(f"the slow connection was still open after {within_s} s; got {got!r}")
    return got, time.monotonic() - start


def check_slow_clients(url: str, slow_path: str, quick: str) -> None:
    stop = threading.Event()
    try:
        slow = [slow_client(url, slow_path, stop) for _ in range(SLOW)]
        headers = [slow_headers(url, slow_path, stop) for _ in range(SLOW)]
        t = time.monotonic()
        r = httpx.get(url + quick, timeout=5)
        assert r.status_code == 200 and time.monotonic() - t < 0.5, (r.status_code, time.monotonic() - t)
        for s in slow:
            got, _ = answer_and_close(s, within_s=TIMEOUT_S + 3)
            assert got.startswith(b"HTTP/1.1 408") and b"did not arrive within" in got, got
            s.close()
        for s in headers:          # no request began: nothing to answer, the connection is closed
            got, _ = answer_and_close(s, within_s=TIMEOUT_S + 3)
            assert got == b"", got
            s.close()
        assert httpx.get(url + quick, timeout=5).status_code == 200
    finally:
        stop.set()


def test_slow_clients_do_not_hold_the_router(engines: dict[str, StandInEngine]) -> None:  # noqa: F811
    router, _ = build(router_config(engines, policy="least_loaded", read_timeout_s=TIMEOUT_S))
    with serve(router_app(router), read_timeout_s=TIMEOUT_S) as url:
        check_slow_clients(url, "/v1/completions", "/health")
        r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3]}, timeout=5)
        assert r.status_code == 200 and r.headers["x-pof-backend"] in engines


@pytest.fixture
def index(redis_server: RedisServer) -> Iterator[RedisIndex]:
    reader = RedisIndex(redis_server.url, None)
    yield reader
    reader.close()


def test_slow_clients_do_not_hold_the_locality_api(index: RedisIndex) -> None:
    with serve(locality_app(index, read_timeout_s=TIMEOUT_S), read_timeout_s=TIMEOUT_S) as url:
        check_slow_clients(url, "/v1/locality", "/healthz")
