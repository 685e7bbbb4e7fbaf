"""Two OS processes share one CXL region (a file under /dev/shm standing in for /dev/dax)."""

from __future__ import annotations

import multiprocessing as mp
import os
import stat
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from pof_connector.config import ConfigError, TierConfig
from pof_connector.pages.keys import PageKey
from pof_connector.pages.layout import PageError, PageSpec
from pof_connector.tiers import CxlTier, SlotRef

SPEC = PageSpec(num_layers=4, segment_bytes=4096, page_tokens=16)


def key(i: int) -> PageKey:
    return PageKey(bytes(16), i.to_bytes(32, "little"))


def content(k: PageKey) -> list[np.ndarray]:
    rng = np.random.default_rng(int.from_bytes(k.digest[:8], "little"))
    return [rng.integers(0, 255, SPEC.segment_bytes, dtype=np.uint8) for _ in range(SPEC.num_layers)]


def config(path: str, partitions: int = 4) -> TierConfig:
    return TierConfig("cxl", 2 << 20, path=path, partitions=partitions)


def reader_check(path: str, runtime_dir: str, refs: list[tuple[int, int, int]]) -> list[str]:
    """In another process: read each (key index, slot, generation); 'ok' only when byte-exact."""
    tier = CxlTier(SPEC, config(path), runtime_dir)
    out = []
    buf = np.empty(SPEC.page_bytes, np.uint8)
    try:
        for i, slot, gen in refs:
            try:
                tier.read(SlotRef(slot, gen), key(i), buf)
            except PageError as e:
                out.append(e.reason)
                continue
            same = all(bytes(SPEC.segment(memoryview(buf), layer)) == data.tobytes()
                       for layer, data in enumerate(content(key(i))))
            out.append("ok" if same else "WRONG")
    finally:
        tier.close()
    return out


def reader_race(path: str, runtime_dir: str, board: dict[str, tuple[int, int, int]], seconds: float) -> dict[str, int]:
    """Read whatever the writer last announced while it keeps rewriting the same slots."""
    tier = CxlTier(SPEC, config(path), runtime_dir)
    counts = {"ok": 0, "rejected": 0, "WRONG": 0}
    buf = np.empty(SPEC.page_bytes, np.uint8)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            for i, slot, gen in list(board.values()):
                try:
                    tier.read(SlotRef(slot, gen), key(i), buf)
                except PageError:
                    counts["rejected"] += 1
                    continue
                same = all(bytes(SPEC.segment(memoryview(buf), layer)) == data.tobytes()
                           for layer, data in enumerate(content(key(i))))
                counts["ok" if same else "WRONG"] += 1
    finally:
        tier.close()
    return counts


def write(tier: CxlTier, i: int) -> tuple[int, int, int]:
    got = tier.prepare_store(key(i))
    assert got is not None
    ref, _ = got
    tier.write(ref, key(i), content(key(i)))
    tier.complete_store(key(i), ok=True)
    return i, ref.slot, ref.generation


def test_two_processes_share_pages_and_reject_stale(shm_path: str, runtime_dir: str) -> None:
    writer = CxlTier(SPEC, config(shm_path), runtime_dir)
    try:
        n = writer.capacity_slots
        refs = [write(writer, i) for i in range(n)]
        with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
            assert ex.submit(reader_check, shm_path, runtime_dir, refs).result() == ["ok"] * n
            # Evict and reuse every slot of the writer's partition with other pages.
            for i in range(n, 2 * n):
                write(writer, i)
            reasons = ex.submit(reader_check, shm_path, runtime_dir, refs).result()
        assert set(reasons) <= {"stale_generation", "wrong_key", "bad_header"} and "ok" not in reasons
    finally:
        writer.close()


def test_reader_never_returns_a_torn_or_reused_page(shm_path: str, runtime_dir: str) -> None:
    writer = CxlTier(SPEC, config(shm_path), runtime_dir)
    slots = 4
    try:
        with mp.get_context("spawn").Manager() as manager:
            board = manager.dict()
            for i in range(slots):
                board[str(i)] = write(writer, i)
            with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
                fut = ex.submit(reader_race, shm_path, runtime_dir, board, 3.0)
                i = slots
                while not fut.done():
                    # Evict the LRU page (one of the announced ones) and rewrite its slot.
                    victim = writer.lru_victim()
                    assert victim is not None
                    writer.remove(victim[0])
                    board[str(i % slots)] = write(writer, i)
                    i += 1
                counts = fut.result()
        assert counts["WRONG"] == 0
        assert counts["ok"] > 0 and counts["rejected"] > 0, counts
    finally:
        writer.close()


