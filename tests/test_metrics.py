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
