"""Copies of a pinned prefix on ``replicas`` nodes, so the prefix survives the loss of its holder.

A pin with ``replicas: N`` asks that N live nodes hold its pages whole. Each node checks, after
it read the index's pins (every :data:`~pof_connector.pins.pin_book.SYNC_EVERY_S`), every pin of
its namespace with ``replicas > 1``:

1. **Holders**: the live nodes the index names for every page of the prefix (a node with part of
   it does not count). N or more: nothing to do.
2. **Who copies**: the live nodes of the same namespace that do not hold it whole and can read a
   holder's pages (a tier in the same sharing domain, or both on the fabric) are ranked by
   ``sha256(pin id, node id)``; the first ``N - holders`` copy, the others wait (so a pin is not
   copied onto every node at once, and a node that left is replaced by the next one on the list).
3. **Copy**: the node looks the prefix up as an engine would, loads the pages it lacks through the
   ordinary read path (shared region or fabric, every page checked: key, generation, checksums),
   and stores them in its own first tier as the pin's tenant's pages, then publishes them. Its
   own :class:`~pof_connector.pins.pin_book.PinBook` keeps them as the pin asks (soft or hard).

A copy that fails (a page evicted meanwhile, a holder gone, no room: every page kept) is only
counted (``pof_pin_copy_failures_total{reason}``) and tried again at the next check; nothing of a
failed read is stored. When a holder dies, the count drops below N and the next node on the list
copies from the survivor.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from pof_connector.config.tenant_config import DEFAULT_TENANT
from pof_connector.fabric.meta import has_fabric_meta
from pof_connector.index import Location, NodeInfo
from pof_connector.pages.keys import SEGMENT_PAGES, ChainPlace, PageKey
from pof_connector.pins.pin import Pin
from pof_connector.pins.pin_book import PinBook
from pof_connector.pool.load_handle import LoadHandle
from pof_connector.pool.lookup import SourceFinder
from pof_connector.pool.node_parts import NodeParts

log = logging.getLogger("pof_connector.pool")
LOAD_TIMEOUT_S = 30.0
"""Longest wait for one copy's reads (then the pages not arrived count as failed)."""


def rank(pin_id: str, nodes: Sequence[str]) -> list[str]:
    """``nodes`` in the order they are asked to copy pin ``pin_id`` (the same on every node)."""
    return sorted(nodes, key=lambda n: hashlib.sha256(f"{pin_id}\x00{n}".encode()).digest())


class PinCopies:
    """Keeps this node's share of the pins' copies. ``load`` reads pages as the pool does
    (:meth:`Pool.load`); ``store_packed`` stores checked pages for a tenant (on the store thread)."""

    def __init__(self, parts: NodeParts, finder: SourceFinder, pins: PinBook, namespace: bytes,
                 load: Callable[[Sequence[PageKey], Sequence[Location], Sequence[Any]], LoadHandle],
                 store_packed: Callable[[list[tuple[PageKey, np.ndarray]], str], Future[int]]) -> None:
        self.parts = parts
        self.node_id = parts.own.node_id
        self.finder = finder
        self.pins = pins
        self.namespace = namespace
        self._load = load
        self._store_packed = store_packed
        self.stats = parts.stats
        self._tenants = set(parts.config.tenants.names())
        self._queued = threading.Event()
        self._one_at_a_time = threading.Lock()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="pof-pin-copies")

    def check_soon(self) -> None:
        """Queue one check of every pin (unless one is queued); called from the heartbeat."""
        if self._queued.is_set() or not any(p.replicas > 1 for p in self.pins.pins()):
            return
        self._queued.set()
        try:
            self._worker.submit(self._check_all)
        except RuntimeError:          # closing
            self._queued.clear()

    def _check_all(self) -> None:
        self._queued.clear()
        now = time.time()
        for pin in self.pins.pins():
            if pin.replicas <= 1 or not pin.live(now):
                continue
            try:
                self.check(pin)
            except Exception as e:    # never let one pin (or a bug) stop the others or the node
                self.stats.add("pin_copy_failures", reason="error")
                self.parts.log_once("pin-copy", logging.ERROR, "pof: copying a pinned prefix failed", exc_info=e)

    def check(self, pin: Pin) -> int:
        """Copy ``pin``'s pages here if this node is one of the nodes asked to; the pages copied."""
        with self._one_at_a_time:
            return self._check(pin)

    def _check(self, pin: Pin) -> int:
        keys = placed([k for k in pin.keys if k.namespace == self.namespace])
        if not keys or all(self.parts.own.contains(k) for k in keys):
            return 0
        matches = self.parts.guard.call("lookup", self.parts.index.longest_prefix, keys, default=None)
        nodes = self.finder.all_nodes()
        if matches is None or not nodes:
            return 0
        holders = [n for n, m in matches.items() if m.pages >= len(keys) and n in nodes]
        need = pin.replicas - len(holders)
        if need <= 0 or not holders:
            return 0
        space = self.namespace.hex()
        candidates = [n for n, info in nodes.items() if n not in holders and info.meta.get("namespace") == space
                      and any(_can_read(info, nodes[h]) for h in holders if h in nodes)]
        if self.node_id not in rank(pin.pin_id, candidates)[:need]:
            return 0
        return self._copy(keys, pin)

    def _copy(self, keys: list[PageKey], pin: Pin) -> int:
        found = self.finder.lookup(keys, count=False)
        todo = [i for i, s in enumerate(found.sources) if s.node != self.node_id]
        if found.pages < len(keys):
            self.stats.add("pin_copy_failures", reason="unreadable")
        if not todo:
            return 0
        spec = self.parts.spec
        bufs = [np.empty(spec.page_bytes, dtype=np.uint8) for _ in todo]
        handle = self._load([keys[i] for i in todo], [found.sources[i] for i in todo], bufs)
        handle.wait(LOAD_TIMEOUT_S)
        failed = handle.failed
        for reason in failed.values():
            self.stats.add("pin_copy_failures", reason=reason)
        pages = [(keys[i], bufs[n]) for n, i in enumerate(todo) if n not in failed]
        if not pages:
            return 0
        tenant = pin.tenant if pin.tenant in self._tenants else DEFAULT_TENANT
        written = self._store_packed(pages, tenant).result()
        self.stats.add("pin_copied_pages", written)
        if written:
            log.info("pof: copied %d page(s) of pin %s here (replicas: %d)", written, pin.pin_id, pin.replicas)
        return written

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)


def placed(keys: list[PageKey]) -> list[PageKey]:
    """A pin's keys of one namespace, the chain of its prefix from the first page, with their
    places in it (a pin record keeps digests only; the index finds a page by its chain segment)."""
    out: list[PageKey] = []
    head = b""
    for i, k in enumerate(keys):
        if i % SEGMENT_PAGES == 0:
            head = k.digest
        out.append(PageKey(k.namespace, k.digest, ChainPlace(i, head)))
    return out


def _can_read(reader: NodeInfo, holder: NodeInfo) -> bool:
    """Whether ``reader`` can read some tier of ``holder``: one sharing domain, or both on the fabric."""
    if has_fabric_meta(reader.meta) and has_fabric_meta(holder.meta):
        return True
    return any(m in holder.tiers and holder.tiers[m].domain == t.domain for m, t in reader.tiers.items())
