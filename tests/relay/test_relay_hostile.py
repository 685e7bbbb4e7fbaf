"""Hostile input on the relay's ZMQ side: whatever arrives on the engine's or a followed engine's
event stream, the relay drops what it cannot use, counts it, and goes on relaying.

``FakeEngine`` (a real PUB socket) stands in for vLLM's ``ZmqEventPublisher``; here it also sends
bytes no vLLM would.
"""

from __future__ import annotations

import threading
from typing import Any

import msgspec
import pytest
import zmq

from pof_connector.index.redis import RedisIndex
from pof_connector.index.server import RedisServer
from pof_connector.relay.kv_events import BlockStored, seq_frame
from tests.locality.test_api import node
from tests.relay.test_relay import Harness, engine_pages, stored, tokens, wait_for


def raw_stored(**override: Any) -> dict[str, Any]:
    ev: dict[str, Any] = {"type": "BlockStored", "block_hashes": [901], "parent_block_hash": None,
                          "token_ids": list(range(16)), "block_size": 16, "lora_id": None, "medium": "GPU",
                          "lora_name": None}
    return {**ev, **override}


HOSTILE_PAYLOADS: dict[str, bytes] = {
    "not msgpack": b"\xc1\xc1\xc1",
    "truncated msgpack": msgspec.msgpack.encode([1.0, [raw_stored()], 0])[:-7],
    "wrong shape (a map)": msgspec.msgpack.encode({"ts": 1.0, "events": []}),
    "wrong shape (a number)": msgspec.msgpack.encode(7),
    "events not a list": msgspec.msgpack.encode([1.0, "events", 0]),
    "deeply nested": b"\x91" * 100_000 + b"\x00",
}
HOSTILE_EVENTS: dict[str, dict[str, Any] | str] = {
    "unknown event type": {"type": "BlockMoved", "block_hashes": [1]},
    "event without a type": {"block_hashes": [1]},
    "event not a map": "BlockStored",
    "block hash a dict": raw_stored(block_hashes=[{"a": 1}]),
    "parent hash a list": raw_stored(parent_block_hash=[1]),
    "token ids strings": raw_stored(token_ids=["a"] * 16),
    "negative token ids": raw_stored(token_ids=[-1] * 16),
    "token ids >= 2**32": raw_stored(token_ids=[2**32] * 16),
    "token ids >= 2**63": raw_stored(token_ids=[2**64 - 1] * 16),
    "block size 0": raw_stored(block_size=0),
    "negative block size": raw_stored(block_size=-16),
    "medium a number": raw_stored(medium=3),
}


def send_raw(h: Harness, payload: bytes, frames: int = 3) -> None:
    msg = [b"", seq_frame(h.engine.seq), payload][:frames]
    h.engine.sock.send_multipart(msg)
    h.engine.seq += 1


def test_hostile_engine_input_is_dropped_counted_and_the_stream_goes_on(
        ctx: zmq.Context[Any], redis_server: RedisServer, runtime_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    pool = node("a", redis_server.url, runtime_dir)
    h = Harness(ctx, pool, pool_residency=False)
    index = RedisIndex(redis_server.url, None)
    try:
        wait_for(lambda: any(n.node_id == "a:engine" for n in index.nodes()), what="relay registered")
        h.connect()
        for payload in HOSTILE_PAYLOADS.values():
            send_raw(h, payload)
        send_raw(h, b"", frames=2)                                          # [topic, seq]: no payload
        t = tokens(2)
        good = stored([11], t[:16])
        for i, bad in enumerate(HOSTILE_EVENTS.values()):
            # A good event next to each bad one: only the bad one is dropped.
            ok = msgspec.to_builtins(stored([100 + i], list(range(7000 + 16 * i, 7016 + 16 * i))))
            send_raw(h, msgspec.msgpack.encode([1.0, [bad, ok], 0]))
        h.engine.send(good)
        h.engine.send(stored([12], t[16:], parent=11))
        events = h.tap.wait(lambda ev: any(isinstance(e, BlockStored) and e.block_hashes == [12] for e in ev),
                            "the valid batch after the hostile ones")
        kept = [e.block_hashes[0] for e in events if isinstance(e, BlockStored)]
        assert kept == [100 + i for i in range(len(HOSTILE_EVENTS))] + [11, 12]
        wait_for(lambda: engine_pages(index, t) == 2, what="valid pages indexed after hostile input")
        assert h.thread.is_alive()
        assert h.relay.stats["decode_errors"] == len(HOSTILE_PAYLOADS)
        assert h.relay.stats["bad_frames"] == 1
        assert h.relay.stats["bad_events"] == len(HOSTILE_EVENTS)
        # Logged once per kind, not once per message.
        assert sum("undecodable batch from engine" in r.getMessage() for r in caplog.records) == 1
        assert sum("dropped an event from engine" in r.getMessage() for r in caplog.records) == 1
    finally:
        h.close()
        index.close()
        pool.close()


def test_a_huge_frame_is_refused_and_the_stream_goes_on(ctx: zmq.Context[Any], redis_server: RedisServer,
                                                        runtime_dir: str) -> None:
    pool = node("a", redis_server.url, runtime_dir)
    h = Harness(ctx, pool, pool_residency=False, max_frame_bytes=1 << 20)
    try:
        h.connect()
        send_raw(h, b"\x00" * (64 << 20))
        t = tokens(1)
        sent = threading.Event()

        def through() -> bool:
            # The relay drops its link to an engine that sent an oversized frame; ZMQ reconnects and
            # what the engine sends after that comes through again.
            h.engine.send(stored([21], t))
            sent.set()
            return any(isinstance(e, BlockStored) and e.block_hashes == [21] for e in h.tap.events())
        wait_for(through, timeout=20, what="a valid batch after a 64 MiB frame")
        assert h.thread.is_alive()
        assert h.relay.stats["oversize_frames"] >= 1
    finally:
        h.close()
        pool.close()


def test_hostile_peer_input_is_dropped_and_counted(ctx: zmq.Context[Any], redis_server: RedisServer,
                                                  runtime_dir: str) -> None:
    """A followed engine's stream (its endpoint is taken from the index, which anyone who can write
    the index can point anywhere) gets the same checks as this relay's own engine."""
    pool = node("a", redis_server.url, runtime_dir)
    h = Harness(ctx, pool, pool_residency=False)
    peer = ctx.socket(zmq.PUB)
    peer.bind("tcp://127.0.0.1:0")
    ep = peer.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        wait_for(lambda: h.relay._chains is not None, what="relay adopted the pool node")
        h.relay._wire.follow({ep})
        bad = [*HOSTILE_PAYLOADS.values(),
               *(msgspec.msgpack.encode([1.0, [e], 0]) for e in HOSTILE_EVENTS.values())]

        def counted() -> bool:
            for payload in bad:
                peer.send_multipart([b"", seq_frame(0), payload])
            return h.relay.stats["peer_batches"] >= len(bad)
        wait_for(counted, what="peer batches received")
        assert h.relay.stats["decode_errors"] >= len(HOSTILE_PAYLOADS)
        assert h.relay.stats["bad_events"] >= len(HOSTILE_EVENTS)
        h.connect()                                   # the relay still relays its own engine
        assert h.thread.is_alive()
    finally:
        peer.close(linger=0)
        h.close()
        pool.close()
