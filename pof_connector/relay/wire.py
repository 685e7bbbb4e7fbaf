"""The relay's ZMQ side: the engine's events in, one re-sequenced stream out, replay, peers.

The stream routers subscribe to is vLLM's (:mod:`.kv_events`): ``[topic, seq, payload]`` with the
relay's own ``seq``, so batches it adds (pool announcements, clears) sit in one order with the
engine's. The last ``buffer_steps`` batches are kept for vLLM's replay protocol (a ROUTER socket
on ``replay_bind``). Other engines' KV events are followed on SUB sockets of their own.

Every SUB socket refuses frames over ``max_frame_bytes`` (``ZMQ_MAXMSGSIZE``: libzmq drops the
link instead of buffering the frame, and reconnects); a monitor counts those dropped links in
``stats["oversize_frames"]`` (an engine that restarted drops its link too, and is counted alike).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator

import zmq

from pof_connector.index.guarded import LogOnce
from pof_connector.relay.config import RelayConfig
from pof_connector.relay.kv_events import END_SEQ, KVEvent, KVEventBatch, encode_batch, seq_frame

log = logging.getLogger(__name__)
DRAIN = 1000          # messages taken from one socket before the loop looks at the others

Received = tuple[str | None, list[bytes]]
"""A message's frames and where they came from: ``None`` for this relay's engine, else the
endpoint of a followed engine."""


class RelayWire:
    """The relay's sockets. ``stats`` (shared with the relay) counts ``batches_out``, ``replays``,
    ``oversize_frames`` (links dropped, see the module docstring) and ``bad_frames`` (malformed
    replay requests).

    Raises ``zmq.ZMQError`` when a bind address is taken.
    """

    def __init__(self, config: RelayConfig, stats: dict[str, int], log_once: LogOnce) -> None:
        self.stats = stats
        self._log_once = log_once
        self._ctx = zmq.Context()
        self._max_frame = config.max_frame_bytes
        self._monitors: dict[zmq.Socket[bytes], tuple[zmq.Socket[bytes], str]] = {}  # -> (SUB socket, endpoint)
        self._poller = zmq.Poller()
        self._engine = self._subscriber(config.engine_topic.encode(), config.engine_events)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(100_000)
        self._pub.bind(config.bind)
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay: zmq.Socket[bytes] | None = None
        self.replay_endpoint: str | None = None
        if config.replay_bind is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(config.replay_bind)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._poller.register(self._engine, zmq.POLLIN)
        if self._replay is not None:
            self._poller.register(self._replay, zmq.POLLIN)
        self._peers: dict[str, zmq.Socket[bytes]] = {}
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)

    @property
    def closed(self) -> bool:
        return bool(self._ctx.closed)

    def receive(self, timeout_s: float) -> Iterator[Received]:
        """Messages that arrive within ``timeout_s``, taken lazily (each is handled before the next
        is read); replay requests are answered here and not yielded."""
        for sock, _ in self._poller.poll(max(0, int(timeout_s * 1000))):
            if sock is self._replay:
                self._serve_replay()
                continue
            if sock in self._monitors:
                self._on_monitor(sock)
                continue
            peer = next((ep for ep, s in self._peers.items() if s is sock), None)
            for frames in _drain(sock):
                if sock is self._engine:
                    yield None, frames
                elif peer is not None:
                    yield peer, frames

    def emit(self, events: list[KVEvent], ts: float | None, rank: int | None) -> None:
        """Publish ``events`` as the stream's next batch (none: nothing is sent)."""
        if not events:
            return
        payload = encode_batch(KVEventBatch(ts=time.time() if ts is None else ts, events=events,
                                            data_parallel_rank=rank))
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart([b"", seq_frame(seq), payload])
        self._buffer.append((seq, payload))
        self.stats["batches_out"] += 1

    def follow(self, endpoints: set[str]) -> None:
        """Subscribe to exactly these engines' KV events (other engines' relays advertise them)."""
        for ep in set(self._peers) - endpoints:
            sock = self._peers.pop(ep)
            self._poller.unregister(sock)
            self._close_monitor(sock)
            sock.close(linger=0)
            log.info("pof relay: stopped following %s", ep)
        for ep in endpoints - set(self._peers):
            sock = self._subscriber(b"", ep)
            self._peers[ep] = sock
            self._poller.register(sock, zmq.POLLIN)
            log.info("pof relay: following the KV events of %s for pool pages computed there", ep)

    def _subscriber(self, topic: bytes, endpoint: str) -> zmq.Socket[bytes]:
        """A SUB socket connected to ``endpoint`` that refuses frames over ``max_frame_bytes``, its
        dropped links monitored."""
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_frame)
        sock.setsockopt(zmq.SUBSCRIBE, topic)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._monitors[monitor] = (sock, endpoint)
        self._poller.register(monitor, zmq.POLLIN)
        sock.connect(endpoint)
        return sock

    def _close_monitor(self, sock: zmq.Socket[bytes]) -> None:
        monitor = next(m for m, (s, _) in self._monitors.items() if s is sock)
        self._poller.unregister(monitor)
        sock.disable_monitor()
        monitor.close(linger=0)
        del self._monitors[monitor]

    def _on_monitor(self, monitor: zmq.Socket[bytes]) -> None:
        """A link dropped. libzmq does not reconnect after a protocol error (such as a frame over
        ZMQ_MAXMSGSIZE): connect again, so the stream goes on (an engine that restarted is only
        connected once: its pending reconnect is cancelled first)."""
        sock, endpoint = self._monitors[monitor]
        dropped = sum(1 for frames in _drain(monitor) if len(frames) >= 2)
        if not dropped:
            return
        self.stats["oversize_frames"] += dropped
        self._log_once(f"dropped-{endpoint}", logging.WARNING,
                       "pof relay: the link to %s dropped (a frame over %d bytes, or it restarted); connecting "
                       "again. Further drops are counted in oversize_frames", endpoint, self._max_frame)
        try:
            sock.disconnect(endpoint)
        except zmq.ZMQError:
            pass              # libzmq forgot the endpoint already (a protocol error ends its session)
        sock.connect(endpoint)

    def _serve_replay(self) -> None:
        """vLLM's replay protocol: every buffered batch from the asked seq on, then END_SEQ."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            self.stats["bad_frames"] += 1
            self._log_once("replay", logging.WARNING, "pof relay: ignoring a replay request of %d frames",
                           len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        self.stats["replays"] += 1
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart([client, b"", b"", seq_frame(seq), payload])
        self._replay.send_multipart([client, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        """Close every socket. Idempotent."""
        if self._ctx.closed:
            return
        for sock in (self._engine, self._pub, self._replay, *self._peers.values(), *self._monitors):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()


def _drain(sock: zmq.Socket[bytes]) -> Iterator[list[bytes]]:
    for _ in range(DRAIN):
        try:
            yield sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
