from __future__ import annotations

import numpy as np
import pytest

from pof_connector.config import ConfigError
from pof_connector.pages import page_sum
from pof_connector.pages.keys import PageKey
from pof_connector.pages.layout import PageError, PageSpec
from pof_connector.tiers import CpuDramTier


def key(i: int) -> PageKey:
    return PageKey(bytes(16), i.to_bytes(32, "little"))


def layers_for(spec: PageSpec, i: int) -> list[np.ndarray]:
    rng = np.random.default_rng(i)
    return [rng.integers(0, 255, spec.segment_bytes, dtype=np.uint8) for _ in range(spec.num_layers)]


def store(tier: CpuDramTier, spec: PageSpec, i: int) -> PageKey | None:
    got = tier.prepare_store(key(i))
    assert got is not None
    ref, evicted = got
    tier.write(ref, key(i), layers_for(spec, i))
    tier.complete_store(key(i), ok=True)
    return evicted


def test_write_read_evict_reuse(spec: PageSpec) -> None:
    tier = CpuDramTier(spec, 4 * spec.page_bytes + 100)
    assert tier.capacity_slots == 4
    for i in range(4):
        assert store(tier, spec, i) is None
    out = np.empty(spec.page_bytes, np.uint8)
    old = tier.find(key(0))
    assert old is not None
    tier.read(old, key(0), out)
    for layer, data in enumerate(layers_for(spec, 0)):
        assert bytes(spec.segment(memoryview(out), layer)) == data.tobytes()
    assert store(tier, spec, 4) == key(1)        # 0 was touched by find: 1 is the LRU page
    # The evicted page's slot now holds key 4 with a newer generation: the old ref is refused.
    stale = next(r for k, r in tier.stored() if k == key(4))
    with pytest.raises(PageError) as e:
        tier.read(type(stale)(stale.slot, stale.generation - 1), key(1), out)
    assert e.value.reason in ("stale_generation", "wrong_key")


def test_layer_by_layer_read(spec: PageSpec) -> None:
    tier = CpuDramTier(spec, 2 * spec.page_bytes)
    store(tier, spec, 9)
    ref = tier.find(key(9))
    assert ref is not None
    page = np.empty(spec.page_bytes, np.uint8)
    header = tier.read_header(ref, key(9), page)
    expected = layers_for(spec, 9)
    for layer in reversed(range(spec.num_layers)):      # any order, one segment at a time
        seg = tier.segment_view(ref, layer).copy()
        tier.check_segment(ref, header, layer, page_sum.checksum(seg, header.sum_seed))
        assert (seg == expected[layer]).all()
    tier.remove(key(9))
    with pytest.raises(PageError):
        tier.check_segment(ref, header, 0, page_sum.checksum(expected[0], header.sum_seed))


def test_too_small_names_key(spec: PageSpec) -> None:
    with pytest.raises(ConfigError, match=r"tiers\.cpu_dram\.size"):
        CpuDramTier(spec, 100)


def test_lend_bumps_generation_and_take_back_invalidates(spec: PageSpec) -> None:
    tier = CpuDramTier(spec, 2 * spec.page_bytes + 128)
    (ref,) = tier.lend(1)
    assert ref.generation == 1 and tier.live_generation(ref.slot) == 0 and tier.free_slots == 1
    tier.write(ref, key(7), layers_for(spec, 7))      # what a spilling writer's NIXL WRITEs amount to
    out = np.zeros(spec.page_bytes, np.uint8)
    tier.read(ref, key(7), out)
    assert tier.take_back(ref.slot) and tier.free_slots == 2
    with pytest.raises(PageError):                    # reclaimed: a reader following the index misses
        tier.read(ref, key(7), out)
    assert not tier.take_back(ref.slot)               # not lent any more: our own slots are untouched


class _StoreBetweenFreeAndInvalidate(CpuDramTier):
    """Runs a store at the moment ``remove`` invalidates a slot: the store thread getting the CPU
    while a reader thread drops a corrupt page (``Reads.drop_if_corrupt``)."""

    def __init__(self, spec: PageSpec, size: int) -> None:
        super().__init__(spec, size)
        self.racing: int | None = None

    def _set_live_generation(self, slot: int, generation: int) -> None:
        if self.racing is not None and generation == 0:
            i, self.racing = self.racing, None
            store(self, self.spec, i)
        super()._set_live_generation(slot, generation)


def test_remove_invalidates_before_the_slot_can_be_reused(spec: PageSpec) -> None:
    tier = _StoreBetweenFreeAndInvalidate(spec, 2 * spec.page_bytes + 128)
    store(tier, spec, 0)
    tier.racing = 1
    assert tier.remove(key(0)) is not None
    assert tier.racing is None                       # the racing store ran
    ref = tier.find(key(1))
    assert ref is not None
    out = np.zeros(spec.page_bytes, np.uint8)
    tier.read(ref, key(1), out)                      # the fresh page was not zeroed under its writer
    for layer, data in enumerate(layers_for(spec, 1)):
        assert bytes(spec.segment(memoryview(out), layer)) == data.tobytes()


def test_a_removed_page_stays_readable_while_pinned(spec: PageSpec) -> None:
    tier = CpuDramTier(spec, 2 * spec.page_bytes + 128)
    store(tier, spec, 0)
    store(tier, spec, 1)
    ref = tier.find(key(0), pin=True)
    assert ref is not None
    page = np.zeros(spec.page_bytes, np.uint8)
    header = tier.read_header(ref, key(0), page)
    assert tier.remove(key(0)) == ref and tier.find(key(0)) is None
    assert store(tier, spec, 2) == key(1)            # room comes from the unpinned page
    for layer, data in enumerate(layers_for(spec, 0)):
        assert (tier.segment_view(ref, layer) == data).all()
        tier.check_segment(ref, header, layer, page_sum.checksum(tier.segment_view(ref, layer).copy(), header.sum_seed))
    tier.unpin(ref.slot)                             # last reader done: invalidated and freed
    with pytest.raises(PageError):
        tier.check_segment(ref, header, 0, page_sum.checksum(layers_for(spec, 0)[0], header.sum_seed))
    assert tier.free_slots == 1
