"""The event core against hand-computed cases, on a toy profile: 4-token blocks, 10 ms of prefill
per token, 100 ms per iteration, 1 MB of KV per token, a local tier of 1 GB/s (1 ms per token) and
a remote tier of 0.5 GB/s (2 ms per token), no latencies."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest

from pof_connector.config import ConfigError
from pof_connector.sim.base import NodeEvents, NodeView, Policy
from pof_connector.sim.counters import Counters
from pof_connector.sim.engine_node import EngineNode
from pof_connector.sim.index_cost import request_index_s
from pof_connector.sim.job import Job
from pof_connector.sim.prefix_cache import PrefixCache
from pof_connector.sim.profile import Profile, load_profile, profile_from_mapping
from pof_connector.sim.sim_config import SimConfig
from pof_connector.sim.simulator import Simulator
from pof_connector.sim.workload import SimRequest

TOY: dict[str, Any] = {
    "kv_blocks": 10, "block_tokens": 4, "kv_bytes_per_token": 1_000_000, "max_running": 8,
    "max_batched_tokens": 1000, "prefill_s_per_token": 0.01, "prefill_s_per_token_ctx": 0.0,
    "decode_step_s": 0.1, "decode_s_per_seq": 0.0, "decode_s_per_ctx_token": 0.0,
    "local_tier": {"name": "cpu_dram", "gbps": 1.0, "latency_us": 0, "capacity_gb": 100},
    "remote_tier": {"name": "remote", "gbps": 0.5, "latency_us": 0},
}


def toy(**changes: Any) -> Profile:
    return profile_from_mapping({**TOY, **changes}, "toy", "toy")


class Placed(Policy):
    """Places request i on ``nodes_of[i]``; ``pool``: the nodes have the pool."""

    def __init__(self, nodes_of: list[int], pool: bool = False) -> None:
        self.name = "placed"
        self.nodes_of = nodes_of
        self.uses_pool = pool

    def choose(self, job: Job, nodes: list[NodeView], now: float) -> int:
        return self.nodes_of[job.id]


def run(profile: Profile, requests: list[SimRequest], nodes_of: list[int], *, pool: bool = False,
        nodes: int = 1) -> tuple[list[Job], Simulator]:
    sim = Simulator(profile, Placed(nodes_of, pool), SimConfig(nodes=nodes))
    jobs: list[Job] = []
    make = sim.jobs

    def keep(reqs: list[SimRequest]) -> list[Job]:
        jobs.extend(make(reqs))
        return jobs
    sim.jobs = keep  # type: ignore[method-assign]
    sim.run(requests)
    return jobs, sim


def req(at: float, session: str, turn: int, max_tokens: int, system: int = 0, tenant: str = "t") -> SimRequest:
    return SimRequest(at, session, tenant, system, turn, max_tokens)


def test_one_request_prefills_then_decodes() -> None:
    (job,), sim = run(toy(), [req(0.0, "a", 10, 3)], [0])
    assert job.first_token_at == pytest.approx(0.1 + 10 * 0.01)      # one iteration: step + prefill
    assert job.done_at == pytest.approx(0.2 + 2 * 0.1)               # two more decode steps
    assert sim.nodes[0].used == 0 and job.generated == 3
    assert sim.counters.computed_tokens == 10 and sim.counters.recomputed_tokens == 0


def test_admission_waits_for_blocks() -> None:
    # A needs ceil(31 / 4) = 8 of the 10 blocks; B's ceil(11 / 4) = 3 do not fit beside it
    (a, b), _ = run(toy(), [req(0.0, "a", 30, 2), req(0.0, "b", 10, 1, tenant="u")], [0, 0])
    assert a.first_token_at == pytest.approx(0.1 + 0.3)
    assert a.done_at == pytest.approx(0.5)                         # 31 -> 32 tokens: no new block
    assert b.first_token_at == pytest.approx(0.5 + 0.1 + 0.1)       # admitted when A's blocks free


def test_a_request_larger_than_the_node_fails() -> None:
    (job,), sim = run(toy(), [req(0.0, "a", 40, 2)], [0])
    assert job.failed and sim.counters.failed == 1


def preempting() -> list[SimRequest]:
    # 6 blocks; A and B (7-token prompts, 10 tokens out) take 2 each, then a block each at their
    # 9th token (6 used); at the 13th neither block is free: B, the newest, is preempted with 12
    # tokens (11 with KV, its 2 full blocks stay cached), and resumes when A ends at 0.24 + 9 x 0.1
    # = 1.14; A's 5th block (its 17th token) evicts the tail one of them, B's first 4 tokens stay
    return [req(0.0, "a", 7, 10), req(0.0, "b", 7, 10, tenant="u")]


def test_preemption_of_the_newest_recomputes_without_the_pool() -> None:
    (a, b), sim = run(toy(kv_blocks=6), preempting(), [0, 0])
    assert a.first_token_at == b.first_token_at == pytest.approx(0.1 + 14 * 0.01)
    assert (a.preemptions, b.preemptions, sim.counters.preemptions) == (0, 1, 1)
    assert a.done_at == pytest.approx(1.14)
    assert b.done_at == pytest.approx(1.14 + 0.1 + 8 * 0.01 + 4 * 0.1)     # re-prefill 8, 4 more steps
    assert sim.counters.recomputed_tokens == 7


def test_preemption_with_the_pool_loads_what_was_stored() -> None:
    (_, b), sim = run(toy(kv_blocks=6), preempting(), [0, 0], pool=True)
    assert b.preemptions == 1
    # 11 tokens with KV, stored block-aligned: 4 still in the engine's cache, the next 4 loaded
    # over the local tier (1 ms each), 4 computed
    assert b.done_at == pytest.approx(1.14 + 0.1 + 4 * 0.01 + 4 * 0.001 + 4 * 0.1)
    assert sim.counters.recomputed_tokens == 3 and sim.counters.loaded_tokens == 4
    assert sim.pool is not None and sim.pool.loaded_bytes["cpu_dram"] == 4_000_000


def session(second_at: float = 1.0) -> list[SimRequest]:
    # turn 1: 8 tokens, 4 out (11 with KV at its end, 8 of them in whole blocks); turn 2: 12 + 4 = 16
    return [req(0.0, "s", 8, 4), req(second_at, "s", 4, 2)]


def test_session_turn_on_its_node_hits_the_engine_cache() -> None:
    (_, two), sim = run(toy(), session(), [0, 0])
    assert two.prompt_tokens == 16 and two.history_tokens == 12
    assert two.ttft == pytest.approx(0.1 + 8 * 0.01)
    assert sim.counters.recomputed_tokens == 3          # the partial block (engines cache whole blocks)


def test_session_moving_without_the_pool_recomputes() -> None:
    (_, two), sim = run(toy(), session(), [0, 1], nodes=2)
    assert two.ttft == pytest.approx(0.1 + 16 * 0.01)
    assert sim.counters.recomputed_tokens == 11


def test_session_moving_with_the_pool_loads_its_kv() -> None:
    (_, two), sim = run(toy(), session(), [0, 1], pool=True, nodes=2)
    load_s = 8 * 1_000_000 / 0.5e9                                  # 8 tokens over the remote tier
    index_s = request_index_s(1, True)          # two lookups of a prefix one node holds, its records read
    assert two.ttft == pytest.approx(0.1 + 8 * 0.01 + load_s + index_s)
    assert two.ttft < 0.1 + 16 * 0.01                              # cheaper than recomputing
    assert sim.counters.recomputed_tokens == 3
    assert sim.pool is not None and sim.pool.loaded_bytes["remote"] == 8_000_000


def test_a_turn_due_before_the_last_one_ended_is_sent_when_it_ends() -> None:
    # as the bench sends a session: turn 2's prompt holds turn 1's answer. Turn 1 has its first
    # token at 0.1 + 8 x 0.01 = 0.18 and its last at 0.48; turn 2, due at 0.0, goes then and finds
    # turn 1's 8 whole-block tokens in the engine cache
    (one, two), _ = run(toy(), session(second_at=0.0), [0, 0])
    assert one.done_at == pytest.approx(0.48)
    assert two.arrival == pytest.approx(0.48)
    assert two.ttft == pytest.approx(0.1 + 8 * 0.01)


def test_after_a_failed_turn_the_sessions_later_turns_are_not_sent() -> None:
    sim = Simulator(toy(), Placed([0, 0]), SimConfig(nodes=1))
    result = sim.run([req(0.0, "s", 40, 2), req(1.0, "s", 4, 2)])   # 41 tokens never fit in 10 blocks
    assert result.failed == 2 and sim.counters.failed == 1 and result.arrived == 1


def test_nodes_sharing_a_host_slow_each_other() -> None:
    # each node prefills 10 tokens (0.1 + 0.1 s alone); with the other busy, 1.5x as long
    (a, b), _ = run(toy(host_slowdown=0.5), [req(0.0, "a", 10, 1), req(0.0, "b", 10, 1, tenant="u")], [0, 1],
                    nodes=2)
    assert a.first_token_at == b.first_token_at == pytest.approx(1.5 * 0.2)
    (alone,), _ = run(toy(host_slowdown=0.5), [req(0.0, "a", 10, 1)], [0], nodes=2)
    assert alone.first_token_at == pytest.approx(0.2)


def test_eviction_takes_the_tail_of_the_least_recently_used_prefix() -> None:
    cache = PrefixCache(4)
    cache.pin("old", 16)
    cache.pin("new", 8)
    cache.unpin("old", 16)
    cache.unpin("new", 8)
    cache.shrink(4)                                 # 6 free blocks cached, room for 4
    assert (cache.peek("old"), cache.peek("new"), cache.free_blocks) == (8, 8, 4)
    cache.shrink(1)
    assert (cache.peek("old"), cache.peek("new"), cache.free_blocks) == (0, 4, 1)


def test_eviction_order_is_the_order_blocks_were_freed() -> None:
    # vLLM queues a request's blocks when it frees them: one admitted first but finishing last
    # is evicted last, and a request's system prompt, freed after its session's tail, outlives it
    cache = PrefixCache(4)
    cache.pin("early", 8)
    cache.pin("late", 8)
    cache.unpin("late", 8)
    cache.unpin("early", 8)
    cache.shrink(2)
    assert (cache.peek("early"), cache.peek("late")) == (8, 0)
    node = EngineNode(0, toy(), _NoEvents(), Counters())
    job = Job(0, req(0.0, "s", 4, 1, system=8), 0.0, history_tokens=8, prompt_tokens=12)
    node.cache.pin("s:s", 12, base_blocks=2)
    node.cache.pin("t:t", 8)
    node.used = 5
    node._release_pins(job)
    node.cache.shrink(2)                              # 1 own block of the session, 2 of the prompt
    assert (node.cache.peek("t:t"), node.cache.peek("s:s"), node.used) == (8, 0, 3)


def test_a_tenants_system_prompt_blocks_are_held_once_per_node() -> None:
    # A (system 8 + 12 tokens, 4 out) holds ceil(21 / 4) = 6 of the 10 blocks until it ends.
    # B of the same tenant (system 8 + 8) needs 5 blocks, of which the system prompt's 2 are A's
    # (vLLM shares them by reference count): its 3 own blocks fit beside A at A's step ending at
    # 0.4, and it computes only its 8 new tokens. Counted twice, its 5 blocks would wait for A's end.
    (a, b), sim = run(toy(), [req(0.0, "a", 12, 4, system=8), req(0.35, "b", 8, 1, system=8)], [0, 0])
    assert a.first_token_at == pytest.approx(0.1 + 20 * 0.01)
    assert b.first_token_at == pytest.approx(0.4 + 0.1 + 8 * 0.01)
    assert a.done_at == pytest.approx(0.4 + 0.18 + 0.1)     # its step beside B's prefill, then one more
    assert sim.nodes[0].used == 0 and sim.nodes[0].cache.pins("t:t") == 0


def test_a_sessions_cached_context_needs_its_system_prompts_blocks() -> None:
    # one hash chain: once the system prompt's blocks are evicted, the session's later blocks are
    # unreachable, and they come back with the system prompt
    node = EngineNode(0, toy(), _NoEvents(), Counters())
    job = Job(0, req(0.0, "s", 4, 1, system=8), 0.0, history_tokens=16, prompt_tokens=20)
    node.cache.pin("t:t", 8)
    node.cache.pin("s:s", 16, base_blocks=2)
    node.cache.unpin("t:t", 8)
    node.cache.unpin("s:s", 16)
    assert node.cache.free_blocks == 4                 # the system prompt's 2 blocks are counted once
    assert node.cached_prefix(job) == 16
    node.cache.tokens("s:s")                          # the system prompt is now the least recently used
    node.cache.shrink(2)
    assert (node.cache.peek("t:t"), node.cache.peek("s:s")) == (0, 16)
    assert node.cached_prefix(job) == 0
    node.cache.pin("t:t", 8)
    assert node.cached_prefix(job) == 16


def test_an_arrival_cuts_a_decode_segment_at_the_step_in_progress() -> None:
    # A decodes 20 steps from 0.2; B arrives at 0.45, mid-step 3, and is admitted when it ends (0.5)
    (_, b), _ = run(toy(), [req(0.0, "a", 10, 21), req(0.45, "b", 4, 1, tenant="u")], [0, 0])
    assert b.first_token_at == pytest.approx(0.5 + 0.1 + 4 * 0.01)


def test_profiles_load_and_bad_keys_are_named() -> None:
    h200 = load_profile("h200")
    assert h200.kv_bytes_per_token == 131072 and h200.kv_tokens == 800_000
    assert load_profile("cpu-bench").block_tokens == 128
    with pytest.raises(ConfigError, match="kv_blocks"):
        profile_from_mapping({**TOY, "kv_blocks": 0}, "x", "x")
    with pytest.raises(ConfigError, match=r"local_tier\.speed"):
        profile_from_mapping({**TOY, "local_tier": {**TOY["local_tier"], "speed": 1}}, "x", "x")
    with pytest.raises(ConfigError, match="no shipped profile"):
        load_profile("nope")


class _NoEvents(NodeEvents):
    def wake(self, node: int, at: float, version: int) -> None: ...

    def first_token(self, job: Job, at: float) -> None: ...

    def finished(self, job: Job, at: float) -> None: ...


def test_new_blocks_per_residue_window_equal_the_per_request_sum() -> None:
    """EngineNode._need (a window sum over the residues of the decoding requests' lengths) against
    each request's ``ceil((len + k) / bt) - ceil(len / bt)`` counted one by one."""
    rnd = random.Random(3)
    for bt in (1, 2, 16, 128):
        profile = replace(load_profile("h200"), block_tokens=bt)
        for _ in range(200):
            node = EngineNode(0, profile, _NoEvents(), Counters())
            node.steps = rnd.randint(0, 5000)
            lengths = [rnd.randint(1, 9000) for _ in range(rnd.randint(0, 30))]
            for n in lengths:
                offset = n - node.steps
                node._resid[offset % bt] += 1
                node.decoding[object()] = 0  # type: ignore[index]
            for k in (0, 1, bt - 1, bt, bt + 1, rnd.randint(0, 4 * bt + 3), 256):
                want = sum(-(-(n + k) // bt) - -(-n // bt) for n in lengths)
                assert node._need(k) == want, (bt, k, node.steps, lengths)
