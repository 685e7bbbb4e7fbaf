"""The TTFT estimate: what a node holds, its queue and the tier bandwidths decide the order, and
the coefficients follow the hardware."""

from __future__ import annotations

import random

import pytest

from pof_connector.router.cost_model import Candidate, CostModel
from pof_connector.router.router_config import CostConfig

CFG = CostConfig(prefill_s_per_token=1e-3, request_overhead_s=0.01, decode_s_per_running=0.01,
                 tier_gbps={"cpu_dram": 10.0, "cxl": 5.0, "remote": 1.0})
KV = 100_000.0          # bytes per token: 100 MB for 1,000 tokens


def test_recompute_engine_and_pool() -> None:
    m = CostModel(CFG)
    cold = m.estimate(Candidate("a", 1000))
    assert cold.recompute_tokens == 1000 and cold.ttft_s == pytest.approx(1.01)
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
    holder = Candidate("a", 3000, engine_tokens=2944, running=4)
    other = Candidate("b", 3000)
    assert m.estimate(holder).ttft_s < m.estimate(other).ttft_s
    busy = Candidate("a", 3000, engine_tokens=2944, running=8, waiting=3, waiting_tokens=6000)
    assert m.estimate(busy).ttft_s > m.estimate(other).ttft_s         # a hot node sheds load...
    spill = Candidate("b", 3000, usable={"cxl": 2944}, bytes_per_token=KV)
    assert m.estimate(spill).ttft_s < m.estimate(other).ttft_s        # ...to a node that loads it from the pool


def test_learns_the_machine_it_runs_on() -> None:
    """Requests cost 0.15 s each on this pretend machine, 0.5 ms per token, 20 ms per decoding
    neighbour, and loads 30x the configured bandwidth's time: far from the start values."""
    truth = (0.15, 5e-4, 0.02, 30.0)
    rnd = random.Random(1)
    m = CostModel(CFG)
    for _ in range(300):
        waiting = rnd.randrange(0, 3)
        c = Candidate("a", rnd.randrange(100, 4000), engine_tokens=rnd.choice([0, 1024, 2048]),
                      usable=rnd.choice([{}, {"cxl": 3000}]), bytes_per_token=KV, running=waiting + rnd.randrange(4),
                      waiting=waiting, waiting_tokens=rnd.randrange(0, 3000))
        est = m.estimate(c)
        w, k, d, f = est.features
        real = truth[0] * w + truth[1] * k * 1000 + truth[2] * d + truth[3] * f
        m.observe(est, real * rnd.uniform(0.95, 1.05))
    assert m.overhead_s == pytest.approx(truth[0], rel=0.15)
    assert m.s_per_token == pytest.approx(truth[1], rel=0.15)
    assert m.s_per_decoding == pytest.approx(truth[2], abs=0.01)
    assert m.fetch_factor == pytest.approx(truth[3], rel=0.15)
    m.observe(m.estimate(Candidate("a", 100)), 1e6)                   # an absurd sample stays bounded
    assert 0 < m.overhead_s <= 10 and 0 < m.s_per_token <= 0.1
    frozen = CostModel(CostConfig(prefill_s_per_token=1e-3, learn=False))
    frozen.observe(frozen.estimate(Candidate("a", 1000)), 0.1)
    assert frozen.s_per_token == pytest.approx(1e-3)


def test_the_fit_is_bounded_below_and_recovers() -> None:
    """A fast box re-running cached 512-token prompts: 5 ms answers for what the router counts as
    512 tokens of prefill, all prompts one length (queue and token features collinear). The learnt
    cost per token sinks to start / learn_range, no lower (the old floor was 1e-7), and honest samples bring
    it back within a few dozen requests (the capped covariance keeps the fit awake)."""
    cfg = CostConfig(prefill_s_per_token=1.3e-4, request_overhead_s=0.01)
    m = CostModel(cfg)
    for _ in range(500):
        m.observe(m.estimate(Candidate("a", 512)), 0.005)
    assert m.s_per_token == pytest.approx(1.3e-4 / cfg.learn_range)         # 1.3e-10 with learn_range 1e6
    rnd = random.Random(2)
    for _ in range(60):
        n = rnd.choice([256, 512, 1024, 2048])
        m.observe(m.estimate(Candidate("a", n)), 0.01 + 1.3e-4 * n)
    assert m.s_per_token == pytest.approx(1.3e-4, rel=0.3)
