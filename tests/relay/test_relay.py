"""The relay over a real Redis-protocol index, real pools and real ZMQ sockets.

``FakeEngine`` stands in for vLLM's ``ZmqEventPublisher`` (a PUB socket sending ``[topic, seq,
KVEventBatch]``); ``RouterTap`` stands in for vllm-router's subscriber (a SUB socket on the relay,
plus its DEALER replay requests). The pools stand in for the pof connector inside the engines:
they store the pages the fake engine "computed".
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from fastapi.testclient import TestClient

from pof_connector.config import PofConfig
from pof_connector.index.redis import RedisIndex
from pof_connector.index.server import RedisServer
from pof_connector.locality.api import make_app
from pof_connector.locality.engine_load import EngineLoad
from pof_connector.locality.locator import Locator
from pof_connector.pages.keys import page_keys
from pof_connector.pool import Pool
from pof_connector.relay.chains import PageChains
from pof_connector.relay.config import RelayConfig
from pof_connector.relay.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
    read_seq,
    seq_frame,
)
from pof_connector.relay.relay import Relay
from tests.locality.test_api import NS, node
from tests.locality.test_engine_load import VLLM, VLLM_KV, MetricsServer
from tests.locality.test_locator import fabric_node

PAGE = 16
SEG = [np.zeros(512, np.uint8)] * 2


def tokens(pages: int, base: int = 5000) -> list[int]:
    return list(range(base, base + PAGE * pages))


def stored(hashes: list[int], toks: list[int], parent: int | None = None, bs: int = PAGE) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=toks, block_size=bs,
                       lora_id=None, medium="GPU", lora_name=None)


def wait_for(pred: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout}s"
        time.sleep(0.02)


class FakeEngine:
    """Stands in for vLLM's ZmqEventPublisher."""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self.sock = ctx.socket(zmq.PUB)
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.seq = 0

    def send(self, *events: KVEvent, seq: int | None = None) -> None:
        self.seq = self.seq if seq is None else seq
        batch = KVEventBatch(ts=time.time(), events=list(events), data_parallel_rank=0)
        self.sock.send_multipart([b"", seq_frame(self.seq), encode_batch(batch)])
        self.seq += 1


class RouterTap:
    """Stands in for vllm-router's KV-event subscriber on the relay."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str) -> None:
        self.ctx = ctx
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.got: list[tuple[int, KVEventBatch]] = []

    def poll(self) -> None:
        while self.sock.poll(20):
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == b""
            self.got.append((read_seq(seq), decode_batch(payload)))

    def events(self) -> list[KVEvent]:
        self.poll()
        return [e for _, b in self.got for e in b.events]

    def wait(self, pred: Callable[[list[KVEvent]], bool], what: str, timeout: float = 10.0) -> list[KVEvent]:
        wait_for(lambda: pred(self.events()), timeout, what)
        return self.events()

    def replay(self, endpoint: str, start: int) -> list[tuple[int, bytes]]:
        """vllm-router's replay request: DEALER sends [b"", start seq], reads until END_SEQ."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        try:
            while True:
                assert dealer.poll(5000), "no replay answer"
                _, _topic, seq, payload = dealer.recv_multipart()
                if seq == END_SEQ:
                    return out
                out.append((read_seq(seq), payload))
        finally:
            dealer.close(linger=0)


def cpu(events: list[KVEvent], kind: type) -> list[Any]:
    return [e for e in events if isinstance(e, kind) and e.medium == "CPU"]


class Harness:
    def __init__(self, ctx: zmq.Context[Any], pool: Pool, **kw: Any) -> None:
        self.engine = FakeEngine(ctx)
        cfg = PofConfig.from_mapping({**pool.config.to_mapping(), "heartbeat_s": 0.1, "node_ttl_s": 2.0})
        self.relay = Relay(cfg, RelayConfig(self.engine.endpoint, "tcp://127.0.0.1:0", replay_bind="tcp://127.0.0.1:0",
                                            poll_s=0.05, **kw))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.relay.run, args=(self.stop,), daemon=True)
        self.thread.start()
        self.tap = RouterTap(ctx, self.relay.endpoint)

    def connect(self) -> None:
        """Wait out ZMQ's slow joiners: clears until one comes through the relay to the tap."""
        def through() -> bool:
            self.engine.send(AllBlocksCleared())
            return any(isinstance(e, AllBlocksCleared) for e in self.tap.events())
        wait_for(through, what="engine -> relay -> tap")
        self.tap.got.clear()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive()


