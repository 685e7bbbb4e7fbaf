"""``pof bench vllm``'s figures from timed runs (no server): the floor pairs with each load."""

from __future__ import annotations

from pathlib import Path

import pytest

from pof_connector.bench import BenchError
from pof_connector.bench import vllm as bench_vllm


def results() -> dict[str, dict[str, list[object]]]:
    answers: list[object] = [[7], [8]]
    return {
        "recompute": {"ttft": [20.0, 22.0], "answers": answers, "hits": [0, 0], "cold": [], "engine_hit": []},
        # two prompts x two repeats: each load, then the same prompt as an engine prefix-cache hit
        "pof": {"ttft": [1.00, 1.30, 1.10, 1.20], "engine_hit": [0.98, 1.29, 1.07, 1.18], "cold": [15.0, 16.0],
                "answers": answers, "hits": [5888] * 4, "loaded_bytes": [100_000_000], "memcpy_s": [0.01],
                "memcpy_threads_s": [0.005], "wait_s": [0.012]},
        "example": {"ttft": [1.2, 1.3, 1.25, 1.35], "engine_hit": [1, 1, 1, 1], "cold": [15.0, 16.0],
                    "answers": answers, "hits": [5888] * 4},
    }


def test_the_paired_figure_is_the_median_of_each_load_minus_its_own_floor() -> None:
    out = bench_vllm._summary(results(), 6000, 2, Path("m"), "float32", 128)
    assert out["pof_above_floor_paired_s"] == pytest.approx(0.02, abs=1e-4)    # diffs .02 .01 .03 .02
    assert out["floor_s"] == pytest.approx(1.125)                               # medians keep their meaning
    assert out["pof_s"] == pytest.approx(1.15)
    assert out["overhead_ratio"] == pytest.approx(2.5)
    assert out["overhead_ratio_vs_memcpy_threads"] == pytest.approx(5.0)
    assert out["load_wait_s"] == pytest.approx(0.012) and out["load_wait_ratio"] == pytest.approx(1.2)
    assert out["ttft_runs_s"]["engine_prefix_cache"] == [0.98, 1.29, 1.07, 1.18]


def test_each_connector_is_read_against_its_own_servers_floor() -> None:
    """ExampleConnector's overhead comes from its own server's hits, timed in the same moments as
    its loads, not from the pof server's run minutes earlier (this host drifts between them)."""
    r = results()
    r["example"]["engine_hit"] = [1.20, 1.26, 1.22, 1.30]          # a slower stretch than pof's
    out = bench_vllm._summary(r, 6000, 2, Path("m"), "float32", 128)
    assert out["example_floor_s"] == pytest.approx(1.24)
    assert out["load_overhead_s"]["example"] == pytest.approx(1.275 - 1.24)
    assert out["load_overhead_s"]["pof"] == pytest.approx(1.15 - 1.125)
    assert out["pof_vs_example_above_floor"] == pytest.approx(0.025 / 0.035, abs=1e-3)
    assert out["ttft_runs_s"]["example_engine_prefix_cache"] == [1.20, 1.26, 1.22, 1.30]
    r["example"]["engine_hit"] = [1.3] * 4                           # no time above its floor: no ratio
    assert bench_vllm._summary(r, 6000, 2, Path("m"), "float32", 128)["pof_vs_example_above_floor"] is None


def test_answers_that_differ_from_the_recompute_fail_the_bench() -> None:
    r = results()
    r["pof"]["answers"] = [[7], [9]]
    with pytest.raises(BenchError, match="pof's greedy answers differ"):
        bench_vllm._summary(r, 6000, 2, Path("m"), "float32", 128)


def test_a_copy_split_over_threads_moves_every_byte() -> None:
    """The threaded memcpy baseline copies all of its bytes (a part left out would flatter it)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from pof_connector.bench.vllm_load import timed_copy

    src = np.arange(1_000_003, dtype=np.uint8)
    dst = np.zeros_like(src)
    with ThreadPoolExecutor(3) as pool:
        assert timed_copy(dst, src, pool, 3) > 0
    assert np.array_equal(dst, src)
