"""Remote loads release layers progressively, and survive an owner that dies mid-transfer.

Pages here are large (32 layers of 32 KiB, 1 MiB a page) so a load of a few dozen pages takes
measurable time over UCX/TCP loopback. Node B reads node A's pages in parts (headers and layer 0
first); the tests hold B's view of the later parts as "not done yet" (``PartGate``) to show,
deterministically, that layer 0 is usable before the rest arrived, and that a page whose slot is
reused after its layer 0 was released still fails as a whole (a miss, never a wrong page).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from pof_connector.config import PofConfig
from pof_connector.fabric import nixl_installed
from pof_connector.fabric.agent import NixlAgent
from pof_connector.index.server import RedisServer
from pof_connector.pages.keys import PageKey
from pof_connector.pages.layout import PageError, PageSpec
from pof_connector.pool import Pool
from tests.fabric.harness import NodeProc, node_config, wait_for
from tests.fabric.node_proc import NAMESPACE, content

pytestmark = [pytest.mark.nixl,
              pytest.mark.skipif(not nixl_installed(),
                                 reason="NIXL is not installed (pip install --no-deps nixl-cu13==1.5.1)")]

BIG = PageSpec(num_layers=32, segment_bytes=32 << 10, page_tokens=16)
PAGES = 40
TIMEOUT_S = 10.0
"""fabric.timeout_s here: generous, so a busy machine does not turn a success into a timeout."""
FAILURES = {"remote_error", "peer_down", "timeout"}
REUSED = {"bad_checksum", "stale_generation", "wrong_key", "bad_header"}


def big_config(node: str, redis_url: str, runtime_dir: str) -> dict[str, Any]:
    cfg = node_config(node, redis_url, runtime_dir, dram="64MiB")
    cfg["fabric"].update(timeout_s=TIMEOUT_S, staging_size="64MiB")
    return cfg


def big_pool(node: str, redis_server: RedisServer, runtime_dir: str) -> Pool:
    return Pool(PofConfig.from_mapping(big_config(node, redis_server.url, runtime_dir)), BIG, NAMESPACE)


@functools.lru_cache(maxsize=2 * PAGES)
def segments(key: PageKey) -> list[bytes]:
    """``key``'s page content (generating it is slow: cache it)."""
    return [s.tobytes() for s in content(key, BIG)]


def exact(buf: np.ndarray, key: PageKey, layers: range = range(BIG.num_layers)) -> bool:
    data = segments(key)
    return all(bytes(BIG.segment(memoryview(buf), layer)) == data[layer] for layer in layers)


class PartGate:
    """While closed, B's agent reports its READ parts after the first (headers and layer 0) as not
    done: their bytes may land, but B cannot validate or release later layers. The generation
    re-check is posted only after every part is seen done, so it waits for the gate too."""

    def __init__(self, agent: NixlAgent, staging_slots: int) -> None:
        self.opened = threading.Event()
        self.posted: list[int] = []           # part of every READ posted (0 also for generation READs)
        self._part: dict[int, int] = {}
        post, done = agent.post_read, agent.done

        def post_read(local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray) -> Any:
            handle = post(local, local_idx, remote, remote_idx)
            first = int(local_idx[0])         # staging descriptors: pages, generations, then parts
            self._part[id(handle)] = first // staging_slots - 2 if first >= 2 * staging_slots else 0
            self.posted.append(self._part[id(handle)])
            return handle

        def gated_done(handle: Any) -> bool:
            if self._part.get(id(handle), 0) >= 1 and not self.opened.is_set():
                return False
            return done(handle)

        agent.post_read = post_read  # type: ignore[method-assign]
        agent.done = gated_done  # type: ignore[method-assign]


@pytest.fixture
def a_and_b(redis_server: RedisServer, runtime_dir: str) -> Iterator[tuple[Pool, Pool, list[PageKey]]]:
    a = big_pool("a", redis_server, runtime_dir)
    b = big_pool("b", redis_server, runtime_dir)
    try:
        keys = a.keys_for(np.arange(16 * PAGES))
        assert a.store([(k, content(k, BIG)) for k in keys]).result() == PAGES
        wait_for(lambda: b.lookup(keys).pages == PAGES, what="B's lookup of A's pages")
        yield a, b, keys
    finally:
        b.close()
        a.close()