@pytest.fixture
def index(redis_server: RedisServer) -> Iterator[RedisIndex]:
    reader = RedisIndex(redis_server.url, None)
    yield reader
    reader.close()


def engine_pages(index: RedisIndex, toks: list[int], node_id: str = "a:engine") -> int:
    match = index.longest_prefix(page_keys(NS, toks, PAGE)).get(node_id)
    return 0 if match is None else match.pages


def test_engine_cache_indexed_forwarded_and_replayed(ctx: zmq.Context[Any], redis_server: RedisServer,
                                                     runtime_dir: str, index: RedisIndex) -> None:
    pool = node("a", redis_server.url, runtime_dir)
    h = Harness(ctx, pool)
    try:
        wait_for(lambda: any(n.node_id == "a:engine" for n in index.nodes()), what="relay registered")
        h.connect()
        t = tokens(3)
        sent = stored([11, 12], t[:32])
        h.engine.send(sent)
        h.engine.send(stored([13], t[32:], parent=12))
        events = h.tap.wait(lambda ev: len(ev) >= 2, "forwarded stores")
        assert events[0] == sent                                         # forwarded as the engine sent it
        wait_for(lambda: engine_pages(index, t) == 3, what="engine pages in the index")
        meta = next(n.meta for n in index.nodes() if n.node_id == "a:engine")
        assert meta["engine_of"] == "a" and meta["model"] == "org/model-a" and meta["namespace"] == NS.hex()
        assert meta["page_tokens"] == "16" and meta["engine_events"] == h.engine.endpoint
        assert meta["relay_events"] == h.relay.endpoint
        assert Locator(index).locate(t).nodes["a"].engine_tokens == 48

        h.engine.send(BlockRemoved(block_hashes=[13], medium="GPU"))
        wait_for(lambda: engine_pages(index, t) == 2, what="page 3 withdrawn")
        h.engine.send(BlockRemoved(block_hashes=[11], medium="GPU"))
        wait_for(lambda: engine_pages(index, t) == 0, what="page 1 withdrawn")

        h.tap.wait(lambda ev: len(ev) >= 4, "forwarded removals")
        seqs = [s for s, _ in h.tap.got]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))         # the relay's own gap-free sequence
        replayed = h.tap.replay(h.relay.replay_endpoint or "", seqs[1])
        assert [s for s, _ in replayed] == seqs[1:]
        assert [decode_batch(p) for _, p in replayed] == [b for _, b in h.tap.got[1:]]
    finally:
        h.close()
        pool.close()
    assert not any(n.node_id == "a:engine" for n in index.nodes())       # left the index on stop


def test_pool_residency_outlives_engine_eviction_and_reset(ctx: zmq.Context[Any], redis_server: RedisServer,
                                                           runtime_dir: str, index: RedisIndex) -> None:
    pool = node("a", redis_server.url, runtime_dir)
    h = Harness(ctx, pool)
    try:
        wait_for(lambda: any(n.node_id == "a:engine" for n in index.nodes()), what="relay registered")
        h.connect()
        t = tokens(3)
        h.engine.send(stored([21, 22, 23], t))                           # the engine computed 3 blocks…
        pool.store([(k, SEG) for k in pool.keys_for(t)]).result()       # …and its connector stored them
        events = h.tap.wait(lambda ev: len(cpu(ev, BlockStored)) == 1, "pool residency announced")
        announced = cpu(events, BlockStored)[0]
        assert announced.parent_block_hash is None and announced.token_ids == t and announced.block_size == PAGE
        assert len(announced.block_hashes) == 3 and not set(announced.block_hashes) & {21, 22, 23}

        h.engine.send(BlockRemoved(block_hashes=[21, 22, 23], medium="GPU"))   # the engine evicts them
        h.tap.wait(lambda ev: any(isinstance(e, BlockRemoved) for e in ev), "eviction forwarded")
        time.sleep(0.3)
        assert cpu(h.tap.events(), BlockRemoved) == []                   # the pool still holds them: host credit

        h.tap.got.clear()
        h.engine.send(AllBlocksCleared())                                # POST /reset_prefix_cache
        h.tap.wait(lambda ev: bool(ev), "clear forwarded")
        batch = h.tap.got[0][1]
        assert isinstance(batch.events[0], AllBlocksCleared)             # the router's clear wipes every tier…
        assert batch.events[1:] == [announced]                           # …so the pool view follows at once

        h.tap.got.clear()
        pool.close()                                                     # the pool node leaves: nothing loadable
        events = h.tap.wait(lambda ev: bool(cpu(ev, BlockRemoved)), "pool residency withdrawn")
        assert sorted(cpu(events, BlockRemoved)[0].block_hashes) == sorted(announced.block_hashes)
    finally:
        h.close()
        pool.close()


