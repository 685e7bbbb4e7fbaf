"""The locality index on a Redis Cluster (``redis+cluster://host:port[,host:port...]``,
``rediss+cluster://`` for TLS), through redis-py's cluster client.

Schema: the registry of :mod:`.redis` unchanged — ``pof:{pof}:node-inc``, ``inc-node``, ``live``,
``info``, ``seq``, ``inc-owner``, all in the one slot of the hash tag ``{pof}``, so its Lua scripts
(heartbeat, leave) run as on one server — and the page records spread over the slots::

    pof:{<namespace hex>/<b>}:loc   HASH   b = byte 16 of the page's chain digest mod BUCKETS (32):
                                           field: the first 16 bytes of the digest, value: holder
                                           records, 17 bytes each, as in :mod:`.redis`

A namespace (one model) thus lives in 32 hashes whose hash tags land on up to 32 slots, spread
over the shards by CRC16; records and fields are those of :mod:`.redis`, so the memory per
location is that of one field of a large hash, as on one server (about 90 bytes with one holder;
``pof bench index --cluster`` measures it), times (1 + replicas) for the cluster in all.

A lookup is one parallel round: the query's fields are grouped by bucket, every bucket's
``HMGET`` is pre-encoded (as in :mod:`.redis`) and the ``HMGET`` of all buckets a shard serves are
sent as one pipelined buffer to that shard's master, together with ``TIME`` and the leases' ``GET`` to
the registry's master; all buffers are written before any reply is read. Publish and withdraw run
the scripts of :mod:`.redis` once per bucket, pipelined per shard (a cluster pipeline).

Failover: a master that dies makes every call that needs it fail fast (connection refused, or
the configured timeout) with :class:`~.base.IndexUnavailable`: a miss for the caller, counted
and logged once by :class:`~.guarded.IndexGuard`. Any failed call or ``MOVED``/``ASK`` reply
refreshes the slot map (at most every 0.2 s); a lookup answered ``MOVED`` is sent once more on the
new map. Replication is asynchronous, so a promoted replica may lack the last writes — publishes
(misses, harmless), withdraws (a stale location: the pool's header, generation and checksum check
turns it into a miss) or the registration of a new incarnation (its number could be given again).
So: a new registration waits (``WAIT``) until a replica has it, and every heartbeat compares the
cluster's slot-to-master map with the last one it saw; when it changed, the node leaves and
registers again — a new incarnation, so records of the former one (and any stale record a
promoted replica kept) are never returned again, and the node re-publishes what it holds, as
after an index restart on one server.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import redis
from redis._parsers.encoders import Encoder
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.commands.core import Script
from redis.crc import key_slot
from redis.exceptions import AskError, RedisClusterException
from redis.retry import Retry

from pof_connector.config.cluster_url import ClusterUrl
from pof_connector.config.credentials import IndexAuth
from pof_connector.index.base import (
    MEDIA,
    IndexTimeout,
    IndexUnavailable,
    NodeInfo,
    PrefixMatch,
    check_one_namespace,
)
from pof_connector.index.cluster_summaries import BUCKET_BYTE as BUCKET_BYTE
from pof_connector.index.cluster_summaries import BUCKETS as BUCKETS
from pof_connector.index.cluster_summaries import REGISTRY_SLOT, ClusterSummaries, flag_key
from pof_connector.index.cluster_summaries import bucket_key as bucket_key
from pof_connector.index.held_connections import HeldConnections
from pof_connector.index.live_set import Registry
from pof_connector.index.record_runs import FIELD_BYTES, leading_runs
from pof_connector.index.redis import (
    FIELD_RESP_BYTES,
    K_INFO,
    K_LIVE,
    LIVE_QUERY,
    REGISTRY_KEYS,
    RedisIndex,
    fields_resp,
    hmget_head,
)
from pof_connector.pages.keys import PageKey

log = logging.getLogger("pof_connector.index")
WAIT_MS = 100
"""How long a heartbeat waits for a replica to acknowledge a new registration."""
REFRESH_EVERY_S = 0.2
_DIGEST = operator.attrgetter("digest")
T = TypeVar("T")


class LazyCluster:
    """A ``RedisCluster`` made on first use (``make`` reaches the cluster to learn its slots): a
    cluster that does not answer when a pool starts costs misses, not a failed start. Every
    attribute but :meth:`register_script`, :meth:`get_encoder` and :meth:`close` is the client's,
    so it is looked up inside the index's guarded calls."""

    def __init__(self, make: Callable[[], RedisCluster]) -> None:
        self._make = make
        self._client: RedisCluster | None = None
        self._lock = threading.Lock()

    def get(self) -> RedisCluster:
        """The client; raises ``RedisError`` / ``RedisClusterException`` while no node answers."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._make()
        return self._client

    def __getattr__(self, name: str) -> Any:
        if name == "connection_pool":      # Script asks for it, then falls back to get_encoder()
            raise AttributeError(name)
        return getattr(self.get(), name)

    def get_encoder(self) -> Encoder:
        return Encoder("utf-8", "strict", False)  # type: ignore[no-untyped-call]

    def register_script(self, script: str) -> Script:
        return Script(self, script)  # type: ignore[arg-type]

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


class RedisClusterIndex(ClusterSummaries, RedisIndex):
    """A :class:`~.base.LocalityIndex` client on a Redis Cluster; thread-safe. Every call
    succeeds or raises :class:`~.base.IndexUnavailable`, as :class:`.redis.RedisIndex`."""

    SEGMENTS = True
    """Placed keys go to segment summaries and records, bucketed by their segment's field."""

    def __init__(self, url: str, node_id: str | None, *, timeout_s: float = 1.0,
                 auth: IndexAuth | None = None) -> None:
        self._topo: tuple[tuple[int, int, bytes], ...] | None = None
        self._refreshed = 0.0
        self._refresh_lock = threading.Lock()
        self._bucket_cache: dict[bytes, tuple[list[bytes], list[int]]] = {}
        self._kind_cache: dict[tuple[bytes, str], list[bytes]] = {}
        self._held = HeldConnections()
        super().__init__(url, node_id, timeout_s=timeout_s, auth=auth)

    def close(self) -> None:
        self._held.close()
        super().close()

    def _connect(self, url: str, auth: IndexAuth | None, timeout_s: float) -> Any:
        parsed = ClusterUrl.parse(url)
        kw: dict[str, Any] = auth.redis_kwargs() if auth is not None else {}
        if parsed.username is not None:
            kw.setdefault("username", parsed.username)
        if parsed.password is not None:
            kw.setdefault("password", parsed.password)
        if parsed.tls:
            kw["ssl"] = True
        nodes = [ClusterNode(h, p) for h, p in parsed.nodes]  # type: ignore[no-untyped-call]
        # Fail fast: a dead master is a miss now; the slot map is refreshed by _call, and the
        # guard's back-off paces the next try.
        return LazyCluster(lambda: RedisCluster(startup_nodes=nodes, socket_timeout=timeout_s,
                                                socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 1), **kw))

    def _call(self, what: str, fn, *args, **kw):  # type: ignore[no-untyped-def]
        try:
            return fn(*args, **kw)
        except redis.TimeoutError as e:
            self._refresh()
            raise IndexTimeout(f"index {self.shown_url}: {what} timed out: {e}") from e
        except (redis.RedisError, RedisClusterException) as e:
            self._refresh()
            raise IndexUnavailable(f"index {self.shown_url}: {what} failed: {e}") from e

    def _refresh(self, force: bool = False) -> None:
        """Re-read the slot map from the cluster (after a failure: a master may have moved)."""
        with self._refresh_lock:
            if not force and time.monotonic() - self._refreshed < REFRESH_EVERY_S:
                return
            self._refreshed = time.monotonic()
            try:
                self._r.nodes_manager.initialize()
            except (redis.RedisError, RedisClusterException) as e:
                log.debug("pof: cluster slot map refresh failed: %s", e)

    def _primary(self, slot: int) -> ClusterNode:
        return self._masters_of((slot,))[slot]

    def _masters_of(self, slots: Iterable[int]) -> dict[int, ClusterNode]:
        """The master of each slot, from one read of the slot map (reaching it through
        :class:`LazyCluster` cost ~0.5 us, and a lookup asked for 9 to 33 slots)."""
        cache = self._r.nodes_manager.slots_cache
        out: dict[int, ClusterNode] = {}
        for slot in slots:
            nodes = cache.get(slot)
            if not nodes:
                raise RedisClusterException(f"slot {slot} is not served by any master the client knows")
            out[slot] = nodes[0]
        return out

    def _pin_client(self) -> redis.Redis:
        return self._registry()

    def _registry(self) -> redis.Redis:
        """A client of the master serving the registry's slot."""
        client: redis.Redis = self._r.get_redis_connection(self._primary(REGISTRY_SLOT))
        return client

    # ---- registration -----------------------------------------------------------------------

    def heartbeat(self, info: NodeInfo, ttl_s: float) -> bool:
        topo = self._call("topology", self._topology)
        moved = self._topo is not None and topo != self._topo
        if moved:
            log.warning("pof: the index cluster's masters changed; node %s registers again and re-publishes "
                        "(a promoted replica may lack the last writes)", info.node_id)
            self._refresh(force=True)
            if self._inc is not None:
                self.leave()
        fresh = super().heartbeat(info, ttl_s)
        self._topo = topo
        return fresh or moved

    def _topology(self) -> tuple[tuple[int, int, bytes], ...]:
        """(first slot, last slot, master's node id) of every slot range, as the registry's master sees them."""
        rows = self._registry().execute_command("CLUSTER", "SLOTS")  # type: ignore[no-untyped-call]
        return tuple(sorted((int(r[0]), int(r[1]), bytes(r[2][2])) for r in rows))

    def _register(self, args: list[Any]) -> list[Any]:
        """The heartbeat script, then ``WAIT`` on the same connection, so that a new registration
        is on a replica before the node publishes under it. Answered ``MOVED`` (a map refreshed
        right after a failover can still name the former master: seen under load in CI), it is
        sent once more on a map read again; the script did not run, so nothing is done twice."""
        try:
            return self._register_once(args)
        except AskError:
            self._refresh(force=True)
            return self._register_once(args)

    def _register_once(self, args: list[Any]) -> list[Any]:
        pipe = self._registry().pipeline(transaction=False)
        pipe.eval(self._heartbeat.script, len(REGISTRY_KEYS), *REGISTRY_KEYS, *args)
        if len(self._r.nodes_manager.slots_cache.get(REGISTRY_SLOT, ())) > 1:
            pipe.execute_command("WAIT", 1, WAIT_MS)  # type: ignore[no-untyped-call]
        reply: list[Any] = pipe.execute()[0]
        return reply

    def _nodes_raw(self) -> tuple[list[bytes], list[bytes | None]]:
        r = self._registry()
        t = r.time()
        now_ms = t[0] * 1000 + t[1] // 1000
        live: list[bytes] = list(r.zrangebyscore(K_LIVE, f"({now_ms}", "+inf"))  # type: ignore[arg-type]
        infos: list[bytes | None] = list(r.hmget(K_INFO, live)) if live else []  # type: ignore[arg-type]
        return live, infos

    # ---- records ----------------------------------------------------------------------------

    def _loc_key(self, key: PageKey) -> str:
        return bucket_key(key.namespace, key.digest[BUCKET_BYTE] % BUCKETS)

    def _write(self, what: str, records: dict[str, tuple[bytes, bytes]]) -> None:
        script = (self._publish if what == "publish" else self._withdraw).script

        def send() -> None:
            pipe = self._r.pipeline(transaction=False)
            for key, (fields, recs) in records.items():
                pipe.execute_command("EVAL", script, 1, key, fields, recs)
            if what == "publish":       # placeless pages here: placed lookups read per-page fields too
                for ns in {key[key.index("{") + 1:key.index("/")] for key in records}:
                    pipe.execute_command("SET", flag_key(bytes.fromhex(ns)), "1")
            pipe.execute()
        self._call(what, send)

    def _buckets(self, namespace: bytes) -> tuple[list[bytes], list[int]]:
        """Each bucket's hash key and slot, for ``namespace``."""
        got = self._bucket_cache.get(namespace)
        if got is None:
            if len(self._bucket_cache) >= 1024:      # namespaces are models: a bound that never bites
                self._bucket_cache.clear()
            keys = [bucket_key(namespace, b).encode() for b in range(BUCKETS)]
            got = self._bucket_cache[namespace] = (keys, [key_slot(k) for k in keys])
        return got

    def longest_prefix(self, keys: Sequence[PageKey]) -> dict[str, PrefixMatch]:
        if not keys:
            return {}
        ns = check_one_namespace(keys)
        plan = self._segment_plan(keys)
        if plan is not None:
            return self._retried(ns, lambda: self._segment_lookup(ns, keys, plan))
        joined = b"".join(list(map(_DIGEST, keys)))
        digests = np.frombuffer(joined, dtype=np.uint8).reshape(len(keys), -1)
        before = self._masters(ns)
        try:
            now, live, vals = self._call("lookup", self._lookup_round, ns, digests)
        except IndexUnavailable as e:
            # Sent once more when the slot map that _call refreshed differs: MOVED (an AskError),
            # or a master that died and whose replica took over since the last refresh (without
            # this, the first lookup of a process after a failover would be a miss).
            moved = isinstance(e.__cause__, AskError)
            if isinstance(e, IndexTimeout) or not (moved or self._masters(ns) != before):
                raise
            now, live, vals = self._call("lookup", self._lookup_round, ns, digests)
        return self._matches(leading_runs(vals, self._alive(now, live), len(MEDIA)))

    def _retried(self, ns: bytes, lookup: Callable[[], T]) -> T:
        """``lookup``, sent once more when it failed on MOVED or on a master that the refreshed slot
        map no longer names (as the per-page lookup is)."""
        # The slot map's refresh stamp, not the masters themselves: listing 33 masters cost a
        # lookup a tenth of its time. A failed call refreshes the map (at most every 0.2 s).
        before = self._refreshed
        try:
            return lookup()
        except IndexUnavailable as e:
            moved = isinstance(e.__cause__, AskError)
            if isinstance(e, IndexTimeout) or not (moved or self._refreshed != before):
                raise
            return lookup()

    def _masters(self, ns: bytes) -> list[str]:
        """The masters a lookup in ``ns`` goes to, as the slot map says now ([] if a slot has none)."""
        try:
            slots = (REGISTRY_SLOT, *self._buckets(ns)[1])
            masters = self._masters_of(slots)
            return [masters[s].name for s in slots]
        except (redis.RedisError, RedisClusterException):
            return []

    def _lookup_round(self, ns: bytes, digests: np.ndarray) -> tuple[list[bytes], Registry, list[Any]]:
        """``TIME``, the leases and the query's records in query order, in one parallel round."""
        bucket = digests[:, BUCKET_BYTE] % BUCKETS
        order = np.argsort(bucket, kind="stable")
        counts = np.bincount(bucket, minlength=BUCKETS)
        body = fields_resp(digests[order, :FIELD_BYTES])     # every field, in bucket order
        bucket_keys, slots = self._buckets(ns)
        used = np.flatnonzero(counts).tolist()
        masters = self._masters_of([REGISTRY_SLOT, *(slots[b] for b in used)])
        registry = masters[REGISTRY_SLOT]
        plan: dict[str, tuple[ClusterNode, list[bytes], list[int]]] = {registry.name: (registry, [LIVE_QUERY], [])}
        start = 0
        for b in used:
            node = masters[slots[b]]
            _, parts, served = plan.setdefault(node.name, (node, [], []))
            n = int(counts[b])
            parts += (hmget_head(bucket_keys[b], n), body[start * FIELD_RESP_BYTES:(start + n) * FIELD_RESP_BYTES])
            served.append(b)
            start += n
        replies = self._exchange({name: (node, b"".join(parts), len(served) + (2 if name == registry.name else 0))
                                  for name, (node, parts, served) in plan.items()})
        now, live = replies[registry.name][0], replies[registry.name][1]
        per_bucket: list[Any] = []
        for name, (_, _, served) in plan.items():
            got = replies[name][2:] if name == registry.name else replies[name]
            per_bucket.extend(zip(served, got, strict=True))
        per_bucket.sort(key=lambda pair: pair[0])
        vals = np.empty(len(digests), dtype=object)
        vals[order] = [v for _, hm in per_bucket for v in hm]
        return now, live, vals.tolist()

    def _exchange(self, plan: dict[str, tuple[ClusterNode, bytes, int]],
                  meanwhile: Callable[[], object] | None = None) -> dict[str, list[Any]]:
        """Write each node's buffer, then read its replies (``n`` of them), all nodes at once;
        raises the first error reply after every reply was read. ``meanwhile``: run between the
        writes and the reads (this client's work overlaps the servers'). Each thread keeps its
        connections to the masters between calls (:mod:`.held_connections`)."""
        out: dict[str, list[Any]] = {}
        first_error: redis.ResponseError | None = None
        ok = False
        try:
            conns = []
            for node, packed, _ in plan.values():
                conn = self._held.take(self._r.get_redis_connection(node).connection_pool, self._refreshed)
                conns.append(conn)
                conn.send_packed_command([packed], check_health=False)
            if meanwhile is not None:
                meanwhile()
            for (name, (_, _, n)), conn in zip(plan.items(), conns, strict=True):
                got = []
                for _ in range(n):
                    try:
                        got.append(conn.read_response())
                    except redis.ResponseError as e:      # one reply; the others are still read
                        got.append(None)
                        first_error = first_error or e
                out[name] = got
            ok = True
        finally:
            if not ok:
                self._held.drop()       # unread replies or a dead socket: never reuse these
        if first_error is not None:
            raise first_error
        return out

    # ---- upkeep -----------------------------------------------------------------------------

    def _hscan(self, namespace: bytes, batch: int) -> Iterator[tuple[str, bytes, bytes]]:
        for b in range(BUCKETS):
            key = bucket_key(namespace, b)
            for field, val in self._r.hscan_iter(key, count=batch):
                yield key, field, val

    def stats(self) -> dict[str, int]:
        def collect() -> dict[str, int]:
            fields = mem = 0
            for node in self._r.get_primaries():
                r = self._r.get_redis_connection(node)
                for key in r.scan_iter(match="pof:{*}:loc", count=1000):
                    fields += int(r.hlen(key))
                mem += int(r.info("memory")["used_memory"])
            live, _ = self._nodes_raw()
            return {"locations": fields + self._summary_locations(), "memory_bytes": mem, "nodes": len(live)}
        result: dict[str, int] = self._call("stats", collect)
        return result

    def ping_ms(self) -> float:
        t0 = time.perf_counter()
        self._call("ping", lambda: self._registry().ping())
        return (time.perf_counter() - t0) * 1000