def test_layer_0_is_released_before_the_last_part_arrives(a_and_b: tuple[Pool, Pool, list[PageKey]]) -> None:
    _, b, keys = a_and_b
    lk = b.lookup(keys)
    assert {s.node for s in lk.sources} == {"a"}
    bufs = [np.zeros(BIG.page_bytes, np.uint8) for _ in keys]

    # Ungated, for the figures: when layer 0 is released, and when the whole load is.
    for _ in range(2):                  # the first load also connects to A
        t0 = time.monotonic()
        h = b.load(keys, lk.sources, bufs)
        assert h.wait_layer(0, 2 * TIMEOUT_S)
        t_layer0 = time.monotonic() - t0
        assert h.wait(2 * TIMEOUT_S)
        t_all = time.monotonic() - t0
        assert h.failed == {} and all(exact(buf, k) for buf, k in zip(bufs, keys, strict=True))
        print(f"\n{PAGES} pages of {BIG.page_bytes >> 10} KiB: layer 0 after {t_layer0 * 1e3:.1f} ms, "
              f"whole load {t_all * 1e3:.1f} ms")
        assert t_layer0 <= t_all

    assert b.fabric is not None
    gate = PartGate(b.fabric.agent, b.fabric.staging.num_slots)
    # Pool.load (I/O thread): layer 0 is in every buffer, validated, while later parts are held.
    bufs = [np.zeros(BIG.page_bytes, np.uint8) for _ in keys]
    h = b.load(keys, lk.sources, bufs)
    assert h.wait_layer(0, TIMEOUT_S)
    assert not h.wait_layer(1, 0.3) and not h.done
    assert all(exact(buf, k, range(1)) for buf, k in zip(bufs, keys, strict=True))
    gate.opened.set()
    assert h.wait(TIMEOUT_S) and h.failed == {}
    assert all(exact(buf, k) for buf, k in zip(bufs, keys, strict=True))

    # The adapters' path (Pool.open_read): segment(i, 0) returns while the rest is held.
    gate.opened.clear()
    reader = b.open_read(keys, lk.sources)
    try:
        for i, k in enumerate(keys):
            seg = reader.segment(i, 0)
            assert seg is not None and seg.tobytes() == segments(k)[0]
            assert reader.check(i, 0, reader.landed_sum(i, seg.copy()))
        gate.opened.set()
        for layer in range(1, BIG.num_layers):
            for i, k in enumerate(keys):
                seg = reader.segment(i, layer)
                assert seg is not None and seg.tobytes() == segments(k)[layer]
                assert reader.check(i, layer, reader.landed_sum(i, seg.copy()))
        assert reader.failed == {}
    finally:
        reader.close()

    # RemoteReader.read: whole pages at once; the caller gives the good ones' staging back.
    meta = b.finder.remote_meta("a", "cpu_dram")
    assert meta is not None
    got = b.fabric.reader.read(keys[:4], lk.sources[:4], [meta] * 4)
    for fetched, k in zip(got, keys[:4], strict=True):
        assert not isinstance(fetched, PageError), fetched
        staged, ref, _ = fetched
        assert all(staged.segment_view(ref, layer).tobytes() == segments(k)[layer] for layer in range(BIG.num_layers))
        staged.unpin(ref.slot)
    assert b.fabric.staging.quarantined_slots == 0
    assert len(b.fabric.staging.take(b.fabric.staging.num_slots)) == b.fabric.staging.num_slots


def test_a_slot_reused_after_layer_0_was_released_fails_the_whole_page(
        a_and_b: tuple[Pool, Pool, list[PageKey]]) -> None:
    a, b, keys = a_and_b
    lk = b.lookup(keys)
    assert b.fabric is not None
    gate = PartGate(b.fabric.agent, b.fabric.staging.num_slots)
    bufs = [np.zeros(BIG.page_bytes, np.uint8) for _ in keys]
    h = b.load(keys, lk.sources, bufs)
    assert h.wait_layer(0, TIMEOUT_S)
    # Layer 0 of every page is out; now A reuses the slots of the first half for other pages.
    half = PAGES // 2
    for k in keys[:half]:
        assert a.tiers[0].remove(k) is not None
    others = a.keys_for(np.arange(16 * half) + 7_000_000)
    assert a.store([(k, content(k, BIG)) for k in others]).result() == half
    assert sorted(a.lookup(others).sources[i].slot for i in range(half)) == sorted(s.slot for s in lk.sources[:half])
    gate.opened.set()
    assert h.wait(TIMEOUT_S)
    assert set(h.failed) == set(range(half)), h.failed
    assert set(h.failed.values()) <= REUSED, h.failed
    assert all(exact(buf, k) for i, (buf, k) in enumerate(zip(bufs, keys, strict=True)) if i >= half)

    # A load of reused slots only: every page fails on its header, so the later parts are not read.
    gate.posted.clear()
    h = b.load(keys[:half], lk.sources[:half], bufs[:half])
    assert h.wait(TIMEOUT_S) and set(h.failed) == set(range(half)), h.failed
    assert set(h.failed.values()) <= REUSED and gate.posted == [0], (h.failed, gate.posted)
    n = b.fabric.staging.num_slots
    assert b.fabric.staging.quarantined_slots == 0 and len(b.fabric.staging.take(n)) == n


