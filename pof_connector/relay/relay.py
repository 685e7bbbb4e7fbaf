"""``pof relay``: one per engine. Feeds a stock KV-event router the engine's cache *and* its pool.

The relay subscribes to its vLLM server's own KV events and does two things with them:

1. **Engine residency into the index.** Every full pof page the engine's prefix cache holds is
   published under the index node ``<pool node>:engine``, medium ``"engine"`` (keys computed
   from the events' tokens with :mod:`pof_connector.pages.keys`, chained from the parent block), and
   withdrawn on ``BlockRemoved`` / ``AllBlocksCleared``. The node's meta names the pool node
   (``engine_of``) and carries the pool's ``model``, ``namespace`` and ``page_tokens``, plus
   this relay's endpoints; :class:`~pof_connector.locality.locator.Locator` merges it into the
   pool node. No pool ever loads from it: no pool has an ``"engine"`` tier.

2. **One event stream for a router** (``vllm-router --policy kv_aware --kv-event-source
   WORKER_URL=<bind>``), in vLLM's wire format and re-sequenced by the relay:

   - the engine's events, unchanged and in order (the router credits them to the device tier),
     except the blocks of salted prompts (:mod:`.private`: their tokens and salt stay private);
   - pool residency: the leading pages this engine's pool loads from its own tiers, and tiers
     of other nodes it shares a domain with (e.g. one CXL region), as ``BlockStored`` with
     medium ``"CPU"``, which vllm-router credits as host memory (``--kv-penalty-host``, 0.8), and
     ``BlockRemoved`` (medium ``"CPU"``) once the pool can no longer load them. vllm-router keeps
     one claim per (block, tier), so the engine evicting a block (``BlockRemoved`` ``"GPU"``)
     leaves the pool's host claim standing; its ``AllBlocksCleared`` (e.g. ``POST
     /reset_prefix_cache``) wipes every tier of the worker, so the relay re-announces the pool
     right after it in the same batch.
   - when the fabric extends that run (pages in other nodes' tiers, read over NIXL), the whole
     loadable run once more with ``ownership`` :data:`FAR_OWNER`, which vllm-router credits as
     an external tier (``--kv-penalty-external``, 0.6). It scores the device prefix plus the
     *longest* one non-device run from the device boundary, so a short host run followed by
     remote pages still earns credit for all of them. Such claims survive ``AllBlocksCleared``
     and are cleared when the relay restarts (its seq starts over).

   Pool announcements always start at the prompt's first block (parent ``None``): vllm-router
   silently drops a store whose parent it has not seen, and a router that connected late (a ZMQ
   subscriber misses what was sent before it joined) has seen none. Every ``refresh_s`` the
   relay re-announces the whole pool view for such routers; stores are idempotent there.
   Lost engine events (a sequence gap, or an engine restart) are answered with
   ``AllBlocksCleared`` followed by the pool view: the engine's cache is unknown from then on.

Which pages the pool can load is asked from the index (:mod:`.announcements`, per known chain,
every ``poll_s``); their tokens come from KV events — this engine's, and those of other engines whose
relays advertise ``engine_events`` in their ``:engine`` node (pages computed elsewhere that this
node can read through a shared tier). The relay also serves vLLM's replay protocol on
``replay_bind`` (``--kv-event-replay-source``) from a buffer of its last ``buffer_steps`` batches
(:mod:`.wire`).
With ``engine_url`` it also reads the engine's running / waiting requests from its ``/metrics``
every heartbeat and publishes them in its index node (the locality API's node load).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from pof_connector.config import ConfigError, PofConfig
from pof_connector.index import IndexUnavailable, LocalityIndex, Location, NodeIdTaken, NodeInfo, open_index
from pof_connector.index.guarded import LogOnce, batches
from pof_connector.locality.locator import ENGINE_MEDIUM, Locator
from pof_connector.pages.keys import PageKey
from pof_connector.relay.announcements import PoolAnnouncer
from pof_connector.relay.chains import PageChains
from pof_connector.relay.config import RelayConfig
from pof_connector.relay.engine_load_poller import EngineLoadPoller
from pof_connector.relay.kv_events import (
    AllBlocksCleared,
    BlockStored,
    ExternalBlockHash,
    KVEvent,
    KVEventBatch,
    decode_events,
    read_seq,
)
from pof_connector.relay.private import PrivateBlocks
from pof_connector.relay.wire import RelayWire

log = logging.getLogger(__name__)
OWN = "engine"
"""The :class:`PageChains` source name of this relay's engine (peers are named by endpoint)."""


