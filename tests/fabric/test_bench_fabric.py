"""``pof bench fabric --json`` with tiny sizes: the JSON shape, and that both paths fetched
byte-exact pages (no timing assertion: CI machines are shared)."""

from __future__ import annotations

import json

import pytest

from pof_connector.cli import main
from pof_connector.fabric import nixl_installed

pytestmark = [pytest.mark.nixl,
              pytest.mark.skipif(not nixl_installed(),
                                 reason="NIXL is not installed (pip install --no-deps nixl-cu13==1.5.1)")]


def test_bench_fabric_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "fabric", "--json", "--layers", "3", "--segment-bytes", "4KiB", "--pages", "6",
                 "--batch", "4", "--iterations", "3", "--latency-samples", "5"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["bench"] == "fabric" and result["ratio"] > 0 and result["ratio_with_copy_out"] > 0
    for path in ("pof", "pof_copy_out", "raw"):
        row = result[path]
        assert set(row) == {"gbps", "pages_per_s", "batch_ms_p50", "latency_ms_p50", "latency_ms_p99"}
        assert row["gbps"] > 0 and row["pages_per_s"] > 0 and 0 < row["latency_ms_p50"] <= row["latency_ms_p99"]
    # warm-up batch + 3 batches of 4 + 5 single pages, per path, every one compared byte for byte
    assert result["verified_pages"] == {path: 4 + 3 * 4 + 5 for path in ("pof", "pof_copy_out", "raw")}
    assert result["failed_pages"] == 0 and set(result["wrong_pages"].values()) == {0} and result["exact"]
    assert result["page_bytes"] > 3 * 4096 and result["tls"] == "tcp"


def test_bench_fabric_rejects_a_batch_larger_than_the_pages(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "fabric", "--json", "--pages", "2", "--batch", "4"]) == 1
    assert "--batch" in capsys.readouterr().err