def test_an_owner_killed_mid_load_gives_misses_not_a_hang_and_b_keeps_working(
        redis_server: RedisServer, runtime_dir: str) -> None:
    page = (BIG.num_layers, BIG.segment_bytes)
    procs: list[NodeProc] = []
    b = big_pool("b", redis_server, runtime_dir)
    try:
        a = NodeProc(big_config("a", redis_server.url, runtime_dir), page=page)
        procs.append(a)
        c = NodeProc(big_config("c", redis_server.url, runtime_dir), page=page)
        procs.append(c)
        assert a.call("store", seed=1, pages=PAGES) == {"stored": PAGES}
        assert c.call("store", seed=2, pages=8) == {"stored": 8}
        keys = b.keys_for(np.arange(16 * PAGES) + 1_000_000)
        from_c = b.keys_for(np.arange(16 * 8) + 2_000_000)
        wait_for(lambda: b.lookup(keys).pages == PAGES, what="B's lookup of A's pages")
        wait_for(lambda: b.lookup(from_c).pages == 8, what="B's lookup of C's pages")
        lk, lk_c = b.lookup(keys), b.lookup(from_c)
        assert {s.node for s in lk.sources} == {"a"} and {s.node for s in lk_c.sources} == {"c"}
        # One load of A's 40 pages and C's 8; A dies once layer 0 is out. The gate keeps B from
        # finishing A's pages before the kill lands, however slow this machine is: B sees the
        # later parts done only after the kill (their bytes keep flowing until it).
        assert b.fabric is not None
        gate = PartGate(b.fabric.agent, b.fabric.staging.num_slots)
        both = keys + from_c
        bufs = [np.zeros(BIG.page_bytes, np.uint8) for _ in both]
        h = b.load(both, lk.sources + lk_c.sources, bufs)
        assert h.wait_layer(0, TIMEOUT_S)
        in_flight = not h.done
        killed = time.monotonic()
        a.kill()                            # SIGKILL by PID while B's later parts are on the wire
        gate.opened.set()
        assert h.wait(TIMEOUT_S), "B's load hung after its owner died"
        seconds = time.monotonic() - killed
        failed = h.failed
        print(f"\nA killed {'during' if in_flight else 'after'} B's load: {len(failed)} of A's {PAGES} pages "
              f"failed ({sorted(set(failed.values()))}), C's 8 loaded; the load ended {seconds * 1e3:.0f} ms "
              f"after the kill")
        assert seconds < TIMEOUT_S
        assert set(failed) <= set(range(PAGES)) and set(failed.values()) <= FAILURES, failed
        assert all(exact(buf, k) for i, (buf, k) in enumerate(zip(bufs, both, strict=True)) if i not in failed)
        assert in_flight and set(failed) == set(range(PAGES)), "A's pages are one group: they fail together"

        # B keeps working: A's pages fail fast, its own pages load, another live peer's too.
        h = b.load(keys[:4], lk.sources[:4], bufs[:4])
        assert h.wait(TIMEOUT_S) and len(h.failed) == 4 and set(h.failed.values()) <= FAILURES
        own = b.keys_for(np.arange(16 * 4) + 5_000_000)
        assert b.store([(k, content(k, BIG)) for k in own]).result() == 4
        lk_own = b.lookup(own)
        assert lk_own.pages == 4 and {s.node for s in lk_own.sources} == {"b"}
        h = b.load(own, lk_own.sources, bufs[:4])
        assert h.wait(TIMEOUT_S) and h.failed == {}
        assert all(exact(buf, k) for buf, k in zip(bufs[:4], own, strict=True))
        h = b.load(from_c, lk_c.sources, bufs[:8])
        assert h.wait(TIMEOUT_S) and h.failed == {}
        assert all(exact(buf, k) for buf, k in zip(bufs[:8], from_c, strict=True))
        assert b.fabric.staging.quarantined_slots == 0       # a dead peer writes nothing late
    finally:
        for p in procs:
            p.close()
        b.close()
