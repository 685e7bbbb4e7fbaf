"""Writers of one CXL region trade slots: a writer short of room gets the slots of another's
cold pages, no slot ever has two writers, and no reader accepts a page from a slot that changed
hands (a file under /dev/shm stands in for /dev/dax; readers run in other processes)."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import struct
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest

from pof_connector.config import ConfigError
from pof_connector.tiers import CxlTier
from pof_connector.tiers.cxl import TRADE_FLOOR, TRADE_STEPS
from tests.tiers.test_cxl import SPEC, config, key, reader_check, reader_race, write

LATER = 1000.0
"""Seconds added to the clock a balance sees: every page stored before it has gone unused that long."""


def two(path: str, runtime_dir: str) -> tuple[CxlTier, CxlTier]:
    """Two writers of a region of four partitions (readers in other processes take a third)."""
    return CxlTier(SPEC, config(path), runtime_dir), CxlTier(SPEC, config(path), runtime_dir)


def fill(tier: CxlTier, first: int) -> list[tuple[int, int, int]]:
    return [write(tier, i) for i in range(first, first + tier.capacity_slots)]


def test_a_writer_short_of_room_gets_the_slots_of_anothers_cold_pages(shm_path: str, runtime_dir: str) -> None:
    a, b = two(shm_path, runtime_dir)
    try:
        assert a.trades and b.trades and a.partition != b.partition
        share = a.capacity_slots
        cold = fill(b, 10_000)                       # b's share, all used once
        fill(a, 0)
        write(a, share)                              # a is full: it evicts, and says so
        taker, given, dropped = b.balance(time.monotonic() + LATER)
        step = share // TRADE_STEPS
        assert (taker, given, len(dropped)) == (a.partition, step, step)     # b had no free slot: cold pages went
        assert b.capacity_slots == share - step and a.needs_room()
        assert a.adopt_given() == step and a.adopt_given() == 0
        assert a.capacity_slots == share + step and not a.needs_room()
        assert not (a._owned & b._owned) and len(a._owned | b._owned) == 2 * share
        # a writes its next pages into the given slots, evicting nothing
        fresh = [write(a, i) for i in range(share + 1, share + 1 + step)]
        assert {slot for _, slot, _ in fresh} == {ref.slot for _, ref in dropped}
        gone = {ref.slot for _, ref in dropped}
        kept = [r for r in cold if r[1] not in gone]
        stale = [r for r in cold if r[1] in gone]
        with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
            assert ex.submit(reader_check, shm_path, runtime_dir, fresh + kept).result() == ["ok"] * (step + len(kept))
            reasons = ex.submit(reader_check, shm_path, runtime_dir, stale).result()
        assert "ok" not in reasons and "WRONG" not in reasons and len(reasons) == step
        assert all(b.find(key(i)) is None for i, _, _ in stale)
    finally:
        a.close()
        b.close()


def test_pages_used_lately_are_not_given_nor_slots_to_a_writer_that_evicts_nothing(shm_path: str,
                                                                                  runtime_dir: str) -> None:
    a, b = two(shm_path, runtime_dir)
    try:
        fill(b, 10_000)
        fill(a, 0)
        assert b.balance(time.monotonic() + LATER)[1] == 0          # a evicted nothing yet
        write(a, a.capacity_slots)
        assert b.balance()[1] == 0                   # a evicts, but b's pages were used a moment ago
        write(a, a.capacity_slots + 1)
        for i in range(10_000, 10_000 + b.capacity_slots):     # b uses its pages again, after a evicted
            assert b.find(key(i)) is not None
        assert b.balance(time.monotonic() + 0.5)[1] == 0      # still younger than TRADE_MIN_UNUSED_S
        assert a.adopt_given() == 0
    finally:
        a.close()
        b.close()


def test_a_writer_keeps_a_share_of_its_own_and_a_restarted_one_finds_what_it_still_owns(
        shm_path: str, runtime_dir: str) -> None:
    a, b = two(shm_path, runtime_dir)
    try:
        share = a.capacity_slots
        fill(b, 10_000)
        i = 0
        for _ in range(4 * TRADE_STEPS):
            write(a, i)          # a evicts (once its share is full) before each balance
            i += 1
            while a.free_slots:
                write(a, i)
                i += 1
            write(a, i)
            i += 1
            b.balance(time.monotonic() + LATER)
            a.adopt_given()
        assert b.capacity_slots == share // TRADE_FLOOR
        assert a.capacity_slots == 2 * share - share // TRADE_FLOOR
        b.close()
        # b's partition, claimed anew: only the slots it still owns
        again = CxlTier(SPEC, config(shm_path), runtime_dir)
        try:
            assert again.partition == 1 and again.capacity_slots == share // TRADE_FLOOR
        finally:
            again.close()
    finally:
        a.close()
        b.close()


def test_no_reader_accepts_a_page_from_a_slot_that_changed_hands(shm_path: str, runtime_dir: str) -> None:
    """Readers in another process keep reading whatever pages the two writers last announced while
    b gives its slots to a, page by page, and a rewrites them: a reader either gets the page it
    asked for, byte for byte, or rejects it."""
    a, b = two(shm_path, runtime_dir)
    try:
        with mp.get_context("spawn").Manager() as manager:
            board = manager.dict()
            for r in fill(b, 10_000)[:8]:
                board[f"b{r[0]}"] = r
            fill(a, 0)
            i = 100
            with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
                fut = ex.submit(reader_race, shm_path, runtime_dir, board, 3.0)
                while not fut.done():
                    board[f"a{i % 8}"] = write(a, i)
                    i += 1
                    b.balance(time.monotonic() + LATER)
                    a.adopt_given()
                counts = fut.result()
        assert counts["WRONG"] == 0
        assert counts["ok"] > 0 and counts["rejected"] > 0, counts
        assert b.capacity_slots < a.capacity_slots
    finally:
        a.close()
        b.close()


def test_a_region_of_an_unknown_version_is_refused_and_version_1_keeps_fixed_partitions(
        shm_path: str, runtime_dir: str) -> None:
    conf = config(shm_path)
    CxlTier(SPEC, conf, runtime_dir).close()
    with open(shm_path, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", 9))
    with pytest.raises(ConfigError, match=r"tiers\.cxl\.path: .* version 9"):
        CxlTier(SPEC, conf, runtime_dir)
    with open(shm_path, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", 1))
    old = CxlTier(SPEC, conf, runtime_dir)
    try:
        assert not old.trades and old.balance(time.monotonic() + LATER) == (-1, 0, [])
        per = old.capacity_slots
        assert np.array_equal(sorted(old._owned), np.arange(old.partition * per, (old.partition + 1) * per))
    finally:
        old.close()


def test_a_writer_that_does_not_trade_neither_asks_nor_gives(shm_path: str, runtime_dir: str) -> None:
    a = CxlTier(SPEC, config(shm_path), runtime_dir)
    b = CxlTier(SPEC, dataclasses.replace(config(shm_path), trade=False), runtime_dir)
    try:
        assert a.trades and not b.trades
        fill(a, 0)
        fill(b, 10_000)
        write(a, a.capacity_slots)               # a evicts and asks
        write(b, 10_000 + b.capacity_slots)      # b evicts, and does not ask
        assert b.balance(time.monotonic() + LATER) == (-1, 0, [])
        assert a.balance(time.monotonic() + LATER)[1] == 0
        assert a.adopt_given() == 0 and b.adopt_given() == 0
    finally:
        a.close()
        b.close()


def test_a_writer_that_makes_room_by_evicting_a_page_asks_as_one_that_evicts_inside_a_store(
        shm_path: str, runtime_dir: str) -> None:
    a, b = two(shm_path, runtime_dir)
    try:
        fill(b, 10_000)
        fill(a, 0)
        assert b.balance(time.monotonic() + LATER)[1] == 0          # a evicted nothing yet
        assert a.evict(key(0)) is not None and a.find(key(0)) is None     # the Placement path: room first
        assert a.evict(key(0)) is None                              # gone already
        taker, given, _ = b.balance(time.monotonic() + LATER)
        assert (taker, given) == (a.partition, a.first_share // TRADE_STEPS)
    finally:
        a.close()
        b.close()