def test_engine_only_relay_and_lost_events(ctx: zmq.Context[Any], redis_server: RedisServer, runtime_dir: str,
                                           index: RedisIndex) -> None:
    pool = node("a", redis_server.url, runtime_dir)
    h = Harness(ctx, pool, pool_residency=False)
    try:
        wait_for(lambda: any(n.node_id == "a:engine" for n in index.nodes()), what="relay registered")
        h.connect()
        t = tokens(2)
        pool.store([(k, SEG) for k in pool.keys_for(t)]).result()
        h.engine.send(stored([31, 32], t))
        wait_for(lambda: engine_pages(index, t) == 2, what="engine pages in the index")
        h.engine.send(AllBlocksCleared())
        time.sleep(0.3)
        assert cpu(h.tap.events(), BlockStored) == []                    # control: no pool residency at all
        h.engine.send(stored([33, 34], t))
        wait_for(lambda: engine_pages(index, t) == 2, what="engine pages again")
        h.tap.wait(lambda ev: stored([33, 34], t) in ev, "store forwarded")
        h.tap.got.clear()
        h.engine.send(stored([35], tokens(1, base=9000)), seq=h.engine.seq + 5)   # five batches lost
        events = h.tap.wait(lambda ev: len(ev) >= 2, "gap answered")
        assert isinstance(events[0], AllBlocksCleared) and events[1] == stored([35], tokens(1, base=9000))
        wait_for(lambda: engine_pages(index, t) == 0, what="unknown engine cache withdrawn")
        assert h.relay.stats["engine_gaps"] == 1
    finally:
        h.close()
        pool.close()


def test_engine_load_reaches_the_locality_api(ctx: zmq.Context[Any], redis_server: RedisServer, runtime_dir: str,
                                              index: RedisIndex) -> None:
    metrics = MetricsServer(VLLM_KV)              # stands in for the engine's /metrics
    pool = node("a", redis_server.url, runtime_dir)
    h = Harness(ctx, pool, engine_url=metrics.url)
    api = TestClient(make_app(index))
    t = tokens(2)

    def load() -> dict[str, Any] | None:
        nodes = api.post("/v1/locality", json={"tokens": t}).json()["nodes"]
        return next((n["load"] for n in nodes if n["node_id"] == "a"), None)

    try:
        pool.store([(k, SEG) for k in pool.keys_for(t)]).result()
        kv = {"kv_usage": 0.75, "kv_capacity_tokens": 64 * 128, "block_tokens": 128}
        wait_for(lambda: load() == {"running": 4, "waiting": 5, "preemptions": 3, **kv},
                 what="the engine's load and KV pressure in the API")
        assert Locator(index).locate(t).nodes["a"].load == EngineLoad(4, 5, 0.75, 64 * 128, 128, 3)
        metrics.text = VLLM_KV.replace("} 3.0", "} 0.0").replace("} 5.0", "} 2.0")
        wait_for(lambda: load() == {"running": 1, "waiting": 2, "preemptions": 0, **kv}, what="the new load")
        metrics.text = VLLM                       # an engine exporting only its request gauges
        wait_for(lambda: load() == {"running": 4, "waiting": 5, "preemptions": None, "kv_usage": None,
                                    "kv_capacity_tokens": None, "block_tokens": None}, what="no KV figures")
        metrics.text = None                       # the engine's metrics fail: no load rather than a stale one
        wait_for(lambda: load() is None, what="load withdrawn")
        assert h.thread.is_alive()
    finally:
        h.close()
        pool.close()
        metrics.close()


