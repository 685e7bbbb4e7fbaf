"""Every labelled pool counter is exported by the engines' metrics endpoints with its label."""

from __future__ import annotations

import re
from pathlib import Path

from pof_connector.metrics import COUNTER_LABELS, COUNTERS

SOURCE = Path(__file__).resolve().parent.parent / "pof_connector"


def test_each_counter_described_by_a_label_has_that_label_exported() -> None:
    described = {name for name, text in COUNTERS.items() if re.search(r"\bby (tier|reason|operation|hook)\b", text)}
    assert described - {"index_restarts"} <= set(COUNTER_LABELS)
    assert set(COUNTER_LABELS) <= set(COUNTERS)


def test_each_counter_is_counted_with_the_label_it_is_exported_with() -> None:
    calls = re.compile(r'stats\.add\("(\w+)"[^)]*?\b(tier|reason|op|hook)=')
    seen = set()
    for path in SOURCE.rglob("*.py"):
        for name, label in calls.findall(path.read_text()):
            seen.add(name)
            assert label in COUNTER_LABELS.get(name, "").split(","), f"{path.name}: {name} counted by {label}"
    assert {"spilled_pages", "spill_failures", "demoted_pages", "load_failures"} <= seen


def test_tier_gauges_read_the_tiers_as_they_are() -> None:
    """What the vLLM adapter exports as ``vllm:pof_tier_used_bytes`` / ``..._capacity_bytes``:
    the slots a tier holds pages in, read when asked (not at the last heartbeat)."""
    import numpy as np

    from pof_connector.metrics import GAUGES, tier_gauges
    from pof_connector.pages.keys import PageKey
    from pof_connector.pages.layout import PageSpec
    from pof_connector.tiers.cpu_dram import CpuDramTier

    spec = PageSpec(num_layers=2, segment_bytes=1024, page_tokens=4)
    tier = CpuDramTier(spec, 3 * spec.page_bytes + 1024)
    empty = tier_gauges([tier])
    assert set(empty) == {f"{name}{{tier=cpu_dram}}" for name in GAUGES}
    assert empty["tier_used_bytes{tier=cpu_dram}"] == 0
    assert empty["tier_capacity_bytes{tier=cpu_dram}"] == tier.capacity_slots * tier.slot_bytes > 0
    key = PageKey(bytes(range(16)), bytes(range(32)))
    got = tier.prepare_store(key)
    assert got is not None
    tier.write(got[0], key, [np.zeros(spec.segment_bytes, dtype=np.uint8)] * spec.num_layers)
    tier.complete_store(key, True)
    assert tier_gauges([tier])["tier_used_bytes{tier=cpu_dram}"] == tier.slot_bytes
