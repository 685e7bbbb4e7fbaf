"""The locality index on a Redis-protocol server (Redis, Valkey; ``redis://``, ``unix://``, ``embedded``).

Schema (every key carries the hash tag ``{pof}``, so a Redis Cluster keeps them on one shard and
the Lua scripts may touch several)::

    pof:{pof}:seg:<namespace hex>  HASH   field: the first 16 bytes of the chain digest of a segment's
                                          head page (the page at position p - p % SEGMENT_PAGES)
                                          value: its summary (:mod:`.summary`): the tags (8 bytes of
                                                 each page's digest) of up to MAX_TAGS chains per
                                                 offset, and per holder and medium a 16-bit mask per
                                                 tag layer; no slots
    pof:{pof}:rec:<namespace hex>  HASH   field: a segment's field + u32 incarnation
                                          value: that holder's slots and generations in the segment
                                                 (12 bytes a page, grouped by medium and layer)
    pof:{pof}:loc:<namespace hex>  HASH   field: the first 16 bytes of a page's chain digest
                                          value: holder records, 17 bytes each, little-endian
                                                 u32 incarnation | u8 medium | u32 slot | u64 generation
    pof:{pof}:flat:<namespace hex> STRING set while the namespace has pages published without places
    pof:{pof}:node-inc             HASH   node_id -> its current incarnation (decimal)
    pof:{pof}:inc-node             HASH   incarnation -> node_id
    pof:{pof}:live                 ZSET   incarnation, score = expiry in ms of the server's clock
    pof:{pof}:leases               STRING the same incarnations and expiries, 12 bytes each (u32 | f64),
                                          written by the scripts that write the ZSET: what a lookup
                                          reads (one bulk string, not a member and score per holder)
    pof:{pof}:info                 HASH   incarnation -> NodeInfo as JSON (capacity, free bytes per tier)
    pof:{pof}:seq                  STRING incarnation counter

A page whose key knows its place in the chain (:class:`~pof_connector.pages.keys.ChainPlace`: every key
computed from tokens) is recorded in its segment; one without (a digest an engine handed over) in
its own per-page field, and the namespace is flagged. An offset of a segment holds the pages of
at most :data:`~.segments.MAX_TAGS` chains: where more chains part inside one segment, the pages
of the others go to per-page fields and the offset is marked, so a segment where many
conversations leave a shared prompt does not grow for every lookup that reads it.

Liveness uses the server's clock (``TIME`` inside the scripts), so clients' clocks may differ.
A node's entries carry its incarnation; when its heartbeat lapses, or the server restarts empty,
its next heartbeat gets a new incarnation and the node re-publishes, while records of dead
incarnations are ignored by lookups (and dropped by :meth:`RedisIndex.sweep`).

Digests are cut to 16 bytes (fields) and 8 (tags) in the index only: the page header holds the
full key, so a collision costs a miss, never wrong KV.

A lookup of placed keys is one round trip of four pipelined commands — ``TIME``, ``GET`` of the
leases, ``GET`` of the namespace's flag and one ``HMGET`` of the query's summaries (one field
per 16 pages) — sent as a pre-encoded RESP buffer and decoded in C (:mod:`.segments`): it answers
with each holder's run and media, not slots, so its reply grows by 7 bytes per holder and segment,
not by a 26-byte record per holder and page. The loader reads the slots of the holder it picked,
for the pages it loads, when it first asks for them (:meth:`.base.PrefixMatch.resolve`: one
``HMGET`` of that holder's records; a router never does). A second lookup round reads per-page
fields only where a run may go on in them: a marked offset where a run stops, or a flagged
namespace. A lookup of keys without places reads every page's field (``TIME``,
the leases, one ``HMGET``; :mod:`.record_runs`). Reading one field per page cost about 0.2 µs a
field on the server and as much again in the client (one Python object per value), 5-7 ``PING``
times for 2,000 pages; the segments' measurements are in ``docs/index-segments.md``.

Why not a script next to the data: on valkey 9.1 an empty ``EVALSHA`` or ``FCALL`` costs about
one ``PING``, but a script that takes the query as one 32 KB argument (2,000 concatenated
fields), reads them with one ``HMGET`` and returns each live node's run as one packed string
took 3-7 ms of server time for 2,000 pages over 4 nodes, and one that only returns the values
concatenated 2-4 ms, against 0.2-0.5 ms for the plain per-page ``HMGET``: cutting the argument
into 2,000 fields alone costs as much as the plain ``HMGET``, and the same ``HMGET`` called from a
script five times as much (every argument and value converted between Lua and the server).
Writes go through Lua scripts, which keep a key's record list consistent.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pof_connector.config import redact_url
from pof_connector.config.credentials import IndexAuth
from pof_connector.index.base import (
    MEDIA,
    IndexTimeout,
    IndexUnavailable,
    LocalityIndex,
    Location,
    NodeInfo,
    PrefixMatch,
    Resolver,
    check_one_namespace,
    node_id_taken,
)
from pof_connector.index.client import redis_client
from pof_connector.index.keyspace import (
    FLAG_MEMORY_S,
    K_INC_NODE,
    K_INC_OWNER,
    K_INFO,
    K_LEASES,
    K_LIVE,
    K_NODE_INC,
    K_SEQ,
    LIVE_QUERY,
    PREFIX,
    REGISTRY_KEYS,
    flat_key,
    loc_key,
    records_key,
    segment_key,
)
from pof_connector.index.live_set import LiveSet, Registry
from pof_connector.index.pin_store import RedisPins
from pof_connector.index.record_runs import FIELD_BYTES, RECORD, LeadingRuns, leading_runs
from pof_connector.index.resp import FIELD_RESP_BYTES, fields_resp, frame, hmget_head, hmget_resp, page_fields, resp
from pof_connector.index.scripts import (
    HEARTBEAT,
    LEAVE,
    PUBLISH,
    SEGMENT_PRUNE,
    SEGMENT_PUBLISH,
    SEGMENT_WITHDRAW,
    WITHDRAW,
)
from pof_connector.index.segment_path import SegmentPath
from pof_connector.index.segments import SegmentPlan
from pof_connector.index.summary import locations, parse_summary
from pof_connector.pages.keys import PageKey

T = TypeVar("T")
__all__ = ["FIELD_RESP_BYTES", "FLAG_MEMORY_S", "K_INC_NODE", "K_INC_OWNER", "K_INFO", "K_LEASES", "K_LIVE",
           "K_NODE_INC", "K_SEQ", "LIVE_QUERY", "PREFIX", "REGISTRY_KEYS", "RedisIndex", "fields_resp", "flat_key",
           "frame", "hmget_head", "hmget_resp", "loc_key", "page_fields", "records_key", "resp", "segment_key"]


def _node_info(raw: bytes) -> NodeInfo | None:
    """A node's info as its heartbeat stored it; ``None`` when it is not one (a hostile or broken
    index writer: that node is then unknown to this client)."""
    try:
        return NodeInfo.from_json(json.loads(raw))
    except (ValueError, RecursionError):      # a JSONDecodeError is a ValueError
        return None


class RedisIndex(SegmentPath, RedisPins, LocalityIndex):
    """A :class:`LocalityIndex` client on a Redis-protocol server; thread-safe.

    Every call either succeeds or raises :class:`IndexUnavailable` (server down, timeout), which
    callers treat as "nothing known": a miss, never an engine error.
    """

    SEGMENTS = True
    """Whether placed keys go to segment records (else every key to its per-page field)."""

    def __init__(self, url: str, node_id: str | None, *, timeout_s: float = 1.0,
                 auth: IndexAuth | None = None) -> None:
        """``auth``: the ACL user, password and TLS files (``None``: what ``url`` says)."""
        super().__init__(node_id)
        self.url = url
        self.shown_url = redact_url(url)
        """``url`` as logs and errors show it (no password)."""
        self._r: Any = self._connect(url, auth, timeout_s)
        """A ``redis.Redis``, or a ``redis.RedisCluster`` in :class:`.redis_cluster.RedisClusterIndex`:
        the commands this class sends to it are the same on both."""
        self._heartbeat = self._r.register_script(HEARTBEAT)
        self._publish = self._r.register_script(PUBLISH)
        self._withdraw = self._r.register_script(WITHDRAW)
        self._segment_publish = self._r.register_script(SEGMENT_PUBLISH)
        self._segment_withdraw = self._r.register_script(SEGMENT_WITHDRAW)
        self._segment_prune = self._r.register_script(SEGMENT_PRUNE)
        self._leave = self._r.register_script(LEAVE)
        self._inc: int | None = None          # our live registration; None: not registered
        self._last_inc: int | None = None     # the last one we had (a newer holder of our id displaced it)
        self._owner = uuid.uuid4().hex        # tells our registrations from another process's
        self._inc_names: dict[int, str] = {}
        self._flag_seen: dict[bytes, float] = {}
        """Namespace -> when a lookup last saw its placeless flag (monotonic seconds)."""
        self._live_set = LiveSet()
        self._lock = threading.Lock()

    def _connect(self, url: str, auth: IndexAuth | None, timeout_s: float) -> Any:
        return redis_client(
            url, auth, timeout_s=timeout_s,
            # One retry for a connection the server closed (it restarted); none for a timeout: a
            # slow server would only make the caller wait twice as long.
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)), health_check_interval=0,
        )

    def _call(self, what: str, fn, *args, **kw):  # type: ignore[no-untyped-def]
        try:
            return fn(*args, **kw)
        except redis.TimeoutError as e:
            raise IndexTimeout(f"index {self.shown_url}: {what} timed out: {e}") from e
        except redis.RedisError as e:
            raise IndexUnavailable(f"index {self.shown_url}: {what} failed: {e}") from e

    @property
    def incarnation(self) -> int | None:
        return self._inc

    def heartbeat(self, info: NodeInfo, ttl_s: float) -> bool:
        with self._lock:
            prev = "" if self._last_inc is None else str(self._last_inc)
            inc, fresh = self._call("heartbeat", self._register,
                                    [info.node_id, prev, int(ttl_s * 1000), json.dumps(info.to_json()), self._owner])
            if int(fresh) < 0:
                self._inc = None
                raise node_id_taken(info.node_id)
            self._inc = self._last_inc = int(inc)
            return bool(fresh)

    def _register(self, args: list[Any]) -> list[Any]:
        """Run the heartbeat script with ``args``; returns its reply."""
        reply: list[Any] = self._heartbeat(keys=REGISTRY_KEYS, args=args)
        return reply

    def _incarnations(self, entries: Sequence[tuple[PageKey, Location]]) -> dict[str, int]:
        """The current incarnation of every node named in ``entries`` that the index knows. A
        location on another node (a page spilled into a slot that node granted us) is recorded
        under that node's incarnation, so it lives and dies with that node; entries of nodes the
        index does not know are left out."""
        me = self._require_node()
        assert self._inc is not None
        incs = {me: self._inc}
        others = sorted({loc.node for _, loc in entries} - {me})
        if others:
            got = self._call("incarnations", lambda: self._r.hmget(K_NODE_INC, others))
            incs.update({n: int(i) for n, i in zip(others, got, strict=True) if i is not None})
        return incs

    def _records(self, entries: Sequence[tuple[PageKey, Location]],
                 incs: dict[str, int]) -> dict[str, tuple[bytes, bytes]]:
        """Per hash key (:meth:`_loc_key`): (concatenated fields, concatenated records) for the
        per-page scripts."""
        grouped: dict[str, list[tuple[PageKey, Location]]] = {}
        for key, loc in entries:
            if loc.node in incs:
                grouped.setdefault(self._loc_key(key), []).append((key, loc))
        out = {}
        for ns, group in grouped.items():
            recs = np.zeros(len(group), dtype=RECORD)
            recs["inc"] = [incs[loc.node] for _, loc in group]
            recs["medium"] = [MEDIA.index(loc.medium) for _, loc in group]
            recs["slot"] = [loc.slot for _, loc in group]
            recs["gen"] = [loc.generation for _, loc in group]
            out[ns] = (b"".join(k.digest[:FIELD_BYTES] for k, _ in group), recs.tobytes())
        return out

    def _loc_key(self, key: PageKey) -> str:
        """The hash that holds ``key``'s holder records."""
        return loc_key(key.namespace)

    def publish(self, entries: Sequence[tuple[PageKey, Location]]) -> None:
        self._require_node()
        if self._inc is None or not entries:
            return    # not registered yet: the first heartbeat re-publishes everything
        self._send_writes("publish", entries)

    def withdraw(self, entries: Sequence[tuple[PageKey, Location]]) -> None:
        self._require_node()
        if self._inc is None or not entries:
            return
        self._send_writes("withdraw", entries)

    def _send_writes(self, what: str, entries: Sequence[tuple[PageKey, Location]]) -> None:
        """Publish or withdraw: placed keys as segment records, the others in per-page fields."""
        incs = self._incarnations(entries)
        flat = [e for e in entries if not (self.SEGMENTS and e[0].place is not None)]
        if flat:
            self._write(what, self._records(flat, incs))
        if len(flat) < len(entries):
            self._write_segments(what, [e for e in entries if self.SEGMENTS and e[0].place is not None], incs)

    def _write(self, what: str, records: dict[str, tuple[bytes, bytes]]) -> None:
        """Run the per-page ``what`` script (publish or withdraw) on each hash's records."""
        script = self._publish if what == "publish" else self._withdraw
        for key, (fields, recs) in records.items():
            keys = [key, flat_key(key)] if self.SEGMENTS else [key]
            self._call(what, script, keys=keys, args=[fields, recs])

    def longest_prefix(self, keys: Sequence[PageKey]) -> dict[str, PrefixMatch]:
        if not keys:
            return {}
        ns = check_one_namespace(keys)
        plan = self._segment_plan(keys)
        if plan is not None:
            return self._segment_lookup(ns, keys, plan)
        packed = LIVE_QUERY + hmget_resp(loc_key(ns).encode(), page_fields(keys))
        now, live, vals = self._call("lookup", self._send, packed, 3)
        return self._matches(leading_runs(vals, self._alive(now, live), len(MEDIA)))

    def _segment_plan(self, keys: Sequence[PageKey]) -> SegmentPlan | None:
        """The query as segment fields; ``None``: read per-page fields (a key without its place)."""
        return SegmentPlan.of(keys) if self.SEGMENTS else None

    def _alive(self, now: list[bytes], live: Registry) -> list[int]:
        """The live incarnations, from the replies to ``TIME`` and the ``GET`` of the leases."""
        alive: list[int] = self._live(now, live).tolist()
        return alive

    def _live(self, now: list[bytes], live: Registry) -> np.ndarray:
        """:meth:`_alive` as a sorted uint32 array (:class:`~.live_set.LiveSet`)."""
        return self._live_set.of(now, live)

    def _matches(self, found: LeadingRuns,
                 resolver: Callable[[int], Resolver] | None = None) -> dict[str, PrefixMatch]:
        """Each live node's leading run, from a decoded reply; ``resolver(inc)``: reads the slots of
        that holder's pages whose generation is -1 (known from a summary only)."""
        # A value cut short or padded, or a medium code no build knows: what a hostile or broken
        # writer left. The run ends there, or that page is absent.
        if found.malformed:
            self._refused(1, "malformed")
        if found.unknown:
            self._refused(found.unknown, "unknown_medium")
        if not found.heads:
            return {}
        names = self._names(found.heads)
        out: dict[str, PrefixMatch] = {}
        for node_inc, (media, slots, gens) in zip(found.heads, found.runs, strict=True):
            node = names.get(node_inc)
            if node is not None:
                lazy = resolver(node_inc) if resolver is not None and bool((gens < 0).any()) else None
                out[node] = PrefixMatch(node, media, slots, gens, resolve=lazy)
        return out

    def _refused(self, n: int, why: str) -> None:
        if self.on_refused is not None:
            self.on_refused(n, why)

    def _names(self, incs: list[int]) -> dict[int, str]:
        """Node ids of incarnations (immutable once assigned, so cached)."""
        missing = [i for i in incs if i not in self._inc_names]
        if missing:
            got = self._call("names", lambda: self._r.hmget(K_INC_NODE, missing))
            for i, name in zip(missing, got, strict=True):
                if name is not None:
                    self._inc_names[i] = name.decode()
        return {i: self._inc_names[i] for i in incs if i in self._inc_names}

    def _send(self, packed: bytes, replies: int) -> list[Any]:
        """Send pre-encoded pipelined commands on one pooled connection and read the replies."""
        return self._send_then(packed, replies, lambda: None)[0]

    def _send_then(self, packed: bytes, replies: int, meanwhile: Callable[[], T]) -> tuple[list[Any], T]:
        """:meth:`_send`, and ``meanwhile()``'s result: it runs after the send, while the server
        answers (this client's work overlaps the server's instead of following it)."""
        pool = self._r.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command([packed], check_health=False)  # type: ignore[no-untyped-call]
            done = meanwhile()
            return [conn.read_response() for _ in range(replies)], done
        except BaseException:
            conn.disconnect()  # type: ignore[no-untyped-call]  # unread replies: never reuse this socket
            raise
        finally:
            pool.release(conn)

    def nodes(self) -> list[NodeInfo]:
        live, infos = self._call("nodes", self._nodes_raw)
        out = []
        for raw in infos if live else []:
            info = _node_info(raw) if raw is not None else None
            if info is not None:
                out.append(info)
            elif raw is not None:
                self._refused(1, "node_info")
        return out

    def _nodes_raw(self) -> tuple[list[bytes], list[bytes | None]]:
        t = self._r.time()
        now_ms = t[0] * 1000 + t[1] // 1000
        live: list[bytes] = list(self._r.zrangebyscore(K_LIVE, f"({now_ms}", "+inf"))  # type: ignore[arg-type]
        infos: list[bytes | None] = list(self._r.hmget(K_INFO, live)) if live else []  # type: ignore[arg-type]
        return live, infos

    def leave(self) -> None:
        self._require_node()
        with self._lock:
            if self._inc is not None:
                self._call("leave", self._leave, keys=[K_LIVE, K_INFO, K_INC_OWNER, K_LEASES], args=[self._inc])
            self._inc = None

    def stats(self) -> dict[str, int]:
        def collect() -> dict[str, int]:
            fields = 0
            for key in self._r.scan_iter(match=PREFIX + "loc:*", count=1000):
                fields += int(self._r.hlen(key))
            for key in self._r.scan_iter(match=PREFIX + "seg:*", count=1000):
                for _, val in self._r.hscan_iter(key, count=1000):
                    sm = parse_summary(val)
                    fields += 0 if sm is None else locations(sm)
            mem = self._r.info("memory")
            live, _ = self._nodes_raw()
            return {"locations": fields, "memory_bytes": int(mem["used_memory"]), "nodes": len(live)}
        result: dict[str, int] = self._call("stats", collect)
        return result

    def sweep(self, namespace: bytes, batch: int = 1000) -> int:
        """Drop records of dead incarnations from one namespace; returns how many were dropped."""
        def run() -> int:
            live, _ = self._nodes_raw()
            alive = {int(i) for i in live}
            dropped = 0
            for key, field, val in self._hscan(namespace, batch):
                recs = np.frombuffer(val, dtype=RECORD)
                keep = np.isin(recs["inc"], list(alive))
                if keep.all():
                    continue
                dropped += int((~keep).sum())
                if keep.any():
                    self._r.hset(key, field, recs[keep].tobytes())
                else:
                    self._r.hdel(key, field)
            if self.SEGMENTS:
                packed = np.array(sorted(alive), dtype="<u4").tobytes()
                for keys in self._all_summary_hashes(namespace):
                    fields: list[bytes] = []
                    for field, _ in self._r.hscan_iter(keys[0], count=batch):
                        fields.append(field)
                        if len(fields) >= batch:
                            dropped += int(self._segment_prune(keys=list(keys), args=[packed, *fields]))
                            fields = []
                    if fields:
                        dropped += int(self._segment_prune(keys=list(keys), args=[packed, *fields]))
            return dropped
        dropped: int = self._call("sweep", run)
        return dropped

    def _hscan(self, namespace: bytes, batch: int) -> Iterator[tuple[str, bytes, bytes]]:
        """(hash key, field, records) of every per-page field of ``namespace``."""
        for field, val in self._r.hscan_iter(loc_key(namespace), count=batch):
            yield loc_key(namespace), field, val

    def ping_ms(self) -> float:
        """One round trip, for benchmarks."""
        t0 = time.perf_counter()
        self._call("ping", self._r.ping)
        return (time.perf_counter() - t0) * 1000

    def close(self) -> None:
        self._r.close()
