"""The peer-HBM tier: one region on a (GPU) device, shared by processes through the runtime dir.

Runs on ``cpu`` everywhere torch is installed (CI: the vLLM venv, ``-m torch``) and also on every
CUDA device when one is present (``ci/gpu_check.sh``): the same tier code, only the device differs.
With one GPU, "peer" is that GPU mapped by another process through CUDA IPC.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pof_connector.config import PofConfig, TierConfig  # noqa: E402
from pof_connector.index.server import RedisServer  # noqa: E402
from pof_connector.pages import page_sum  # noqa: E402
from pof_connector.pages.keys import PageKey  # noqa: E402
from pof_connector.pages.layout import PageError, PageHeader, PageSpec  # noqa: E402
from pof_connector.pool import Pool  # noqa: E402
from pof_connector.tiers import SlotRef, make_tier  # noqa: E402
from pof_connector.tiers.peer_hbm import PeerHbmTier  # noqa: E402

pytestmark = pytest.mark.torch

SPEC = PageSpec(num_layers=4, segment_bytes=4096, page_tokens=16)


def _devices() -> list[object]:
    out: list[object] = ["cpu"]
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        for name in sorted({"cuda:0", f"cuda:{n - 1}"}):
            out.append(pytest.param(name, marks=pytest.mark.gpu))
    return out


@pytest.fixture(params=_devices())
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def key(i: int) -> PageKey:
    return PageKey(bytes(16), i.to_bytes(32, "little"))


def content(k: PageKey) -> list[np.ndarray]:
    rng = np.random.default_rng(int.from_bytes(k.digest[:8], "little"))
    return [rng.integers(0, 255, SPEC.segment_bytes, dtype=np.uint8) for _ in range(SPEC.num_layers)]


def config(device: str, partitions: int = 4) -> TierConfig:
    return TierConfig("peer_hbm", 1 << 20, partitions=partitions, device=device)


def tier(device: str, runtime_dir: str) -> PeerHbmTier:
    t = make_tier(config(device), SPEC, runtime_dir)
    assert isinstance(t, PeerHbmTier)
    return t


def write(t: PeerHbmTier, i: int) -> tuple[int, int, int]:
    got = t.prepare_store(key(i))
    assert got is not None
    ref, _ = got
    t.write(ref, key(i), content(key(i)))
    t.complete_store(key(i), ok=True)
    return i, ref.slot, ref.generation


def flip(t: PeerHbmTier, offset: int, mask: int) -> None:
    """Corrupt one byte of the region (and wait: the tier copies on its own stream)."""
    t._dev[offset] ^= mask
    if t._dev.device.type == "cuda":
        torch.cuda.synchronize(t._dev.device)


def exact(buf: np.ndarray, k: PageKey) -> bool:
    return all(bytes(SPEC.segment(memoryview(buf), layer)) == data.tobytes()
               for layer, data in enumerate(content(k)))


def read_all(t: PeerHbmTier, refs: list[tuple[int, int, int]]) -> list[str]:
    out = []
    buf = np.empty(SPEC.page_bytes, np.uint8)
    for i, slot, gen in refs:
        try:
            t.read(SlotRef(slot, gen), key(i), buf)
        except PageError as e:
            out.append(e.reason)
            continue
        out.append("ok" if exact(buf, key(i)) else "WRONG")
    return out


def child(device: str, runtime_dir: str, refs: list[tuple[int, int, int]], first: int, count: int
          ) -> tuple[bool, list[str], list[tuple[int, int, int]]]:
    """In another process: attach, read ``refs``, then write ``count`` pages of our own."""
    t = tier(device, runtime_dir)
    try:
        reasons = read_all(t, refs)
        mine = [write(t, i) for i in range(first, first + count)]
        return t.owner, reasons, mine
    finally:
        t.close()


@pytest.fixture
def spawn() -> Iterator[ProcessPoolExecutor]:
    # spawn, not fork: a forked child cannot use CUDA that its parent initialized.
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
        yield ex


def test_put_get_byte_exact_in_another_process(device: str, runtime_dir: str, spawn: ProcessPoolExecutor) -> None:
    owner = tier(device, runtime_dir)
    try:
        assert owner.owner
        n = owner.capacity_slots
        refs = [write(owner, i) for i in range(n)]
        child_owner, reasons, theirs = spawn.submit(child, device, runtime_dir, refs, 1000, 3).result(timeout=120)
        assert not child_owner and reasons == ["ok"] * n
        # What the other process wrote (in its own partition) reads back byte-exact here.
        assert {slot for _, slot, _ in theirs}.isdisjoint(slot for _, slot, _ in refs)
        assert read_all(owner, theirs) == ["ok"] * 3
        # Evict and reuse every slot of the owner's partition: the other process's refs go stale.
        for i in range(n, 2 * n):
            write(owner, i)
        _, reasons, _ = spawn.submit(child, device, runtime_dir, refs, 2000, 0).result(timeout=120)
        assert set(reasons) <= {"stale_generation", "wrong_key"} and "ok" not in reasons
    finally:
        owner.close()


def test_stale_refs_are_rejected_after_reuse(device: str, runtime_dir: str) -> None:
    owner = tier(device, runtime_dir)
    other = tier(device, runtime_dir)        # a second writer of the same region (another partition)
    try:
        assert owner.domain == other.domain and not other.owner
        i, slot, gen = write(owner, 1)
        assert read_all(other, [(i, slot, gen)]) == ["ok"]
        owner.remove(key(1))
        assert read_all(other, [(i, slot, gen)]) in (["stale_generation"], ["bad_header"])   # invalidated at once
        j, slot2, gen2 = write(owner, 2)
        assert slot2 == slot and gen2 == gen + 1
        assert read_all(other, [(i, slot, gen)]) == ["wrong_key"]
        assert read_all(other, [(1, slot, gen2)]) == ["wrong_key"]
        assert read_all(other, [(j, slot, gen2)]) == ["ok"]
    finally:
        other.close()
        owner.close()


def test_layer_reads_are_checked_after_the_copy(device: str, runtime_dir: str) -> None:
    t = tier(device, runtime_dir)
    try:
        i, slot, gen = write(t, 5)
        ref = SlotRef(slot, gen)
        head = np.empty(SPEC.header_bytes, np.uint8)
        header = t.read_header(ref, key(i), head)
        into = t.host_buffer(SPEC.segment_bytes)
        for layer, data in enumerate(content(key(i))):
            seg = t.segment_view(ref, layer, into=into)
            assert bytes(seg) == data.tobytes()
            t.check_segment(ref, header, layer, page_sum.checksum(seg, header.sum_seed))
        # A writer reuses the slot after the reader copied layer 0 but before it checked it.
        seg = t.segment_view(ref, 0, into=into).copy()
        assert seg.tobytes() == content(key(i))[0].tobytes()
        t.remove(key(i))
        with pytest.raises(PageError) as e:
            t.check_segment(ref, header, 0, page_sum.checksum(seg, header.sum_seed))
        assert e.value.reason == "stale_generation"
    finally:
        t.close()


def test_device_to_device_read(device: str, runtime_dir: str) -> None:
    t = tier(device, runtime_dir)
    try:
        i, slot, gen = write(t, 7)
        engine = "cuda:0" if device.startswith("cuda") else "cpu"     # the engine's GPU, maybe not the region's
        into = torch.zeros(SPEC.page_bytes, dtype=torch.uint8, device=engine)
        t.read(SlotRef(slot, gen), key(i), into)
        assert exact(into.cpu().numpy(), key(i))
        # Segments given as device tensors are written device-to-device, checksummed all the same.
        src = [torch.from_numpy(d).to(engine) for d in content(key(8))]
        got = t.prepare_store(key(8))
        assert got is not None
        t.write(got[0], key(8), src)
        t.complete_store(key(8), ok=True)
        out = np.empty(SPEC.page_bytes, np.uint8)
        t.read(got[0], key(8), out)
        assert exact(out, key(8))
        flip(t, t.slot_offset(slot) + SPEC.segment_offset(3) + 11, 0x40)          # a flipped bit
        with pytest.raises(PageError) as e:
            t.read(SlotRef(slot, gen), key(i), into)
        assert e.value.reason == "bad_checksum"
        flip(t, t.slot_offset(slot) + SPEC.segment_offset(3) + 11, 0x40)          # repaired: accepted again
        t.read(SlotRef(slot, gen), key(i), into)
        t._set_live_generation(slot, 0)          # a writer took the slot: a read into the GPU refuses it
        with pytest.raises(PageError):
            t.read(SlotRef(slot, gen), key(i), into)
    finally:
        t.close()


def test_read_many_reports_each_page_on_its_own(device: str, runtime_dir: str) -> None:
    """A batch read into the engine's GPU (one wait for the batch there): good pages land byte-exact
    beside a corrupted, a mis-keyed and a stale one, each refused with its reason."""
    t = tier(device, runtime_dir)
    try:
        written = [write(t, i) for i in range(20, 25)]
        refs = [SlotRef(slot, gen) for _, slot, gen in written]
        keys = [key(i) for i, _, _ in written]
        flip(t, t.slot_offset(refs[1].slot) + SPEC.segment_offset(SPEC.num_layers - 1) + 5, 0x02)
        keys[2] = key(99)                                          # asked for another page's bytes
        refs[3] = SlotRef(refs[3].slot, refs[3].generation + 1)     # a generation the slot never had
        engine = "cuda:0" if device.startswith("cuda") else "cpu"
        out = torch.zeros((6, SPEC.page_bytes + 64), dtype=torch.uint8, device=engine)
        got = t.read_many(refs, keys, out)
        assert [g.reason if isinstance(g, PageError) else "ok" for g in got] == \
            ["ok", "bad_checksum", "wrong_key", "stale_generation", "ok"]
        for row, (i, _, _) in ((0, written[0]), (4, written[4])):
            assert exact(out[row].cpu().numpy(), key(i))
        assert not out[5].any()                                    # a row past the batch is not touched
        beyond = [SlotRef(t.num_slots, 1), SlotRef(written[0][1], written[0][2])]     # a slot the tier has not
        assert [g.reason if isinstance(g, PageError) else "ok" for g in t.read_many(beyond, [key(98), key(20)], out)] \
            == ["bad_location", "ok"]
        assert t.read_many([], [], out) == []
    finally:
        t.close()


def test_a_write_is_done_with_its_sources_when_it_returns(device: str, runtime_dir: str) -> None:
    """Segments are queued without a wait each, so the one wait at the end must cover them: big
    pinned sources overwritten right after ``write`` returns leave the page as it was written."""
    spec = PageSpec(num_layers=8, segment_bytes=1 << 20, page_tokens=16)
    t = make_tier(TierConfig("peer_hbm", 3 * spec.page_bytes, partitions=1, device=device), spec, runtime_dir)
    assert isinstance(t, PeerHbmTier)
    try:
        rng = np.random.default_rng(4)
        want = [rng.integers(0, 256, spec.segment_bytes, dtype=np.uint8) for _ in range(spec.num_layers)]
        srcs = [torch.from_numpy(w.copy()) for w in want]
        if torch.cuda.is_available():
            srcs = [s.pin_memory() for s in srcs]
        got = t.prepare_store(key(40))
        assert got is not None
        t.write(got[0], key(40), srcs)
        for src in srcs:
            src.fill_(0xFF)
        t.complete_store(key(40), ok=True)
        out = np.empty(spec.page_bytes, np.uint8)
        t.read(got[0], key(40), out)
        assert all(np.array_equal(spec.segment(out, i), w) for i, w in enumerate(want))
    finally:
        t.close()


def old_format_page(k: PageKey, version: int, generation: int) -> np.ndarray:
    """A page as a build of format v1 (xxh3 per segment) or v2 (word sums) wrote it: its segment
    checksums at byte 88, no seed (their values do not matter: the version refuses it first)."""
    import struct

    import xxhash

    page = np.zeros(SPEC.page_bytes, np.uint8)
    for layer, data in enumerate(content(k)):
        SPEC.segment(page, layer)[:] = data
    raw = bytearray(SPEC.header_bytes)
    struct.pack_into(f"<4sHH16s32sQIIIIQ{SPEC.num_layers}Q", raw, 0, b"POFP", version, 0, k.namespace, k.digest,
                     generation, SPEC.num_layers, SPEC.segment_bytes, SPEC.page_tokens, 0, 0,
                     *range(SPEC.num_layers))
    covered = 88 + 8 * SPEC.num_layers if version == 1 else SPEC.header_bytes
    h = xxhash.xxh3_64(bytes(raw[:80]))
    h.update(bytes(raw[88:covered]))
    struct.pack_into("<Q", raw, 80, h.intdigest())
    page[:SPEC.header_bytes] = np.frombuffer(bytes(raw), np.uint8)
    return page


@pytest.mark.parametrize("version", [1, 2])
def test_pages_of_earlier_formats_are_refused(device: str, runtime_dir: str, version: int) -> None:
    """A v1 or v2 page in a slot (a region a build of that format wrote) is a miss on every read
    path, ``read`` and ``read_many`` into the engine's device: bad_header, naming its version."""
    t = tier(device, runtime_dir)
    try:
        k = key(50)
        got = t.prepare_store(k)
        assert got is not None
        ref = got[0]
        page = old_format_page(k, version, ref.generation)
        start = t.slot_offset(ref.slot)
        t._dev[start:start + SPEC.page_bytes].copy_(torch.from_numpy(page).to(t._dev.device))
        assert t.live_generation(ref.slot) == ref.generation
        engine = "cuda:0" if device.startswith("cuda") else "cpu"
        out = torch.zeros((1, SPEC.page_bytes), dtype=torch.uint8, device=engine)
        with pytest.raises(PageError) as e:
            t.read(ref, k, out[0])
        assert e.value.reason == "bad_header" and f"version {version}; this build reads 3" in str(e.value)
        (refused,) = t.read_many([ref], [k], out)
        assert isinstance(refused, PageError) and refused.reason == "bad_header"
        with pytest.raises(PageError) as e:
            t.read_header(ref, k, np.empty(SPEC.header_bytes, np.uint8))
        assert e.value.reason == "bad_header"
    finally:
        t.close()