def test_an_engine_slow_to_answer_metrics_holds_up_no_event(ctx: zmq.Context[Any], redis_server: RedisServer,
                                                            runtime_dir: str, index: RedisIndex) -> None:
    metrics = MetricsServer(VLLM, delay_s=1.0)    # each /metrics answer takes 10 heartbeats
    pool = node("a", redis_server.url, runtime_dir)
    h = Harness(ctx, pool, engine_url=metrics.url)
    try:
        h.connect()
        lags = []
        for j in range(8):                         # spread over several slow reads
            t = tokens(1, base=20_000 + 100 * j)
            sent = time.monotonic()
            h.engine.send(stored([900 + j], t))
            wait_for(lambda t=t: any(isinstance(e, BlockStored) and e.token_ids == t for e in h.tap.events()),
                     what="forwarded")
            lags.append(time.monotonic() - sent)
            time.sleep(0.2)
        assert max(lags) < 0.5, lags               # the relay loop never waits for the engine's /metrics
        # ... and the slow answers still arrive: the load is published.
        wait_for(lambda: EngineLoad.from_meta(next(n.meta for n in index.nodes() if n.node_id == "a:engine"))
                 == EngineLoad(4, 5), what="the slow engine's load")
    finally:
        h.close()
        pool.close()
        metrics.close()


def test_pages_another_engine_computed_in_a_shared_region(ctx: zmq.Context[Any], redis_server: RedisServer,
                                                          runtime_dir: str, shm_path: str,
                                                          index: RedisIndex) -> None:
    cxl = {"path": shm_path, "size": "1MiB", "partitions": 2}
    b = node("b", redis_server.url, runtime_dir, cxl=cxl)
    c = node("c", redis_server.url, runtime_dir, cxl=cxl)
    hb, hc = Harness(ctx, b), Harness(ctx, c)
    try:
        wait_for(lambda: {"b:engine", "c:engine"} <= {n.node_id for n in index.nodes()}, what="relays registered")
        hb.connect()
        t = tokens(2, base=7000)
        c.store([(k, SEG) for k in c.keys_for(t)]).result()              # c computed the prefix, into the region
        # b's relay learns the tokens from c's engine events (found through c's relay's index entry);
        # resend until b's relay has subscribed (ZMQ drops what is sent before a subscriber joins).
        def announced() -> bool:
            hc.engine.send(stored([41, 42], t))
            return bool(cpu(hb.tap.events(), BlockStored))
        wait_for(announced, what="b announces c's pages")
        ev = cpu(hb.tap.events(), BlockStored)[0]
        assert ev.token_ids == t and ev.parent_block_hash is None
        assert engine_pages(index, t, "b:engine") == 0                   # but b's engine never held them
    finally:
        hb.close()
        hc.close()
        b.close()
        c.close()


def test_pages_over_the_fabric_are_announced_as_an_external_pool_copy(
        ctx: zmq.Context[Any], redis_server: RedisServer, runtime_dir: str, index: RedisIndex) -> None:
    x = fabric_node("x", redis_server.url, runtime_dir)
    y = fabric_node("y", redis_server.url, runtime_dir)
    hx, hy = Harness(ctx, x), Harness(ctx, y)
    try:
        wait_for(lambda: {"x:engine", "y:engine"} <= {n.node_id for n in index.nodes()}, what="relays registered")
        hx.connect()
        t = tokens(3, base=8000)
        x.store([(k, SEG) for k in x.keys_for(t)[:1]]).result()         # x holds page 0 itself
        y.store([(k, SEG) for k in y.keys_for(t)]).result()              # y computed all 3

        def external(events: list[KVEvent]) -> list[BlockStored]:
            return [e for e in events if isinstance(e, BlockStored) and e.ownership == "pof"]

        def announced() -> bool:                  # x's relay learns the tokens from y's engine events
            hy.engine.send(stored([51, 52, 53], t))
            return bool(external(hx.tap.events()))
        wait_for(announced, what="x announces y's pages as an external copy")
        far = external(hx.tap.events())[0]
        assert far.token_ids == t and far.parent_block_hash is None and far.locality == "REMOTE"
        host = [e for e in cpu(hx.tap.events(), BlockStored) if e.ownership is None]
        assert host and all(e.token_ids == t[:PAGE] for e in host)      # the host claim: page 0 only
        assert engine_pages(index, t, "x:engine") == 0

        y.close()                                                        # y leaves: only page 0 is left
        removed = hx.tap.wait(lambda ev: any(isinstance(e, BlockRemoved) and e.ownership == "pof" for e in ev),
                              "the external claim withdrawn")
        gone = next(e for e in removed if isinstance(e, BlockRemoved) and e.ownership == "pof")
        assert set(far.block_hashes) == set(gone.block_hashes)
        assert not [e for e in removed if isinstance(e, BlockRemoved) and e.ownership is None]
    finally:
        hx.close()
        hy.close()
        x.close()
        y.close()


