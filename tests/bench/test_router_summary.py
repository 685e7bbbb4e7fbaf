"""`pof bench router`'s reading of `pof router`'s answer headers (its own time, per stage, and
its choices); a stock router's answers carry none, and get no routing summary."""

from __future__ import annotations

import pytest

from pof_connector.bench import BenchError
from pof_connector.bench.router import routing_summary, run


def test_summary_of_pof_router_headers() -> None:
    headers = [{"x-pof-router-overhead": f"{0.001 * (i + 1):.6f}", "x-pof-backend": "n0" if i % 4 else "n1",
                "x-pof-route-reason": "load-balanced" if i % 2 else "prefix-holder",
                "x-pof-router-stages": f"parse=0.0001,lookup={0.0002 * (i + 1):.4f}",
                "x-pof-estimated-ttft": "0.0500"} for i in range(100)]
    ttfts = [0.04] * 100
    s = routing_summary(headers, ttfts)
    assert s["overhead_p50_ms"] == 50.0 and s["overhead_p99_ms"] == 99.0
    assert s["stages_p50_ms"] == {"parse": 0.1, "lookup": 10.0} and s["stages_p99_ms"]["lookup"] == 19.8
    assert s["backends"] == {"n1": 25, "n0": 75}
    assert s["route_reasons"] == {"prefix-holder": 50, "load-balanced": 50}
    assert s["estimate_minus_ttft_mean_s"] == 0.01 and s["estimate_abs_error_mean_s"] == 0.01


def test_a_stock_router_has_no_summary() -> None:
    assert routing_summary([{"content-type": "text/event-stream"}] * 3, [0.1] * 3) == {}


def test_an_unknown_workload_stops_before_anything_starts() -> None:
    with pytest.raises(BenchError, match="allowed: cheap, dear"):
        run(workloads=["cheap", "huge"], overrides={}, seed=1, progress=print)