def test_pages_of_other_writers_are_read_under_their_own_seeds(device: str, runtime_dir: str) -> None:
    """Two writers of one region have their own checksum seeds: each reads the other's pages (a
    GPU read sums under the seed it expects for the slot, and again under the header's when that
    differs), page by page and as a batch of mixed seeds, and a flipped bit is still refused."""
    a, b = tier(device, runtime_dir), tier(device, runtime_dir)
    try:
        assert a.sum_seed != b.sum_seed
        mine = [write(a, i) for i in range(60, 63)] + [write(b, i) for i in range(63, 66)]
        refs = [SlotRef(slot, gen) for _, slot, gen in mine]
        keys = [key(i) for i, _, _ in mine]
        engine = "cuda:0" if device.startswith("cuda") else "cpu"
        out = torch.zeros((len(refs), SPEC.page_bytes), dtype=torch.uint8, device=engine)
        for reader in (a, b):
            for _ in range(2):           # the first time under a wrong guess for the other's slots, then right
                for ref, k, row in zip(refs, keys, out, strict=True):
                    header = reader.read(ref, k, row)
                    assert header.sum_seed == (a.sum_seed if k.digest[0] < 63 else b.sum_seed)
                    assert exact(row.cpu().numpy(), k)
            got = reader.read_many(refs, keys, out)
            assert all(isinstance(g, PageHeader) for g in got), got
            assert all(exact(out[i].cpu().numpy(), k) for i, k in enumerate(keys))
        fresh = tier(device, runtime_dir)         # a reader that has seen none of these slots
        try:
            got = fresh.read_many(refs, keys, out)
            assert [g.sum_seed for g in got if isinstance(g, PageHeader)] == [a.sum_seed] * 3 + [b.sum_seed] * 3
            flip(fresh, fresh.slot_offset(refs[4].slot) + SPEC.segment_offset(2) + 7, 0x08)
            fresh2 = tier(device, runtime_dir)
            try:
                got = fresh2.read_many(refs, keys, out)
                assert [g.reason if isinstance(g, PageError) else "ok" for g in got] == \
                    ["ok", "ok", "ok", "ok", "bad_checksum", "ok"]
                with pytest.raises(PageError) as e:
                    fresh2.read(refs[4], keys[4], out[4])
                assert e.value.reason == "bad_checksum"
            finally:
                fresh2.close()
        finally:
            fresh.close()
    finally:
        b.close()
        a.close()