def test_page_chains_match_pof_keys() -> None:
    t = tokens(4)
    chains = PageChains(2 * PAGE)                                        # a page = two engine blocks
    first = chains.stored("e", stored([1, 2, 3], t[:48]))                # page 0, and half of page 1
    assert [p.digest for p in first] == [k.digest for k in page_keys(NS, t, 2 * PAGE)[:1]]
    rest = chains.stored("e", stored([4], t[48:], parent=3))
    assert [p.digest for p in rest] == [k.digest for k in page_keys(NS, t, 2 * PAGE)[1:]]
    assert chains.page_of(("e", 3)) == chains.page_of(("e", 4)) == rest[0].digest
    chain = chains.chain(rest[0].digest)
    assert chain is not None and [x for p in chain for x in p.token_list()] == t
    assert chains.leaves() == [rest[0].digest]
    salted = stored([9], t[:16])
    salted.extra_keys = [("salt",)]
    assert chains.stored("e", salted) == [] and chains.stored("e", stored([8], t[:16], parent=77)) == []
    assert chains.stored("other", stored([4], t[48:], parent=3)) == []   # block ids are per source
    assert chains.skipped == 3
    small = PageChains(PAGE, max_pages=2)
    small.stored("e", stored([1, 2, 3], tokens(3)))
    assert len(small) == 2 and small.chain(small.leaves()[0]) is None    # the first page was forgotten


def test_page_chains_know_each_pages_place() -> None:
    """Pages made from events of three blocks each (a page = two blocks, so a page spans two
    events now and then) carry the places page_keys gives: the index keeps them in segments."""
    t = tokens(70)
    chains = PageChains(2 * PAGE)
    pages = []
    for first in range(0, 70, 3):
        hashes = list(range(first + 1, min(first + 4, 71)))
        pages += chains.stored("e", stored(hashes, t[first * PAGE:(first + len(hashes)) * PAGE],
                                           parent=first if first else None))
    want = page_keys(NS, t, 2 * PAGE)
    assert [(p.digest, p.place) for p in pages] == [(k.digest, k.place) for k in want]


def test_cli_relay_stops_on_sigterm(redis_server: RedisServer, runtime_dir: str, index: RedisIndex,
                                    tmp_path: Path, ctx: zmq.Context[Any]) -> None:
    pool = node("a", redis_server.url, runtime_dir)
    engine = FakeEngine(ctx)
    cfg = tmp_path / "pof.json"
    cfg.write_text(json.dumps({"node_id": "a", "index_url": redis_server.url, "runtime_dir": runtime_dir,
                               "heartbeat_s": 0.1, "node_ttl_s": 2.0}))
    proc = subprocess.Popen([sys.executable, "-m", "pof_connector.cli", "relay", "--config", str(cfg),
                             "--engine-events", engine.endpoint, "--bind", "tcp://127.0.0.1:0"],
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        wait_for(lambda: any(n.node_id == "a:engine" for n in index.nodes()), what="relay registered")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
        assert proc.returncode == 0, err.decode()
        assert b"routers connect to tcp://127.0.0.1:" in err and b"stopped" in err
        assert not any(n.node_id == "a:engine" for n in index.nodes())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        pool.close()
