"""One connection per (thread, cluster master) kept out of its pool between a cluster client's
lookups (:meth:`RedisClusterIndex._exchange <pof_connector.index.redis_cluster.RedisClusterIndex._exchange>`).

A lookup on a Redis Cluster writes to and reads from up to three masters. Taking each connection
from redis-py's pool and giving it back cost more than its send and receive together: 8.2's pools
record every check-out and return for their observability hooks and poll the socket once per
check-out, about 5 us a master, 15 us of a lookup's 150 us of client CPU (profiled, 2,000 pages,
4 holders). So each thread keeps the connections it used, still counted in use by their pools.

What the pool's check-out did and what stands in for it here:

- *a socket the server closed*: the next write or read on it fails; the exchange then drops every
  connection it held (:meth:`HeldConnections.drop`) and the lookup fails as one on a freshly
  checked-out dead socket does (a miss; the caller refreshes the slot map);
- *a slot map that moved*: a thread's connections are dropped when the client's refresh stamp
  changed since they were taken, so none outlives the map it was taken under;
- *a fork*: a child starts with none (the parent's sockets are the parent's);
- *a thread that ended*: its connections go back to their pools, disconnected, the next time any
  thread checks one out (so a process whose threads come and go holds a connection per master per
  live thread, not per thread it ever ran).
"""

from __future__ import annotations

import os
import threading
from typing import Any


class HeldConnections:
    """Connections kept per thread and per pool. Thread-safe; :meth:`close` disconnects them all."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: dict[int, tuple[Any, Any, int]] = {}
        """Every connection held by any thread, by ``id``, with its pool and its thread's ident:
        what :meth:`close` frees."""
        self._pid = os.getpid()

    def take(self, pool: Any, stamp: float) -> Any:
        """This thread's connection of ``pool`` (checked out of it the first time, or after
        ``stamp``, the slot map's refresh stamp, changed)."""
        held = self._held(stamp)
        conn = held.get(id(pool))
        if conn is None:
            self._free_ended_threads()
            conn = pool.get_connection()
            held[id(pool)] = conn
            with self._lock:
                self._all[id(conn)] = (pool, conn, threading.get_ident())
        return conn

    def drop(self) -> None:
        """Disconnect and give back every connection this thread holds (an exchange failed: a
        socket may hold unread replies or be dead)."""
        held: dict[int, Any] = getattr(self._local, "held", {})
        self._local.held = {}
        for conn in held.values():
            self._release(conn, disconnect=True)

    def close(self) -> None:
        """Disconnect every connection any thread holds."""
        with self._lock:
            every, self._all = list(self._all.values()), {}
        for pool, conn, _ in every:
            _give_back(pool, conn, disconnect=True)

    def _held(self, stamp: float) -> dict[int, Any]:
        if os.getpid() != self._pid:          # forked: the parent's sockets are not this process's
            with self._lock:
                self._pid, self._all = os.getpid(), {}
            self._local = threading.local()
        if getattr(self._local, "stamp", None) != stamp:
            for conn in getattr(self._local, "held", {}).values():
                self._release(conn, disconnect=False)
            self._local.held, self._local.stamp = {}, stamp
        held: dict[int, Any] = self._local.held
        return held

    def _free_ended_threads(self) -> None:
        alive = {t.ident for t in threading.enumerate()}
        with self._lock:
            ended = [(k, pool, conn) for k, (pool, conn, owner) in self._all.items() if owner not in alive]
            for k, _, _ in ended:
                del self._all[k]
        for _, pool, conn in ended:
            _give_back(pool, conn, disconnect=True)

    def _release(self, conn: Any, *, disconnect: bool) -> None:
        with self._lock:
            entry = self._all.pop(id(conn), None)
        if entry is not None:
            _give_back(entry[0], conn, disconnect=disconnect)


def _give_back(pool: Any, conn: Any, *, disconnect: bool) -> None:
    """Return ``conn`` to ``pool`` (``disconnect``: closed first, never to be reused as it is)."""
    if disconnect:
        conn.disconnect()
    pool.release(conn)
