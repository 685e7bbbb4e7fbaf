"""``pof relay``: one per engine. Feeds a stock KV-event router the engine's cache *and* its pool.

The relay subscribes to its vLLM server's own KV events and does two things with them:

1. **Engine residency into the index.** Every full pof page the engine's prefix cache holds is
   published under the index node ``<pool node>:engine``, medium ``"engine"`` (keys computed
   from the events' tokens with :mod:`pof_connector.keys`, chained from the parent block), and
   withdrawn on ``BlockRemoved`` / ``AllBlocksCleared``. The node's meta names the pool node
   (``engine_of``) and carries the pool's ``model``, ``namespace`` and ``page_tokens``, plus
   this relay's endpoints; :class:`~pof_connector.locality.locator.Locator` merges it into the
   pool node. No pool ever loads from it: no pool has an ``"engine"`` tier.

2. **One event stream for a router** (``vllm-router --policy kv_aware --kv-event-source
   WORKER_URL=<bind>``), in vLLM's wire format and re-sequenced by the relay:

   - the engine's events, unchanged and in order (the router credits them to the device tier);
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

Which pages the pool can load is asked from the index (:class:`Locator`, per known chain, every
``poll_s``); their tokens come from KV events — this engine's, and those of other engines whose
relays advertise ``engine_events`` in their ``:engine`` node (pages computed elsewhere that this
node can read through a shared tier). The relay also serves vLLM's replay protocol on
``replay_bind`` (``--kv-event-replay-source``) from a buffer of its last ``buffer_steps`` batches.
With ``engine_url`` it also reads the engine's running / waiting requests from its ``/metrics``
every heartbeat and publishes them in its index node (the locality API's node load).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import zmq

from pof_connector.config import ConfigError, PofConfig
from pof_connector.index import IndexUnavailable, LocalityIndex, Location, NodeIdTaken, NodeInfo, open_index
from pof_connector.keys import PageKey
from pof_connector.locality.locator import ENGINE_MEDIUM, Locator, UnknownModel
from pof_connector.router.engine_load_poller import EngineLoadPoller
from pof_connector.router.kv_events import (
    END_SEQ,
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
    read_seq,
    seq_frame,
)
from pof_connector.router.relay_chains import Page, PageChains

log = logging.getLogger(__name__)
OWN = "engine"
"""The :class:`PageChains` source name of this relay's engine (peers are named by endpoint)."""
POOL_MEDIUM = MEDIUM_CPU
FAR_OWNER = "pof"
"""``ownership`` of pool pages that only the fabric reaches: vllm-router credits them as an external
tier (``--kv-penalty-external``, 0.6) and files them under this cache owner, which the engine's
``AllBlocksCleared`` leaves alone and a relay restart (its seq starts over) clears."""
FAR_LOCALITY = "REMOTE"
DRAIN = 1000          # messages taken from one socket before the loop looks at the others