def test_pool_hands_pages_to_the_engine_only_after_checks(device: str, runtime_dir: str, namespace: bytes) -> None:
    cfg = PofConfig.from_mapping({"node_id": "a", "index_url": "local", "runtime_dir": runtime_dir,
                                  "tiers": {"peer_hbm": {"device": device, "size": "1MiB", "partitions": 2}}})
    pool = Pool(cfg, SPEC, namespace)
    try:
        keys = pool.keys_for(np.arange(16 * 4))
        pool.store([(k, content(k)) for k in keys]).result()
        lk = pool.lookup(keys)
        assert lk.per_tier() == {"peer_hbm": 4}
        t = pool.tiers[0]
        assert isinstance(t, PeerHbmTier)
        ref = t.find(keys[1])
        assert ref is not None
        flip(t, t.slot_offset(ref.slot) + SPEC.segment_offset(2) + 7, 0xFF)           # a flipped bit
        t.remove(keys[3])                                                               # evicted meanwhile
        bufs = [np.zeros(SPEC.page_bytes, np.uint8) for _ in range(4)]
        h = pool.load(keys, lk.sources, bufs)
        assert h.wait(10)
        assert h.failed == {1: "bad_checksum", 3: "evicted"}
        for i in (0, 2):
            assert exact(bufs[i], keys[i])
        # The zero-copy reader (vLLM's worker path): a failed check marks the page for recompute.
        # (The corrupt page 1 was dropped by the load above: it is gone now.)
        ref2 = t.find(keys[2])
        assert ref2 is not None
        flip(t, t.slot_offset(ref2.slot) + SPEC.segment_offset(3) + 1, 0x01)
        reader = pool.open_read(keys[:3], lk.sources[:3])
        try:
            for layer in range(SPEC.num_layers):
                for i in range(3):
                    reader.copy_into(i, layer, SPEC.segment(bufs[i], layer))
            assert reader.failed == {1: "evicted", 2: "bad_checksum"}
            assert exact(bufs[0], keys[0])
        finally:
            reader.close()
    finally:
        pool.close()


