"""An ASGI application served by a real uvicorn on 127.0.0.1 in a thread, for tests that need
real connections (slow clients, the fuzz tests' HTTP calls)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from pof_connector.bench.vllm_server import free_port
from pof_connector.body_limits import server_config


@contextlib.contextmanager
def serve(app: Any, read_timeout_s: float = 30.0) -> Iterator[str]:
    """Serve ``app`` (lifespan included) as `pof router` and `pof index serve` do, until the block
    ends; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(server_config(app, "127.0.0.1", port, timeout_s=read_timeout_s))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