class Relay:
    """Relays one engine's KV events plus its pool's residency; see the module docstring.

    ``engine_events``: the engine's PUB endpoint to connect to. ``bind``: where routers connect
    (``tcp://127.0.0.1:0`` picks a port: read :attr:`endpoint`). ``replay_bind``: ``None`` serves
    no replay. ``advertise_engine_events``: the engine endpoint as other hosts reach it (default
    ``engine_events``). ``pool_residency=False`` forwards the engine's events only.
    ``index``: an index client bound to ``<node_id>:engine`` (default: opened from ``config``).
    ``engine_url``: the engine's HTTP base URL, whose ``/metrics`` give its load; ``None``
    publishes no load.
    """

    def __init__(self, config: PofConfig, engine_events: str, bind: str, *, replay_bind: str | None = None,
                 engine_topic: str = "", advertise_engine_events: str | None = None,
                 pool_residency: bool = True, poll_s: float = 0.5, refresh_s: float = 30.0,
                 buffer_steps: int = 10_000, max_pages: int = 1 << 16,
                 index: LocalityIndex | None = None, engine_url: str | None = None) -> None:
        if config.index_url == "local" and index is None:
            raise ConfigError("index_url: 'local' lives inside one process; the relay needs the index the "
                              "engines use ('embedded' on their host, or redis://…)")
        self.config = config
        self.pool_node = config.node_id
        self.node_id = f"{config.node_id}:engine"
        self.engine_events = engine_events
        self.advertise_engine_events = advertise_engine_events or engine_events
        self.pool_residency = pool_residency
        self.poll_s = poll_s
        self.refresh_s = refresh_s
        self.max_pages = max_pages
        self.index = index if index is not None else open_index(config, self.node_id)
        self.locator = Locator(self.index)
        self.engine_url = engine_url
        self._load = EngineLoadPoller(engine_url, config.heartbeat_s) if engine_url else None
        self.stats: dict[str, int] = {"engine_batches": 0, "peer_batches": 0, "batches_out": 0,
                                      "engine_gaps": 0, "decode_errors": 0, "replays": 0}
        self._ctx = zmq.Context()
        self._engine = self._ctx.socket(zmq.SUB)
        self._engine.setsockopt(zmq.SUBSCRIBE, engine_topic.encode())
        self._engine.connect(engine_events)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(100_000)
        self._pub.bind(bind)
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay: zmq.Socket[bytes] | None = None
        self.replay_endpoint: str | None = None
        if replay_bind is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(replay_bind)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._poller = zmq.Poller()
        self._poller.register(self._engine, zmq.POLLIN)
        if self._replay is not None:
            self._poller.register(self._replay, zmq.POLLIN)
        self._peers: dict[str, zmq.Socket[bytes]] = {}
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._engine_seq: int | None = None
        self._rank: int | None = None
        self._block_size: int | None = None
        self._space: tuple[bytes, int] | None = None       # (namespace, page_tokens) of the pool node
        self._model: str | None = None
        self._chains: PageChains | None = None
        self._resident: dict[ExternalBlockHash, set[str | None]] = {}   # engine block -> media holding it
        self._engine_pages: set[bytes] = set()              # page digests published as engine-resident
        self._announced: set[bytes] = set()                 # page digests announced to routers as pool
        self._announced_far: set[bytes] = set()             # ... as external pool copies (over the fabric)
        self._republish = False
        self._logged: set[str] = set()
        self._stop = threading.Event()

    # ---- the loop -------------------------------------------------------------------------

    def run(self, stop: threading.Event | None = None) -> None:
        """Relay until ``stop`` (or :meth:`stop`) is set; then leave the index and close."""
        stop = stop if stop is not None else self._stop
        log.info("pof relay %s: engine events from %s, routers connect to %s%s; pool residency %s",
                 self.node_id, self.engine_events, self.endpoint,
                 f" (replay {self.replay_endpoint})" if self.replay_endpoint else "",
                 "on" if self.pool_residency else "off")
        if self._load is not None:
            self._load.start()
        now = time.monotonic()
        next_beat, next_poll, next_refresh = now, now + self.poll_s, now + self.refresh_s
        try:
            while not stop.is_set():
                wait = min(next_beat, next_poll, next_refresh, time.monotonic() + 0.2) - time.monotonic()
                for sock, _ in self._poller.poll(max(0, int(wait * 1000))):
                    self._on_readable(sock)
                now = time.monotonic()
                if now >= next_beat:
                    self._heartbeat()
                    next_beat = now + self.config.heartbeat_s
                if now >= next_refresh:
                    self._emit(self._sync_pool(force=True))
                    next_refresh, next_poll = now + self.refresh_s, now + self.poll_s
                elif now >= next_poll:
                    self._emit(self._sync_pool())
                    next_poll = now + self.poll_s
        finally:
            self.close()

    def stop(self) -> None:
        self._stop.set()

    def _on_readable(self, sock: zmq.Socket[bytes]) -> None:
        if sock is self._replay:
            self._serve_replay()
            return
        peer = next((ep for ep, s in self._peers.items() if s is sock), None)
        for frames in _drain(sock):
            if sock is self._engine:
                self._on_engine(frames)
            elif peer is not None:
                self._on_peer(peer, frames)

    # ---- the engine's events --------------------------------------------------------------

    def _on_engine(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
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
        try:
            batch = decode_batch(frames[2])
        except msgspec.DecodeError as e:
            self.stats["decode_errors"] += 1
            self._log_once("decode", logging.ERROR, "pof relay: undecodable engine batch (%s); treating it as "
                           "lost events", e)
            self._emit(self._cleared(AllBlocksCleared()))
            return
        self._rank = batch.data_parallel_rank
        out: list[KVEvent] = self._cleared(AllBlocksCleared()) if lost else []
        touched: set[bytes] = set()
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                out += self._cleared(ev)
                continue
            out.append(ev)
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
            self._index_write(self.index.withdraw, self._engine_entries(self._engine_pages))
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
        self._engine_pages |= put
        self._engine_pages -= out
        if out:
            self._index_write(self.index.withdraw, self._engine_entries(out))
        if put:
            self._index_write(self.index.publish, self._engine_entries(put))

    def _engine_entries(self, digests: set[bytes]) -> list[tuple[PageKey, Location]]:
        assert self._space is not None
        loc = Location(self.node_id, ENGINE_MEDIUM, 0, 0)
        return [(PageKey(self._space[0], d), loc) for d in digests]

    # ---- other engines' events: tokens of pages computed elsewhere ---------------------------

    def _on_peer(self, endpoint: str, frames: list[bytes]) -> None:
        if len(frames) != 3 or self._chains is None:
            return
        self.stats["peer_batches"] += 1
        try:
            batch = decode_batch(frames[2])
        except msgspec.DecodeError as e:
            self._log_once(f"peer-decode-{endpoint}", logging.WARNING,
                           "pof relay: undecodable batch from %s (%s); ignored", endpoint, e)
            return
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                if self._block_size is None:       # this engine has announced nothing yet: assume its peers'
                    self._block_size = ev.block_size
                self._chains.stored(endpoint, ev)

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
        for ep in set(self._peers) - want:
            sock = self._peers.pop(ep)
            self._poller.unregister(sock)
            sock.close(linger=0)
            log.info("pof relay: stopped following %s", ep)
        for ep in want - set(self._peers):
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(ep)
            self._peers[ep] = sock
            self._poller.register(sock, zmq.POLLIN)
            log.info("pof relay: following the KV events of %s for pool pages computed there", ep)

    # ---- pool residency --------------------------------------------------------------------

    def _sync_pool(self, force: bool = False) -> list[KVEvent]:
        """Events that bring routers' view of the pool to what the index says now; with
        ``force``, every loadable chain again (after a clear, and for late routers)."""
        chains, bs, space = self._chains, self._block_size, self._space
        if not self.pool_residency or chains is None or bs is None or space is None or self._model is None:
            return []
        if space[1] % bs:
            self._log_once("block-size", logging.ERROR, "pof relay: page_tokens %d is not a multiple of the "
                           "engine's block size %d; pool residency is not announced", space[1], bs)
            return []
        # Two claims per chain: the run the pool loads from its own (or shared) memory, as host
        # memory; and, when the fabric extends it, the whole loadable run as an external pool copy.
        near_ok: dict[bytes, bool] = {}
        far_ok: dict[bytes, bool] = {}
        stores: list[tuple[list[Page], bool]] = []
        for leaf in chains.leaves():
            chain = chains.chain(leaf)
            if not chain:
                continue
            tokens = [t for p in chain for t in p.token_list()]
            try:
                me = self.locator.locate(tokens, self._model).nodes.get(self.pool_node)
            except UnknownModel:      # no live pool stores the model any more: nothing is loadable
                me = None
            except IndexUnavailable as e:
                self._log_once("locate", logging.WARNING, "pof relay: cannot look the pool up (%s); keeping "
                               "what routers were told", e)
                return []
            near = me.near_tokens // space[1] if me is not None else 0
            n = me.usable_tokens // space[1] if me is not None else 0
            far = n if n > near else 0
            for i, p in enumerate(chain):
                near_ok[p.digest] = near_ok.get(p.digest, False) or i < near
                far_ok[p.digest] = far_ok.get(p.digest, False) or i < far
            if near and (force or any(p.digest not in self._announced for p in chain[:near])):
                stores.append((chain[:near], False))
            if far and (force or any(p.digest not in self._announced_far for p in chain[:far])):
                stores.append((chain[:far], True))
        out: list[KVEvent] = []
        for announced, ok, far_claim in ((self._announced, near_ok, False), (self._announced_far, far_ok, True)):
            gone = [d for d in announced if not ok.get(d, False)]
            if gone:
                out.append(BlockRemoved(block_hashes=[h for d in gone for h in self._block_ids(d, far_claim)],
                                        medium=POOL_MEDIUM, ownership=FAR_OWNER if far_claim else None,
                                        locality=FAR_LOCALITY if far_claim else None))
                announced.difference_update(gone)
        for chain, far_claim in stores:
            out.append(BlockStored(block_hashes=[h for p in chain for h in self._block_ids(p.digest, far_claim)],
                                   parent_block_hash=None, token_ids=[t for p in chain for t in p.token_list()],
                                   block_size=bs, lora_id=None, medium=POOL_MEDIUM, lora_name=None,
                                   ownership=FAR_OWNER if far_claim else None,
                                   locality=FAR_LOCALITY if far_claim else None))
            (self._announced_far if far_claim else self._announced).update(p.digest for p in chain)
        return out

    def _block_ids(self, digest: bytes, far: bool = False) -> list[int]:
        """Router block ids of a pool page: derived from its pof digest, so they are the same after
        a relay restart and never collide with the engine's own (another hash of other bytes); the
        external claim (``far``) gets ids of its own."""
        assert self._space is not None and self._block_size is not None
        salt = b"pof-relay-far" if far else b"pof-relay"
        return [int.from_bytes(hashlib.sha256(salt + digest + j.to_bytes(4, "big")).digest()[:8], "big")
                for j in range(self._space[1] // self._block_size)]

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
                "page_tokens": str(self._space[1]), "engine_events": self.advertise_engine_events,
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
                entries = self._engine_entries(self._engine_pages)
                for start in range(0, len(entries), 1000):
                    self.index.publish(entries[start:start + 1000])
        except IndexUnavailable as e:
            self._log_once("index", logging.ERROR, "pof relay: index unavailable (%s); retrying", e)
            self._republish = True
            return
        except NodeIdTaken as e:     # a newer relay runs under our node id: do not take it back
            self._log_once("node-id-taken", logging.ERROR, "pof relay: %s; publishing nothing until it stops", e)
            return
        if "index" in self._logged:
            self._logged.discard("index")
            log.warning("pof relay: index reachable again")
        self._discover(nodes)

    def _adopt(self, pool: NodeInfo) -> None:
        """Take the pool node's key space (namespace, page size) and model."""
        space = (bytes.fromhex(pool.meta["namespace"]), int(pool.meta["page_tokens"]))
        self._model = pool.meta.get("model") or None
        if space == self._space:
            return
        if self._engine_pages:
            self._index_write(self.index.withdraw, self._engine_entries(self._engine_pages))
            self._engine_pages.clear()
        self._space = space
        self._chains = PageChains(space[1], max_pages=self.max_pages)
        self._announced.clear()
        self._announced_far.clear()
        log.info("pof relay: pool node %s stores model %s, namespace %s, pages of %d tokens", self.pool_node,
                 self._model, space[0].hex(), space[1])

    def _index_write(self, fn: Any, entries: list[tuple[PageKey, Location]]) -> None:
        try:
            fn(entries)
        except IndexUnavailable as e:
            self._log_once("index", logging.ERROR, "pof relay: index unavailable (%s); retrying", e)
            self._republish = True

    # ---- the router side -------------------------------------------------------------------

    def _emit(self, events: list[KVEvent], ts: float | None = None) -> None:
        if not events:
            return
        payload = encode_batch(KVEventBatch(ts=time.time() if ts is None else ts, events=events,
                                            data_parallel_rank=self._rank))
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart([b"", seq_frame(seq), payload])
        self._buffer.append((seq, payload))
        self.stats["batches_out"] += 1

    def _serve_replay(self) -> None:
        """vLLM's replay protocol: every buffered batch from the asked seq on, then END_SEQ."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            self._log_once("replay", logging.WARNING, "pof relay: ignoring a replay request of %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        self.stats["replays"] += 1
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart([client, b"", b"", seq_frame(seq), payload])
        self._replay.send_multipart([client, b"", b"", END_SEQ, b""])

    # ---- plumbing --------------------------------------------------------------------------

    def _log_once(self, what: str, level: int, msg: str, *args: object) -> None:
        if what not in self._logged:
            self._logged.add(what)
            log.log(level, msg, *args)

    def close(self) -> None:
        """Leave the index (the engine pages stop being returned) and close the sockets. Idempotent."""
        if self._ctx.closed:
            return
        try:
            if self._space is not None:
                self.index.leave()
        except IndexUnavailable as e:
            log.warning("pof relay: could not leave the index (%s); the node expires by itself", e)
        self.index.close()
        for sock in (self._engine, self._pub, self._replay, *self._peers.values()):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
        if self._load is not None:
            self._load.close()
        log.info("pof relay %s stopped", self.node_id)


def _drain(sock: zmq.Socket[bytes]) -> Iterator[list[bytes]]:
    for _ in range(DRAIN):
        try:
            yield sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
