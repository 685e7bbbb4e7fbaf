"""The online prefill fit on a recorded trace: it must not degenerate.

``data/prefill_trace.csv`` was recorded from a real vLLM CPU server (the bench model, streamed
greedy completions one at a time, ``--enable-prompt-tokens-details``; recipe and the seeded
prompts in ``data/record_prefill_trace.py``): 24 new prompts of 64..1536 tokens, the same prompts
again (the engine's prefix cache answers them), then each one's first half with a new tail. Each
row: prompt tokens, the cached tokens the engine reported, the time to the first streamed chunk.

Replayed as the router sees it without a relay (it knows nothing of the engine's cache, so its
estimate counts every prompt token as prefill), from the default start values: fed the engine's
cached counts, or the router's own memory of what it sent, the learnt cost per token follows what
the trace itself says a computed token costs; fed nothing (the state before this fix) the cached
re-runs drag it down -- the cause of ``prefill_s_per_token`` collapsing from ~1.3e-4 to 1e-7
after ``vllm bench serve`` runs on a faster box, where a cached answer takes milliseconds -- and
``learn_range`` bounds how far.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from pof_connector.router.cost_model import Candidate, CostModel
from pof_connector.router.router_config import CostConfig
from pof_connector.router.sent_prefixes import SentPrefixes
from tests.router.data.record_prefill_trace import trace_prompts

TRACE = Path(__file__).parent / "data" / "prefill_trace.csv"


def rows() -> list[tuple[int, int, float]]:
    with TRACE.open() as f:
        return [(int(r["prompt_tokens"]), int(r["cached_tokens"]), float(r["ttft_s"])) for r in csv.DictReader(f)]


def reference() -> tuple[float, float]:
    """(overhead, seconds per computed token) by ordinary least squares over the whole trace."""
    data = np.array(rows(), dtype=float)
    x = np.column_stack([np.ones(len(data)), data[:, 0] - data[:, 1]])
    (a, s), *_ = np.linalg.lstsq(x, data[:, 2], rcond=None)
    return float(a), float(s)


def replay(cached_from: str) -> tuple[CostModel, list[float]]:
    """The model (default start values) after the trace, and its learnt cost per token after every
    sample; ``cached_from``: 'engine' (the reported count), 'router' (:class:`SentPrefixes`, as
    the proxy does when the engine reports none) or 'nothing'."""
    m = CostModel(CostConfig())
    sent = SentPrefixes(16)
    path = []
    for prompt, (n, cached, ttft) in zip(trace_prompts(), rows(), strict=True):
        assert len(prompt) == n
        est = m.estimate(Candidate("a", n))            # no relay: the router counts the whole prompt
        assert est.recompute_tokens == n
        guess = sent.cached_then_record("a", prompt)
        m.observe(est, ttft, {"engine": cached, "router": guess, "nothing": None}[cached_from])
        path.append(m.s_per_token)
    return m, path


def test_the_trace_holds_new_cached_and_partly_cached_prompts() -> None:
    data = rows()
    assert len(data) == 72
    assert sum(c == 0 for _, c, _ in data) >= 30
    assert sum(c >= p // 2 for p, c, _ in data) >= 20               # cached re-runs and half-cached variants
    _, s = reference()
    assert 1e-3 < s < 0.1                                            # a computed token on this busy box


@pytest.mark.parametrize("cached_from", ["engine", "router"])
def test_with_cached_counts_the_fit_follows_the_trace(cached_from: str) -> None:
    _, s = reference()
    m, path = replay(cached_from)
    assert m.s_per_token == pytest.approx(s, rel=0.25)
    assert min(path[10:]) > s / 2                                  # and never collapses on the way


def test_without_them_the_fit_is_dragged_down_but_stays_bounded() -> None:
    _, informed = replay("engine")
    _, blind = replay("nothing")
    assert min(blind) < min(informed[10:]) / 1.5                   # the cause: cached TTFTs counted as prefill
    cfg = CostConfig()
    assert min(blind) >= cfg.prefill_s_per_token / cfg.learn_range * (1 - 1e-9)
