"""The chaos bench's own parts that run without an engine: its fault schedule, and that its
flipped bytes land in written slots of a real CXL region where a read refuses them."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from pof_connector.bench.chaos_faults import KINDS, flip_live_slots, live_slots, schedule
from pof_connector.bench.chaos_traffic import HitBound
from pof_connector.pages.layout import PageError
from pof_connector.tiers import CxlTier, SlotRef
from tests.tiers.test_cxl import SPEC, config, key, write


def test_every_kind_comes_rounds_times_in_time_order_within_the_run() -> None:
    plan = schedule(seed=5, rounds=3, duration_s=1170, start_s=30)
    assert Counter(kind for _, kind in plan) == dict.fromkeys(KINDS, 3)
    times = [t for t, _ in plan]
    assert times == sorted(times) and times[0] > 30 and times[-1] < 1200
    assert plan == schedule(seed=5, rounds=3, duration_s=1170, start_s=30)       # seeded
    assert plan != schedule(seed=6, rounds=3, duration_s=1170, start_s=30)


def test_flipped_slots_are_written_ones_and_a_read_refuses_them(tmp_path: Path) -> None:
    path = tmp_path / "region"
    tier = CxlTier(SPEC, config(str(path)), str(tmp_path / "rt"))
    try:
        refs = {i: write(tier, i) for i in range(6)}
        assert sorted(live_slots(path)) == sorted(slot for _, slot, _ in refs.values())
        flipped = flip_live_slots(path, random.Random(3), slots=2)
        assert len(flipped) == 2
        buf = np.empty(SPEC.page_bytes, np.uint8)
        for i, slot, gen in refs.values():
            if slot in flipped:
                with pytest.raises(PageError):
                    tier.read(SlotRef(slot, gen), key(i), buf)
            else:
                tier.read(SlotRef(slot, gen), key(i), buf)
    finally:
        tier.close()


def test_the_hit_bound_counts_whole_blocks_an_earlier_prompt_of_the_same_salt_computed() -> None:
    bound = HitBound()
    a = tuple(range(1000))
    assert bound.bound("s", a) == 0
    assert bound.bound("s", a[:900] + (7,) * 100) == 7 * 128      # 900 shared tokens: 7 whole blocks
    assert bound.bound("other", a) == 0                          # another tenant's salt: nothing
    assert bound.bound("s", a[:256]) == 128                      # never the prompt's last token
