"""`pof bench pd`'s parts that run without servers: the request mix, the figures it reports and
the NIXL shim it gives vLLM's NixlConnector. The bench itself starts real vLLM servers (run by
hand; its figures are in docs/bench/)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from pof_connector.bench import pd


def test_the_mix_is_seeded_open_loop_and_every_prompt_is_unique() -> None:
    mix = pd.Mix(seconds=200, chat_rate=0.5, long_rate=0.1, chat_prompt=16, long_prompt=64)
    a, b = pd.make_requests(mix, seed=1, vocab=1000), pd.make_requests(mix, seed=1, vocab=1000)
    assert a == b
    assert [r.at for r in a] == sorted(r.at for r in a) and all(0 < r.at < 200 for r in a)
    chat = [r for r in a if r.kind == "chat"]
    long = [r for r in a if r.kind == "long"]
    assert 60 <= len(chat) <= 140 and 8 <= len(long) <= 35           # Poisson around 100 and 20
    assert {len(r.prompt) for r in chat} == {16} and {len(r.prompt) for r in long} == {64}
    assert {r.max_tokens for r in chat} == {mix.chat_tokens} and {r.max_tokens for r in long} == {mix.long_tokens}
    assert len({tuple(r.prompt) for r in a}) == len(a)                # no prefix cache helps any set-up
    other = pd.make_requests(mix, seed=1, vocab=1000, content="colocated")
    assert [(r.at, r.kind, len(r.prompt)) for r in other] == [(r.at, r.kind, len(r.prompt)) for r in a]
    assert not {tuple(r.prompt) for r in other} & {tuple(r.prompt) for r in a}   # nor the pool, after another


def test_figures_itl_over_chunks_goodput_by_both_slos_and_failures_counted() -> None:
    mix = pd.Mix(ttft_slo_s=1.0, tpot_slo_s=0.1)
    outs = [pd.Outcome("chat", ttft=0.5, chunks=[0.5, 0.55, 0.6, 0.65]),    # meets both
            pd.Outcome("chat", ttft=2.0, chunks=[2.0, 2.05]),               # TTFT too long
            pd.Outcome("long", ttft=0.4, chunks=[0.4, 1.4]),                # one token a second
            pd.Outcome("chat", error="URLError: refused")]
    row = pd.summarize(outs, wall=10.0, mix=mix)
    assert (row["requests"], row["answered"], row["failed"]) == (4, 3, 1)
    assert row["errors"] == ["URLError: refused"]
    assert row["slo_met"] == 1 and row["goodput_rps"] == 0.1
    assert row["itl_max_s"] == pytest.approx(1.0) and row["itl_p50_s"] == pytest.approx(0.05)
    assert row["chat"]["answered"] == 2 and row["long"]["itl_p99_s"] == pytest.approx(1.0)


def test_the_router_headers_count_handoffs_and_why_none() -> None:
    outs = [pd.Outcome("chat", ttft=0.1, chunks=[0.1], headers={"x-pof-prefill": "a"}),
            pd.Outcome("chat", ttft=0.1, chunks=[0.1], headers={"x-pof-prefill": "none:no-prefill-server"})]
    row = pd.summarize(outs, wall=1.0, mix=pd.Mix())
    assert row["handoffs"] == 1 and row["no_handoff"] == ["none:no-prefill-server"]


@pytest.mark.skipif(importlib.util.find_spec("nixl_cu13") is None or importlib.util.find_spec("nixl") is not None,
                    reason="needs the light NIXL install (nixl_cu13 without the nixl package)")
def test_the_nixl_shim_gives_vllm_the_module_names_it_imports(tmp_path: Path) -> None:
    path = pd.nixl_shim(tmp_path)
    assert path is not None
    code = "import nixl._api as a, nixl._bindings as b; print(a.nixl_agent.__module__, hasattr(a, 'nixl_agent_config'))"
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": path}, capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["nixl_cu13._api", "True"]


def test_unknown_setups_are_refused_before_anything_starts() -> None:
    with pytest.raises(pd.BenchError, match="allowed: pd_pool, pd_split, colocated, nixl"):
        pd.run(mix=pd.Mix(), setups=["disagg"], seed=1, progress=print)