def test_attached_tier_notices_its_owner_leaving(device: str, runtime_dir: str) -> None:
    owner = tier(device, runtime_dir)
    other = tier(device, runtime_dir)
    try:
        assert owner.healthy() and other.healthy()
        owner.close()
        assert not other.healthy()
        fresh = tier(device, runtime_dir)           # the next process creates a new region
        try:
            assert fresh.owner and fresh.domain != other.domain
        finally:
            fresh.close()
    finally:
        other.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a host without CUDA")
def test_a_gpu_device_without_cuda_names_the_key(runtime_dir: str) -> None:
    from pof_connector.config import ConfigError

    with pytest.raises(ConfigError, match=r"tiers\.peer_hbm\.device: 'cuda:1' but CUDA is not available"):
        tier("cuda:1", runtime_dir)


def owner_process(device: str, runtime_dir: str, conn: object) -> None:
    """In another process: create the region, write a page, report, then wait to be killed."""
    t = tier(device, runtime_dir)
    conn.send((t.owner, t.domain, write(t, 3)))       # type: ignore[attr-defined]
    time.sleep(120)


def test_a_killed_owner_is_noticed_and_replaced(device: str, runtime_dir: str) -> None:
    ctx = mp.get_context("spawn")
    parent, child_end = ctx.Pipe()
    proc = ctx.Process(target=owner_process, args=(device, runtime_dir, child_end), daemon=True)
    proc.start()
    try:
        assert parent.poll(120), "the owner process did not start"
        was_owner, domain, ref = parent.recv()
        assert was_owner
        other = tier(device, runtime_dir)
        try:
            assert other.domain == domain and not other.owner and other.healthy()
            assert read_all(other, [ref]) == ["ok"]
            proc.kill()                     # kill -9: no close, its files stay behind
            proc.join(30)
            assert not other.healthy()
        finally:
            other.close()
        fresh = tier(device, runtime_dir)
        try:
            assert fresh.owner and fresh.domain != domain
            leftovers = [n for n in os.listdir(fresh._peer.dir) if n.startswith("generations-")]
            assert leftovers == [f"generations-{fresh._peer.region_id}"]
        finally:
            fresh.close()
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)


