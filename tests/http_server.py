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


@contextlib.contextmanager
def serve(app: Any) -> Iterator[str]:
    """Serve ``app`` (lifespan included) until the block ends; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
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
