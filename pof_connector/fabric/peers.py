"""The connections to remote nodes, shared by the reader and the spill writer.

A connection is made lazily on first use, from the metadata the node publishes, and counted:
whoever :meth:`Peers.acquire` s one must :meth:`Peers.release` it; a dropped connection is closed
only when the last user released it (a READ in flight must not lose its descriptor lists). A node
that failed is backed off: it gets no new reads or writes until its back-off ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from pof_connector.fabric.agent import FabricError, NixlAgent
from pof_connector.fabric.meta import AGENT_KEY, PeerMeta
from pof_connector.fabric.remote_node import RemoteNode
from pof_connector.index import NodeInfo

log = logging.getLogger(__name__)

SUSPECT_AFTER_TIMEOUT_S = 5.0
"""A peer that missed a deadline gets no new reads for this long (a stalled peer stays stalled)."""
RECONNECT_AFTER_ERROR_S = 1.0
"""After a disconnect, wait this long before connecting again from the index's metadata."""


class Peers:
    """Connected remote nodes over ``agent``: each one's descriptor lists are prepared for pages
    of ``page_bytes`` read in ``spans`` (see :class:`~pof_connector.fabric.remote_node.RemoteNode`).
    ``timeout_s`` only names the limit in errors; callers pass their own deadlines. Thread-safe."""

    def __init__(self, agent: NixlAgent, page_bytes: int, spans: Sequence[tuple[int, int]],
                 timeout_s: float) -> None:
        self.agent = agent
        self.page_bytes = page_bytes
        self.spans = list(spans)
        self.timeout_s = timeout_s
        self._peers: dict[str, RemoteNode] = {}
        self._suspect: dict[str, float] = {}          # node → monotonic time it may be used again
        self._connecting: dict[str, tuple[str, Future[None]]] = {}    # node → (agent name, attempt)
        self._connector = ThreadPoolExecutor(1, thread_name_prefix="pof-fabric-connect")
        self._closed = False
        self._lock = threading.Lock()

    @property
    def connected(self) -> list[str]:
        """Nodes connected now."""
        with self._lock:
            return list(self._peers)

    def usable(self, node: str) -> bool:
        """False while ``node`` is in a back-off after a timeout or a disconnect."""
        with self._lock:
            return self._suspect.get(node, 0.0) <= time.monotonic()

    def retain(self, live: Mapping[str, NodeInfo]) -> None:
        """Disconnect peers that left the index (heartbeat expired) or restarted (new agent)."""
        with self._lock:
            gone = [n for n, p in self._peers.items() if n not in live or live[n].meta.get(AGENT_KEY) != p.name]
        for node in gone:
            log.info("pof fabric: dropping peer %s (left the index or restarted)", node)
            self._drop(node)

    def back_off(self, node: str, seconds: float, *, drop: bool) -> None:
        """Use ``node`` for nothing during ``seconds``; ``drop`` also closes its connection (after a
        disconnect error: it never recovers, reconnect from fresh metadata later)."""
        if drop:
            self._drop(node, seconds)
        else:
            with self._lock:
                self._suspect[node] = max(self._suspect.get(node, 0.0), time.monotonic() + seconds)

    def acquire(self, node: str, meta: PeerMeta, deadline: float | None = None) -> RemoteNode:
        """The connected peer (connecting lazily from ``meta``); call :meth:`release` after use.
        Raises :class:`FabricError` (``peer_down`` while ``node`` is in a back-off).

        Connecting runs on the connect thread: loading a peer's metadata opens UCX endpoints,
        which blocks for seconds when the peer's address is unreachable (a cut link). A load
        waits for it only until its ``deadline`` (``None``: as long as it takes, as a spill on the
        store thread does); the connection goes on in the background.
        """
        with self._lock:
            if self._suspect.get(node, 0.0) > time.monotonic():
                raise FabricError("peer_down", f"{node} failed recently; not reading from it for now")
            peer = self._peers.get(node)
            if peer is not None and peer.name != meta.agent:
                self._detach(node)
                peer = None
            if peer is not None:
                peer.inflight += 1
                return peer
            pending = self._connecting.get(node)
            if pending is None or pending[0] != meta.agent:
                # One connection attempt per peer incarnation, whoever asks (1-40 ms normally).
                pending = (meta.agent, self._connector.submit(self._connect, node, meta))
                self._connecting[node] = pending
        try:
            pending[1].result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            with self._lock:
                self._suspect[node] = max(self._suspect.get(node, 0.0), time.monotonic() + SUSPECT_AFTER_TIMEOUT_S)
            raise FabricError("timeout", f"connecting to {node} took longer than {self.timeout_s}s") from None
        with self._lock:
            peer = self._peers.get(node)
            if peer is None or peer.name != meta.agent:
                raise FabricError("peer_down", f"{node} was dropped while connecting")
            peer.inflight += 1
            return peer

    def release(self, peer: RemoteNode) -> None:
        """``peer`` is not used by this caller any more (closed here if it was dropped meanwhile)."""
        with self._lock:
            peer.inflight -= 1
            close = peer.closing and peer.inflight == 0
        if close:
            peer.close(self.agent)

    def close(self) -> None:
        """Disconnect every peer (a connection under way ends, or fails, first)."""
        with self._lock:
            self._closed = True
        self._connector.shutdown(wait=True)
        with self._lock:
            nodes = list(self._peers)
        for node in nodes:
            self._drop(node)

    def _connect(self, node: str, meta: PeerMeta) -> None:
        """On the connect thread: load ``meta`` into our agent and prepare its descriptor lists."""
        try:
            peer = RemoteNode(self.agent, node, meta, self.page_bytes, self.spans)
        except FabricError as e:
            with self._lock:
                self._suspect[node] = max(self._suspect.get(node, 0.0), time.monotonic() + RECONNECT_AFTER_ERROR_S)
                self._connecting.pop(node, None)
            log.warning("pof fabric: could not connect to %s: %s", node, e)
            raise
        with self._lock:
            self._connecting.pop(node, None)
            stale = self._closed or (node in self._peers and self._peers[node].name == peer.name)
            if not stale:
                old = self._detach(node)
                self._peers[node] = peer
        if stale:
            peer.close(self.agent)
            return
        if old is not None and old.inflight == 0:
            old.close(self.agent)
        log.info("pof fabric: connected to %s (%s)", node, peer.name)

    def _drop(self, node: str, backoff_s: float = 0.0) -> None:
        with self._lock:
            if backoff_s:
                self._suspect[node] = max(self._suspect.get(node, 0.0), time.monotonic() + backoff_s)
            peer = self._detach(node)
            close = peer is not None and peer.inflight == 0
        if close and peer is not None:
            peer.close(self.agent)

    def _detach(self, node: str) -> RemoteNode | None:
        """Under the lock: forget ``node``'s peer; it is closed by whoever sees inflight reach 0."""
        peer = self._peers.pop(node, None)
        if peer is not None:
            peer.closing = True
        return peer
