"""Segment summaries and records on a Redis Cluster (:mod:`.redis_cluster`): the schema of
:mod:`.summary` in buckets, so a namespace spreads over the shards and each write script still
touches one slot::

    pof:{<namespace hex>/<b>}:seg    HASH  summaries of the segments whose field's byte 15 is b mod SEGMENT_BUCKETS
    pof:{<namespace hex>/<b>}:rec    HASH  their holders' slot records
    pof:{<namespace hex>/<b>}:loc    HASH  per-page fields: the overflowed pages of those segments, and the
                                           placeless pages whose digest's byte 16 mod BUCKETS is b (as before)
    pof:{pof}:flat:<namespace hex>   STRING set once a placeless page was published in the namespace

A lookup is one parallel round, as the per-page one: ``TIME`` and the leases' ``GET`` to the registry's
master, the flag's ``GET`` to its master, and per bucket one ``HMGET`` of the query's segments there,
each master's commands in one buffer, all buffers written before any reply is read. The flag is not
cleared on a cluster (a withdraw would have to look at every bucket): a namespace that once had
placeless pages keeps paying the per-page reads, as LMCache's (all placeless) do anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from redis.cluster import ClusterNode
from redis.crc import key_slot

from pof_connector.index.live_set import Registry
from pof_connector.index.record_runs import FIELD_BYTES
from pof_connector.index.redis import (
    K_LIVE,
    LIVE_QUERY,
    RedisIndex,
    frame,
    hmget_head,
    hmget_resp,
    resp,
)
from pof_connector.index.segments import MAX_TAGS, SegmentPlan, SegmentQuery
from pof_connector.index.summary import locations, parse_summary
from pof_connector.pages.keys import DIGEST_BYTES, SEGMENT_PAGES, PageKey

BUCKETS = 32
"""Hashes per namespace: how many slots, and so shards, one namespace spans at most. Each is one
``HMGET`` (one reply to read) per lookup: 64 cost a lookup of 2,000 pages 1.6x the client CPU of
16 (measured), so a namespace spreads over up to 32 shards."""
BUCKET_BYTE = 16
"""The digest byte that picks a placeless page's bucket (not one of the 16 stored as the field)."""
SEGMENT_BUCKETS = 8
"""Summary and record hashes per namespace. A lookup reads one ``HMGET`` reply per bucket it
touches (about 3 us of client time each): a summary is a sixteenth of its pages' per-page fields,
so 8 buckets spread a namespace's summaries over up to 8 shards for a quarter of the replies of 32."""
REGISTRY_SLOT = key_slot(K_LIVE.encode())
SEGMENT_BUCKET_BYTE = 15
"""The field byte that picks a segment's bucket (a segment's field is all a lookup has of its head)."""


def bucket_key(namespace: bytes, bucket: int, kind: str = "loc") -> str:
    return f"pof:{{{namespace.hex()}/{bucket:02x}}}:{kind}"


def flag_key(namespace: bytes) -> str:
    """In the registry's slot: a lookup's ``GET`` of it joins the registry's buffer, not a master of its own."""
    return f"pof:{{pof}}:flat:{namespace.hex()}"


