"""A stand-in for a vLLM OpenAI server, for `pof bench router-overhead`: the least HTTP that the
router exercises, answered at once, so the bench times the router and not an engine.

HTTP/1.1 with keep-alive on plain asyncio streams (no framework: FastAPI would cost more than the
router hop it is measured against). It answers ``GET /health``, ``GET /metrics`` (a vLLM-like
page: an idle engine with KV room), ``POST /v1/completions`` and ``/v1/chat/completions`` (a
short SSE stream, sent whole as soon as the body is read) and 404 for the rest (``/v1/models``:
the router then keeps its configured tokenizer).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

METRICS = (b'vllm:num_requests_running{model_name="m"} 0.0\n'
           b'vllm:num_requests_waiting{model_name="m"} 0.0\n'
           b'vllm:kv_cache_usage_perc{model_name="m"} 0.05\n'
           b'vllm:num_preemptions_total{model_name="m"} 0.0\n'
           b'vllm:cache_config_info{block_size="16",num_gpu_blocks="8192"} 1.0\n')
SSE = (b'data: {"choices":[{"text":"a"}]}\n\n', b'data: {"choices":[{"text":"b"}]}\n\n', b"data: [DONE]\n\n")


def _chunked(parts: tuple[bytes, ...]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


STREAM = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
          + _chunked(SSE))
HEALTH = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"ok":true}'
PROM = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n%s" % (len(METRICS), METRICS)
MISSING = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            line, _, rest = head.partition(b"\r\n")
            method, path, _ = line.split(b" ", 2)
            length = 0
            for h in rest.lower().split(b"\r\n"):
                if h.startswith(b"content-length:"):
                    length = int(h[15:])
            if length:
                await reader.readexactly(length)
            if method == b"POST" and path.endswith(b"/completions"):
                writer.write(STREAM)
            elif path == b"/health":
                writer.write(HEALTH)
            elif path.startswith(b"/metrics"):
                writer.write(PROM)
            else:
                writer.write(MISSING)
            await writer.drain()
    writer.close()


class StandInEngines:
    """``count`` stand-in engines on loopback, served by one event loop on a thread of their own."""

    def __init__(self, count: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="stand-in-engines", daemon=True)
        self.thread.start()
        self.servers = [asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10) for _ in range(count)]
        self.urls = [f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in self.servers]

    async def _start(self) -> asyncio.Server:
        return await asyncio.start_server(_serve, "127.0.0.1", 0, limit=1 << 24)

    def stop(self) -> None:
        async def close() -> None:
            for s in self.servers:
                s.close()
        asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