class Relay:
    """Relays one engine's KV events plus its pool's residency; see the module docstring.

    ``config``: the engine's pof config (its ``node_id``, ``index_url``); ``relay``: the relay's
    endpoints and periods. ``index``: an index client bound to ``<node_id>:engine`` (default:
    opened from ``config``). Raises ``zmq.ZMQError`` when a bind address is taken.
    """

    def __init__(self, config: PofConfig, relay: RelayConfig, *, index: LocalityIndex | None = None) -> None:
        if config.index_url == "local" and index is None:
            raise ConfigError("index_url: 'local' lives inside one process; the relay needs the index the "
                              "engines use ('embedded' on their host, or redis://…)")
        self.config = config
        self.relay_config = relay
        self.pool_node = config.node_id
        self.node_id = f"{config.node_id}:engine"
        self.index = index if index is not None else open_index(config, self.node_id)
        self.locator = Locator(self.index)
        self._load = EngineLoadPoller(relay.engine_url, config.heartbeat_s) if relay.engine_url else None
        self.stats: dict[str, int] = {"engine_batches": 0, "peer_batches": 0, "batches_out": 0,
                                      "engine_gaps": 0, "decode_errors": 0, "replays": 0,
                                      "bad_events": 0, "bad_frames": 0, "oversize_frames": 0}
        """Refusals: ``decode_errors`` (a batch that is not one), ``bad_events`` (events dropped from
        a batch: unknown type, wrong field types, token ids outside uint32), ``bad_frames`` (a
        message not of three frames), ``oversize_frames`` (links dropped, :mod:`.wire`)."""
        self._log_once = LogOnce(log)
        self._wire = RelayWire(relay, self.stats, self._log_once)
        self.endpoint: str = self._wire.endpoint
        self.replay_endpoint: str | None = self._wire.replay_endpoint
        self._pool = PoolAnnouncer(self.pool_node, self.locator, self._log_once)
        self._private = PrivateBlocks()
        """Salted prompts' blocks: not forwarded (:mod:`.private`)."""
        self._engine_seq: int | None = None
        self._rank: int | None = None
        self._block_size: int | None = None
        self._space: tuple[bytes, int] | None = None       # (namespace, page_tokens) of the pool node
        self._model: str | None = None
        self._chains: PageChains | None = None
        self._resident: dict[ExternalBlockHash, set[str | None]] = {}   # engine block -> media holding it
        # Pages published as engine-resident, by digest: their keys keep the place they were
        # published with, so a withdraw finds them after the chain map forgot the page.
        self._engine_pages: dict[bytes, PageKey] = {}
        self._republish = False
        self._stop = threading.Event()

    # ---- the loop -------------------------------------------------------------------------

    def run(self, stop: threading.Event | None = None) -> None:
        """Relay until ``stop`` (or :meth:`stop`) is set; then leave the index and close."""
        stop = stop if stop is not None else self._stop
        rc = self.relay_config
        log.info("pof relay %s: engine events from %s, routers connect to %s%s; pool residency %s",
                 self.node_id, rc.engine_events, self.endpoint,
                 f" (replay {self.replay_endpoint})" if self.replay_endpoint else "",
                 "on" if rc.pool_residency else "off")
        if self._load is not None:
            self._load.start()
        now = time.monotonic()
        next_beat, next_poll, next_refresh = now, now + rc.poll_s, now + rc.refresh_s
        try:
            while not stop.is_set():
                wait = min(next_beat, next_poll, next_refresh, time.monotonic() + 0.2) - time.monotonic()
                for source, frames in self._wire.receive(wait):
                    if source is None:
                        self._on_engine(frames)
                    else:
                        self._on_peer(source, frames)
                now = time.monotonic()
                if now >= next_beat:
                    self._heartbeat()
                    next_beat = now + self.config.heartbeat_s
                if now >= next_refresh:
                    self._emit(self._sync_pool(force=True))
                    next_refresh, next_poll = now + rc.refresh_s, now + rc.poll_s
                elif now >= next_poll:
                    self._emit(self._sync_pool())
                    next_poll = now + rc.poll_s
        finally:
            self.close()

    def stop(self) -> None:
        self._stop.set()

    def _emit(self, events: list[KVEvent], ts: float | None = None) -> None:
        self._wire.emit(events, ts, self._rank)

    # ---- the engine's events --------------------------------------------------------------

    def _on_engine(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.stats["bad_frames"] += 1
            self._log_once("frames", logging.WARNING, "pof relay: ignoring an engine message of %d frames "
                           "(expected topic, seq, payload)", len(frames))
            return
        self.stats["engine_batches"] += 1
        seq = read_seq(frames[1])
        lost = self._engine_seq is not None and seq != self._engine_seq + 1
        if lost:
            self.stats["engine_gaps"] += 1
            log.warning("pof relay: engine event seq %d after %d (%s); telling routers the engine cache is "
                        "unknown (AllBlocksCleared)", seq, self._engine_seq,
                        "engine restarted" if seq <= (self._engine_seq or 0) else "events lost")
        self._engine_seq = seq
        batch = self._decode(frames[2], "engine")
        if batch is None:        # its events are lost
            self._emit(self._cleared(AllBlocksCleared()))
            return
        self._rank = batch.data_parallel_rank
        out: list[KVEvent] = self._cleared(AllBlocksCleared()) if lost else []
        touched: set[bytes] = set()
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                out += self._cleared(ev)
                continue
            if (public := self._private.redact(ev)) is not None:
                out.append(public)
            if isinstance(ev, BlockStored):
                self._block_size = ev.block_size
                for h in ev.block_hashes:
                    self._resident.setdefault(h, set()).add(ev.medium)
                if self._chains is not None:
                    touched.update(p.digest for p in self._chains.stored(OWN, ev))
            else:
                for h in ev.block_hashes:
                    media = self._resident.get(h)
                    if media is not None:
                        media.discard(ev.medium)
                        if not media:
                            del self._resident[h]
                    if self._chains is not None and (d := self._chains.page_of((OWN, h))) is not None:
                        touched.add(d)
        self._update_engine_pages(touched)
        self._emit(out, batch.ts)

    def _cleared(self, ev: AllBlocksCleared) -> list[KVEvent]:
        """The engine's cache is empty (or unknown): forget it, and follow the clear with the pool
        view, which the router's clear wiped too."""
        self._resident.clear()
        if self._engine_pages:
            self._index_write(self.index.withdraw, self._engine_entries(self._engine_pages.values()))
            self._engine_pages.clear()
        return [ev, *self._sync_pool(force=True)]

    def _update_engine_pages(self, touched: set[bytes]) -> None:
        put, out = set(), set()
        for d in touched:
            page = self._chains.page(d) if self._chains is not None else None
            now = page is not None and all(b[1] in self._resident for b in page.blocks)
            if now and d not in self._engine_pages:
                put.add(d)
            elif not now and d in self._engine_pages:
                out.add(d)
        gone = [self._engine_pages.pop(d) for d in out]
        new = [self._engine_key(d) for d in put]
        self._engine_pages.update((k.digest, k) for k in new)
        if gone:
            self._index_write(self.index.withdraw, self._engine_entries(gone))
        if new:
            self._index_write(self.index.publish, self._engine_entries(new))

    def _engine_key(self, digest: bytes) -> PageKey:
        assert self._space is not None
        page = self._chains.page(digest) if self._chains is not None else None
        return PageKey(self._space[0], digest, None if page is None else page.place)

    def _engine_entries(self, keys: Iterable[PageKey]) -> list[tuple[PageKey, Location]]:
        loc = Location(self.node_id, ENGINE_MEDIUM, 0, 0)
        return [(k, loc) for k in keys]

    # ---- other engines' events: tokens of pages computed elsewhere ---------------------------

    def _on_peer(self, endpoint: str, frames: list[bytes]) -> None:
        if len(frames) != 3 or self._chains is None:
            self.stats["bad_frames"] += len(frames) != 3
            return
        self.stats["peer_batches"] += 1
        batch = self._decode(frames[2], endpoint)
        if batch is None:
            return
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                if self._block_size is None:       # this engine has announced nothing yet: assume its peers'
                    self._block_size = ev.block_size
                self._chains.stored(endpoint, ev)

    def _decode(self, payload: bytes, source: str) -> KVEventBatch | None:
        """``payload``'s batch without the events that do not decode (counted, logged once per
        source and kind); ``None`` when it is no batch at all."""
        try:
            batch, dropped = decode_events(payload)
        except msgspec.DecodeError as e:
            self.stats["decode_errors"] += 1
            self._log_once(f"decode-{source}", logging.ERROR, "pof relay: undecodable batch from %s (%s); dropped. "
                           "Further ones are counted in decode_errors", source, e)
            return None
        if dropped:
            self.stats["bad_events"] += dropped
            self._log_once(f"bad-event-{source}", logging.WARNING, "pof relay: dropped an event from %s that is not "
                           "a valid KV event (unknown type, wrong field types or token ids outside uint32). "
                           "Further ones are counted in bad_events", source)
        return batch

    def _discover(self, nodes: Sequence[NodeInfo]) -> None:
        """Follow the engines of other nodes in this pool's key space (their ``engine_events``)."""
        want: set[str] = set()
        assert self._space is not None
        for n in nodes:
            m = n.meta
            if (m.get("engine_of") in (None, self.pool_node) or not m.get("engine_events")
                    or m.get("namespace") != self._space[0].hex() or m.get("page_tokens") != str(self._space[1])):
                continue
            want.add(m["engine_events"])
        self._wire.follow(want)

    # ---- pool residency --------------------------------------------------------------------

    def _sync_pool(self, force: bool = False) -> list[KVEvent]:
        """The pool announcements due now (:meth:`PoolAnnouncer.sync`); none before the pool node
        and the engine's block size are known, or with ``pool_residency`` off."""
        chains, bs, space, model = self._chains, self._block_size, self._space, self._model
        if not self.relay_config.pool_residency or chains is None or bs is None or space is None or model is None:
            return []
        return self._pool.sync(chains, bs, space, model, force)

    # ---- index -----------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        try:
            nodes = self.index.nodes()
        except IndexUnavailable as e:
            self._log_once("index", logging.ERROR, "pof relay: index unavailable (%s); retrying", e)
            self._republish = True
            return
        pool = next((n for n in nodes if n.node_id == self.pool_node), None)
        if pool is None or not pool.meta.get("namespace") or not pool.meta.get("page_tokens"):
            self._log_once("no-pool", logging.WARNING, "pof relay: pool node %r is not in the index yet (is its "
                           "engine up with the pof connector?); waiting", self.pool_node)
            if self._space is None:
                return
        else:
            self._adopt(pool)
        assert self._space is not None
        meta = {"engine_of": self.pool_node, "model": self._model or "", "namespace": self._space[0].hex(),
                "page_tokens": str(self._space[1]),
                "engine_events": self.relay_config.advertised_engine_events,
                "relay_events": self.endpoint}
        if self.replay_endpoint:
            meta["relay_replay"] = self.replay_endpoint
        load = self._load.latest if self._load is not None else None
        if load is not None:
            meta.update(load.to_meta())
        try:
            fresh = self.index.heartbeat(NodeInfo(self.node_id, {}, meta), self.config.node_ttl_s)
            if fresh or self._republish:
                self._republish = False
                entries = self._engine_entries(self._engine_pages.values())
                for batch in batches(entries):
                    self.index.publish(batch)
        except IndexUnavailable as e:
            self._log_once("index", logging.ERROR, "pof relay: index unavailable (%s); retrying", e)
            self._republish = True
            return
        except NodeIdTaken as e:     # a newer relay runs under our node id: do not take it back
            self._log_once("node-id-taken", logging.ERROR, "pof relay: %s; publishing nothing until it stops", e)
            return
        if self._log_once.clear("index"):
            log.warning("pof relay: index reachable again")
        self._discover(nodes)

    def _adopt(self, pool: NodeInfo) -> None:
        """Take the pool node's key space (namespace, page size) and model."""
        space = (bytes.fromhex(pool.meta["namespace"]), int(pool.meta["page_tokens"]))
        self._model = pool.meta.get("model") or None
        if space == self._space:
            return
        if self._engine_pages:
            self._index_write(self.index.withdraw, self._engine_entries(self._engine_pages.values()))
            self._engine_pages.clear()
        self._space = space
        self._chains = PageChains(space[1], max_pages=self.relay_config.max_pages)
        self._pool.reset()
        log.info("pof relay: pool node %s stores model %s, namespace %s, pages of %d tokens", self.pool_node,
                 self._model, space[0].hex(), space[1])

    def _index_write(self, fn: Any, entries: list[tuple[PageKey, Location]]) -> None:
        try:
            fn(entries)
        except IndexUnavailable as e:
            self._log_once("index", logging.ERROR, "pof relay: index unavailable (%s); retrying", e)
            self._republish = True

    # ---- plumbing --------------------------------------------------------------------------

    def close(self) -> None:
        """Leave the index (the engine pages stop being returned) and close the sockets. Idempotent."""
        if self._wire.closed:
            return
        try:
            if self._space is not None:
                self.index.leave()
        except IndexUnavailable as e:
            log.warning("pof relay: could not leave the index (%s); the node expires by itself", e)
        self.index.close()
        self._wire.close()
        if self._load is not None:
            self._load.close()
        log.info("pof relay %s stopped", self.node_id)