class ClusterSummaries(RedisIndex):
    """The summary path of :class:`~.redis_cluster.RedisClusterIndex` (which gives the slot map)."""

    def _masters_of(self, slots: Iterable[int]) -> dict[int, ClusterNode]:
        raise NotImplementedError

    def _exchange(self, plan: dict[str, tuple[ClusterNode, bytes, int]],
                  meanwhile: Callable[[], object] | None = None) -> dict[str, list[Any]]:
        raise NotImplementedError

    def _buckets(self, namespace: bytes) -> tuple[list[bytes], list[int]]:
        raise NotImplementedError

    _kind_cache: dict[tuple[bytes, str], list[bytes]]

    def _round(self, requests: Sequence[tuple[int, bytes, int]],
               meanwhile: Callable[[], object] | None = None) -> list[list[Any]]:
        """Each request (slot, pre-encoded commands, replies) to the master of its slot, one buffer
        per master, all in one parallel round; the replies per request, in order. ``meanwhile``:
        run while the masters answer."""
        plan: dict[str, tuple[ClusterNode, list[bytes], list[tuple[int, int]]]] = {}
        masters = self._masters_of({slot for slot, _, _ in requests})
        for i, (slot, packed, n) in enumerate(requests):
            node = masters[slot]
            _, parts, taken = plan.setdefault(node.name, (node, [], []))
            parts.append(packed)
            taken.append((i, n))
        replies = self._exchange({name: (node, b"".join(parts), sum(n for _, n in taken))
                                  for name, (node, parts, taken) in plan.items()}, meanwhile)
        out: list[list[Any]] = [[] for _ in requests]
        for name, (_, _, taken) in plan.items():
            at = 0
            for i, n in taken:
                out[i] = replies[name][at:at + n]
                at += n
        return out

    def _by_bucket(self, ns: bytes, kind: str, fields: np.ndarray, byte: int
                   ) -> tuple[list[tuple[int, bytes, int]], np.ndarray]:
        """One ``HMGET`` per bucket of ``fields`` (rows; ``byte`` of each picks its bucket) on the
        ``kind`` hashes, built in one pass; and the order the replies' values come in."""
        _, slots = self._buckets(ns)
        bucket = fields[:, byte] % (SEGMENT_BUCKETS if byte == SEGMENT_BUCKET_BYTE else BUCKETS)
        order = np.argsort(bucket, kind="stable")
        counts = np.bincount(bucket, minlength=BUCKETS).tolist()
        body = frame(fields[order])
        width = len(body) // max(len(fields), 1)
        keys = self._kind_keys(ns, kind)
        requests, start = [], 0
        for b, n in enumerate(counts):
            if n:
                requests.append((slots[b], hmget_head(keys[b], n) + body[start * width:(start + n) * width], 1))
                start += n
        return requests, order

    def _kind_keys(self, ns: bytes, kind: str) -> list[bytes]:
        got = self._kind_cache.get((ns, kind))
        if got is None:
            if len(self._kind_cache) >= 1024:      # namespaces are models: a bound that never bites
                self._kind_cache.clear()
            got = self._kind_cache[ns, kind] = [bucket_key(ns, b, kind).encode() for b in range(BUCKETS)]
        return got

    def _summary_hashes(self, ns: bytes, field: bytes) -> tuple[str, str, str]:
        b = field[SEGMENT_BUCKET_BYTE] % SEGMENT_BUCKETS
        return bucket_key(ns, b, "seg"), bucket_key(ns, b, "loc"), bucket_key(ns, b, "rec")

    def _all_summary_hashes(self, ns: bytes) -> list[tuple[str, str, str]]:
        return [(bucket_key(ns, b, "seg"), bucket_key(ns, b, "loc"), bucket_key(ns, b, "rec"))
                for b in range(SEGMENT_BUCKETS)]

    def _run_segment_script(self, what: str, ns: bytes, items: dict[bytes, bytes]) -> None:
        """The script once per bucket, pipelined per shard (a cluster pipeline)."""
        by_bucket: dict[tuple[str, str, str], list[bytes]] = {}
        for field, its in items.items():
            by_bucket.setdefault(self._summary_hashes(ns, field), []).extend([field, its])
        script = (self._segment_publish if what == "publish" else self._segment_withdraw).script
        head: list[Any] = [MAX_TAGS] if what == "publish" else []

        def send() -> None:
            pipe = self._r.pipeline(transaction=False)
            for keys, args in by_bucket.items():
                pipe.execute_command("EVAL", script, 3, *keys, *head, *args)
            pipe.execute()
        self._call(what, send)

    def _segment_round(self, ns: bytes, keys: Sequence[PageKey], plan: SegmentPlan, flagged: bool
                       ) -> tuple[list[bytes], Registry, Any, list[Any], list[Any] | None, SegmentQuery]:
        flag = flag_key(ns).encode()
        requests = [(REGISTRY_SLOT, LIVE_QUERY + resp(b"GET", flag), 3)]
        segs, order = self._by_bucket(ns, "seg", plan.fields, SEGMENT_BUCKET_BYTE)
        pages = self._page_requests(ns, keys, plan, np.arange(len(keys)), True) if flagged else None
        queries: list[SegmentQuery] = []
        # The tags (a pass over every key) are computed while the masters answer.
        replies = self._call("lookup", self._round, requests + segs + (pages[0] if pages else []),
                             lambda: queries.append(plan.query()))
        vals = np.empty(len(plan.fields), dtype=object)
        vals[order] = [v for (got,) in replies[1:1 + len(segs)] for v in got]
        more = _merge(len(keys), pages[1], replies[1 + len(segs):]) if pages else None
        query = queries[0] if queries else plan.query()
        return replies[0][0], replies[0][1], replies[0][2], vals.tolist(), more, query

    def _page_round(self, ns: bytes, keys: Sequence[PageKey], plan: SegmentPlan, wanted: np.ndarray,
                    flagged: bool) -> list[Any]:
        requests, where = self._page_requests(ns, keys, plan, wanted, flagged)
        merged = _merge(len(keys), where, self._round(requests))
        return [merged[int(i)] for i in wanted]

    def _page_requests(self, ns: bytes, keys: Sequence[PageKey], plan: SegmentPlan, wanted: np.ndarray,
                       flagged: bool) -> tuple[list[tuple[int, bytes, int]], list[np.ndarray]]:
        """``HMGET`` of the per-page fields of the query pages ``wanted``: an overflowed page's is in
        its segment's bucket, and (``flagged``) a placeless page's in its digest's bucket."""
        _, slots = self._buckets(ns)
        digests = np.frombuffer(b"".join([k.digest for k in keys]), dtype=np.uint8).reshape(len(keys), DIGEST_BYTES)
        seg_of = (np.asarray(wanted) - int(plan.first_page[0])) // SEGMENT_PAGES
        sources = [plan.fields[seg_of, SEGMENT_BUCKET_BYTE] % SEGMENT_BUCKETS]
        if flagged:
            sources.append(digests[wanted, BUCKET_BYTE] % BUCKETS)
        requests: list[tuple[int, bytes, int]] = []
        where: list[np.ndarray] = []
        for bucket in sources:
            for b in np.unique(bucket).tolist():
                idx = np.asarray(wanted)[bucket == b]
                requests.append((slots[b], hmget_resp(bucket_key(ns, b).encode(), digests[idx, :FIELD_BYTES]), 1))
                where.append(idx)
        return requests, where

    def _read_record_values(self, ns: bytes, fields: np.ndarray) -> list[Any]:
        requests, order = self._by_bucket(ns, "rec", fields, SEGMENT_BUCKET_BYTE)
        replies = self._call("records", self._round, requests)
        vals = np.empty(len(fields), dtype=object)
        vals[order] = [v for (got,) in replies for v in got]
        out: list[Any] = vals.tolist()
        return out

    def _summary_locations(self) -> int:
        """Locations in the summaries of every namespace, over every master."""
        total = 0
        for node in self._r.get_primaries():
            r = self._r.get_redis_connection(node)
            for key in r.scan_iter(match="pof:{*}:seg", count=1000):
                for _, val in r.hscan_iter(key, count=1000):
                    sm = parse_summary(val)
                    total += 0 if sm is None else locations(sm)
        return total


def _merge(pages: int, where: Sequence[np.ndarray], replies: Sequence[list[Any]]) -> list[Any]:
    """Per query page, its per-page values from several ``HMGET`` replies concatenated (``None``: none)."""
    out: list[Any] = [None] * pages
    for idx, (got,) in zip(where, replies, strict=True):
        for i, v in zip(idx.tolist(), got, strict=True):
            if v is not None:
                out[i] = v if out[i] is None else out[i] + v
    return out