def test_two_nodes_share_one_peer_region_through_the_index(device: str, runtime_dir: str, namespace: bytes,
                                                          redis_server: RedisServer) -> None:
    def cfg(node: str) -> PofConfig:
        return PofConfig.from_mapping({"node_id": node, "index_url": redis_server.url,
                                       "runtime_dir": runtime_dir, "heartbeat_s": 0.05, "node_ttl_s": 2.0,
                                       "tiers": {"peer_hbm": {"device": device, "size": "1MiB", "partitions": 2}}})

    a, b = Pool(cfg("a"), SPEC, namespace), Pool(cfg("b"), SPEC, namespace)
    try:
        keys = a.keys_for(np.arange(16 * 5))
        a.store([(k, content(k)) for k in keys]).result()
        deadline = time.monotonic() + 10
        while b.lookup(keys).pages < 5:
            assert time.monotonic() < deadline, "b never saw a's pages"
            time.sleep(0.05)
        lk = b.lookup(keys)
        assert {s.node for s in lk.sources} == {"a"} and lk.per_tier() == {"peer_hbm": 5}
        bufs = [np.zeros(SPEC.page_bytes, np.uint8) for _ in range(5)]
        h = b.load(keys, lk.sources, bufs)
        assert h.wait(10) and h.failed == {}
        assert all(exact(buf, k) for buf, k in zip(bufs, keys, strict=True))
    finally:
        b.close()
        a.close()


def test_pof_bench_hbm_moves_pages_both_ways_on_cpu_tensors(capsys: pytest.CaptureFixture[str]) -> None:
    """``pof bench hbm`` (what ci/gpu_check.sh measures on GPUs), on this host's CPU tensors."""
    from pof_connector.cli import main

    assert main(["bench", "hbm", "--json", "--device", "cpu", "--peer", "cpu", "--pages", "2", "--layers", "2",
                 "--segment-bytes", "64KiB", "--min-seconds", "0.01"]) == 0
    result = json.loads(capsys.readouterr().out)      # stdout is the JSON alone (progress: stderr)
    assert set(result["rows"]) == {"peer_read_to_device", "peer_read_many_to_device", "peer_read_to_host",
                                   "peer_write_from_host", "host_tier_to_device", "host_tier_dma_verify"}
    assert result["ratio_batched"] == result["rows"]["peer_read_many_to_device"]["ratio"]
    assert result["raw_gbps"]["checksum_host"] > 0 and result["raw_gbps"]["checksum_device"] > 0
    assert all(row["pof_gbps"] > 0 and row["raw_gbps"] > 0 for row in result["rows"].values())
    assert result["page_bytes"] > 2 * 64 * 1024 and result["peer_is_other_gpu"] is False
