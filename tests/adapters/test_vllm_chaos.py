"""`pof bench chaos --quick` as CI runs it: two pooled vLLM servers, a memory node, a real index
and `pof router`, every fault kind once while traffic runs, each answer checked against a vLLM
server without the connector. Nothing here is faked."""

from __future__ import annotations

import os

import pytest

from pof_connector.bench import chaos
from pof_connector.bench.chaos_faults import KINDS
from pof_connector.bench.vllm_server import build_model
from pof_connector.fabric import nixl_installed

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow,
              pytest.mark.skipif(not nixl_installed(), reason="NIXL is not installed (ci/vllm_venv.sh installs it)")]


def test_quick_chaos_run_gives_no_wrong_answer_loses_no_request_and_crashes_nothing() -> None:
    result = chaos.run(minutes=3, seed=11, rounds=1, model=str(build_model("tiny")), max_requests=1_000_000,
                       progress=print)
    assert result["wrong_answers"] == 0, (result["differing"], result["kept_logs"])
    # The servers' own audit (a tenth of their pool hits recomputed and compared) found no wrong page.
    assert result["audit_mismatches"] == 0, (result["audited_pages"], result["pool_counters"])
    assert result["unplanned_crashes"] == 0, result["crashes"]
    requests = result["requests"]
    assert requests["failed"] == 0, result["failures"]
    assert requests["answered"] > 100
    expected = dict.fromkeys(KINDS, 1)
    if os.geteuid() != 0:                         # no network namespace: the link cut says why it did not run
        expected["link_cut"] = 0
        assert "root" in result["faults_skipped"]["link_cut"]
    assert result["faults"] == expected
    counters = result["pool_counters"]
    # The pool served prefixes (not only the engines' own caches) and spilled to the memory node.
    assert counters["vllm:external_prefix_cache_hits_total"] > 0, counters
    assert counters.get("vllm:pof_spilled_pages_total", 0) > 0, counters
