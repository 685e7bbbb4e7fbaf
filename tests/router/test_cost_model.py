"""The TTFT estimate: what a node holds, its queue and the tier bandwidths decide the order."""

from __future__ import annotations

import pytest

from pof_connector.router.cost_model import Candidate, CostModel
from pof_connector.router.router_config import CostConfig

CFG = CostConfig(prefill_s_per_token=1e-3, request_overhead_s=0.0, decode_s_per_running=0.01,
                 tier_gbps={"cpu_dram": 10.0, "cxl": 5.0, "remote": 1.0})
KV = 100_000.0          # bytes per token: 100 MB for 1,000 tokens


def test_recompute_engine_and_pool() -> None:
    m = CostModel(CFG)
    cold = m.estimate(Candidate("a", 1000))
    assert cold.recompute_tokens == 1000 and cold.ttft_s == pytest.approx(1.0)
    hot = m.estimate(Candidate("a", 1000, engine_tokens=1000))
    assert hot.recompute_tokens == 1 and hot.fetch_tokens == 0          # the last token is always computed
    pooled = m.estimate(Candidate("a", 1000, usable={"cpu_dram": 896}, bytes_per_token=KV))
    assert pooled.recompute_tokens == 104 and pooled.fetch_tokens == 896
    assert pooled.fetch_s == pytest.approx(896 * KV / 10e9)
    assert hot.ttft_s < pooled.ttft_s < cold.ttft_s
    # only what the engine lacks is fetched, and a slower tier costs more
    both = m.estimate(Candidate("a", 1000, engine_tokens=512, usable={"cpu_dram": 896}, bytes_per_token=KV))
    assert both.fetch_tokens == 384
    cxl = m.estimate(Candidate("a", 1000, usable={"cxl": 896}, bytes_per_token=KV))
    remote = m.estimate(Candidate("a", 1000, usable={"elsewhere": 896}, bytes_per_token=KV))   # unknown: remote
    assert pooled.fetch_s < cxl.fetch_s < remote.fetch_s == pytest.approx(896 * KV / 1e9)


def test_queue_turns_the_choice() -> None:
    m = CostModel(CFG)
    holder = Candidate("a", 3000, engine_tokens=2944, running=4, queued_tokens=0)
    other = Candidate("b", 3000)
    assert m.estimate(holder).ttft_s < m.estimate(other).ttft_s
    busy = Candidate("a", 3000, engine_tokens=2944, running=8, queued_tokens=6000)
    assert m.estimate(busy).ttft_s > m.estimate(other).ttft_s         # a hot node sheds load...
    spill = Candidate("b", 3000, usable={"cxl": 2944}, bytes_per_token=KV)
    assert m.estimate(spill).ttft_s < m.estimate(other).ttft_s        # ...to a node that loads it from the pool


def test_learns_prefill_speed_within_bounds() -> None:
    m = CostModel(CFG)
    est = m.estimate(Candidate("a", 1000))
    for _ in range(30):
        m.observe(est, 0.5, running=0)            # the real speed is 0.5 ms per token
    assert m.s_per_token == pytest.approx(5e-4, rel=0.05)
    before = m.s_per_token
    m.observe(est, 100.0, running=0)              # one outlier moves it at most 2x * learning rate
    assert m.s_per_token <= before * 1.2 + 1e-12
    m.observe(m.estimate(Candidate("a", 10)), 9.0, running=0)   # too few tokens to learn from
    frozen = CostModel(CostConfig(prefill_s_per_token=1e-3, learn=False))
    frozen.observe(est, 0.1, running=0)
    assert frozen.s_per_token == 1e-3
