"""``python -m pof_connector.bench.vllm_load --device DEVICE``: the GPU path's bench runs its steps
on CPU tensors here (``ci/gpu_check.sh`` runs it on ``cuda``): every landed byte equal to the saved
blocks, a corrupted page refused, every figure present."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.torch


@pytest.mark.parametrize("tier", ["cpu_dram", "peer_hbm"])
def test_the_device_bench_moves_every_byte_and_refuses_a_corrupted_page(capsys: pytest.CaptureFixture[str],
                                                                        tier: str) -> None:
    from pof_connector.bench.vllm_load import main

    assert main(["--device", "cpu", "--pages", "2", "3", "--layers", "3", "--kv-heads", "2", "--head-dim", "32",
                 "--repeat", "1", "--layout", "BLNHC", "--tier", tier, "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["bench"] == "vllm_load_device" and result["layout"] == "BLNHC" and result["device"] == "cpu"
    assert result["tier"] == tier
    assert [r["pages"] for r in result["rows"]] == [2, 3]
    for row in result["rows"]:
        assert row["landed_equal"] is True and row["corrupt_refused"] is True
        assert row["corrupt_blocks_untouched"] is True
        assert row["load_baseline"] == ("raw_d2d_s" if tier == "peer_hbm" else "raw_h2d_s")
        assert row["bytes"] == row["pages"] * 3 * 16 * 2 * 2 * 32 * 2
        for key in ("load_s", "raw_h2d_s", "save_s", "raw_d2h_s", "raw_d2d_s", "store_s", "load_ratio", "save_ratio"):
            assert isinstance(row[key], float) and row[key] >= 0, key     # a few KiB on a CPU can round to 0
        assert row["engine_wait_s"] is None           # only a GPU has the engine's stream to time
    assert result["goals"] == {"load_ratio": 0.8, "save_ratio": 0.7}