def test_partitions_are_exclusive_and_geometry_checked(shm_path: str, runtime_dir: str) -> None:
    a = CxlTier(SPEC, TierConfig("cxl", 2 << 20, path=shm_path, partitions=2), runtime_dir)
    b = CxlTier(SPEC, TierConfig("cxl", 2 << 20, path=shm_path, partitions=2), runtime_dir)
    try:
        assert {a.partition, b.partition} == {0, 1} and a.domain == b.domain
        with pytest.raises(ConfigError, match=r"tiers\.cxl\.partition"):
            CxlTier(SPEC, TierConfig("cxl", 2 << 20, path=shm_path, partitions=2), runtime_dir)
        with pytest.raises(ConfigError, match=r"tiers\.cxl\.partitions"):
            CxlTier(SPEC, TierConfig("cxl", 2 << 20, path=shm_path, partitions=4), runtime_dir)
        big = PageSpec(num_layers=4, segment_bytes=1 << 16, page_tokens=16)
        with pytest.raises(ConfigError, match="too small"):
            CxlTier(big, TierConfig("cxl", 2 << 20, path=shm_path, partitions=2), runtime_dir)
    finally:
        a.close()
        b.close()
    c = CxlTier(SPEC, TierConfig("cxl", 2 << 20, path=shm_path, partitions=2), runtime_dir)   # a freed partition
    c.close()


def test_writers_with_different_runtime_dirs_still_get_their_own_partition(shm_path: str, tmp_path: Path) -> None:
    """Two engines on one host configured with different runtime_dirs must not both write
    partition 0 of one region: the partition locks live next to the region file."""
    cfg = TierConfig("cxl", 2 << 20, path=shm_path, partitions=2)
    a = CxlTier(SPEC, cfg, str(tmp_path / "rt-a"))
    b = CxlTier(SPEC, cfg, str(tmp_path / "rt-b"))
    try:
        assert {a.partition, b.partition} == {0, 1}
    finally:
        a.close()
        b.close()


def test_writers_of_one_device_with_different_runtime_dirs_get_their_own_partition(shm_path: str,
                                                                                     tmp_path: Path) -> None:
    """A devdax device (no directory next to it to put lock files in): the partition claim must
    not depend on runtime_dir. The device node here has /dev/zero's numbers (mknod), so its memory
    is not shared between the two mappings: only the claim is under test."""
    dev = shm_path + ".dax"
    try:
        os.mknod(dev, stat.S_IFCHR | 0o600, os.makedev(1, 5))
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD")
    cfg = TierConfig("cxl", 2 << 20, path=dev, partitions=2)
    a = CxlTier(SPEC, cfg, str(tmp_path / "rt-a"))
    try:
        b = CxlTier(SPEC, cfg, str(tmp_path / "rt-b"))
        try:
            assert {a.partition, b.partition} == {0, 1}
            with pytest.raises(ConfigError, match=r"tiers\.cxl\.partition"):
                CxlTier(SPEC, cfg, str(tmp_path / "rt-c"))
        finally:
            b.close()
    finally:
        a.close()
    CxlTier(SPEC, cfg, str(tmp_path / "rt-d")).close()        # closing released the claims


def test_two_names_of_one_region_file_share_its_partition_claims(shm_path: str, runtime_dir: str) -> None:
    """A region reached through two paths (a hard link, a bind mount) is one region: one claim."""
    other = shm_path + ".link"
    a = CxlTier(SPEC, TierConfig("cxl", 2 << 20, path=shm_path, partitions=2), runtime_dir)
    try:
        os.link(shm_path, other)
        b = CxlTier(SPEC, TierConfig("cxl", 2 << 20, path=other, partitions=2), runtime_dir)
        try:
            assert a.domain == b.domain and {a.partition, b.partition} == {0, 1}
        finally:
            b.close()
    finally:
        a.close()


def test_numa_binding(shm_path: str, runtime_dir: str) -> None:
    tier = CxlTier(SPEC, TierConfig("cxl", 2 << 20, path=shm_path, numa_node=0), runtime_dir)
    tier.close()
    with pytest.raises(ConfigError, match="numa_node"):
        CxlTier(SPEC, TierConfig("cxl", 2 << 20, path=shm_path + "2", numa_node=999), runtime_dir)
