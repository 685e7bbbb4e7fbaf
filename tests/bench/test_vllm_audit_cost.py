"""``pof bench vllm --audit-rates``: the rows it reports from the timed requests of each server."""

from __future__ import annotations

import argparse

import pytest

from pof_connector.bench.cli import _rates
from pof_connector.bench.vllm import BenchError, _audit_cost


def test_rates_are_fractions_of_hits() -> None:
    assert _rates("0.01,0.1") == [0.01, 0.1]
    for bad in ("0", "1.5", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            _rates(bad)


def test_audited_requests_are_those_the_pool_served_nothing_and_their_cost_is_the_mean() -> None:
    pof = {"ttft": [0.1, 0.1, 0.1, 0.1], "hits": [896.0] * 4, "answers": [[1], [2]]}
    audited = {"ttft": [0.1, 0.5, 0.1, 0.1], "hits": [896.0, 0.0, 896.0, 896.0], "answers": [[1], [2]]}
    got = _audit_cost({"pof": pof, "recompute": {"answers": [[1], [2]]}}, {"pof_audit_0.1": audited})
    assert got["rows"]["0"]["audited_requests"] == 0
    assert got["rows"]["0.1"] == {"mean_ttft_s": 0.2, "median_ttft_s": 0.1, "audited_requests": 1, "requests": 4,
                                  "mean_vs_no_audit": 2.0}
    with pytest.raises(BenchError):
        _audit_cost({"pof": pof, "recompute": {"answers": [[1], [3]]}}, {"pof_audit_0.1": audited})
