"""The router weighs every backend with plain numbers (``CostModel.ttft_s``, ``KvAdmission.verdict``)
and builds the chosen one's Estimate and Admission only: its decisions must be those of weighing
each backend with ``estimate()`` and ``assess()`` objects, as it did before (the reference below is
that rule, written out), on random clusters: loads, KV readings (some missing, some saturated),
locality entries (some shared by several nodes, as `pof sim`'s are), learnt coefficients."""

from __future__ import annotations

import itertools
import random

import pytest

from pof_connector.index.base import NodeInfo
from pof_connector.locality.engine_load import EngineLoad
from pof_connector.locality.locator import Locality, NodeLocality
from pof_connector.router.cost_model import Candidate
from pof_connector.router.kv_admission import NodePressure
from pof_connector.router.router import Router
from pof_connector.router.router_config import RouterConfig

PAGE = 16
INFO = NodeInfo("x", meta={"page_bytes": str(PAGE * 4096), "model": "m"})


class FixedLocator:
    def __init__(self) -> None:
        self.answer: Locality | None = None

    def locate(self, tokens: list[int], model: str | None = None, cache_salt: str | None = None) -> Locality:
        assert self.answer is not None
        return self.answer


def reference(router: Router, found: Locality, n_tokens: int, need: int,
              offset: int) -> tuple[str, str, str | None, float]:
    """(backend, route, holder, displacement) as the router chose before it weighed with plain
    numbers: each node's estimate plus its displacement (``displacement_weight`` x its prefix
    cost, recompute and pool load, less the cheapest node's)."""
    weight = router.config.cost.displacement_weight
    options = []
    live = router.backends
    for i, b in enumerate(live):
        node = found.nodes.get(b.name)
        bpt = int(node.info.meta["page_bytes"]) / node.page_tokens if node and node.info else 0.0
        queued = b.tokens_left(router._clock(), router.cost.s_per_token)
        est = router.cost.estimate(Candidate(b.name, n_tokens, node.engine_tokens if node else 0,
                                             node.usable if node else {}, bpt, b.running, b.waiting, queued))
        pressure = b.pressure(router.config.capacity.stale_after_s)
        if pressure.load is None and node is not None and node.load is not None:
            pressure = NodePressure(node.load)
        adm = router.kv.assess(pressure, need, s_per_token=router.cost.s_per_token, overhead_s=router.cost.overhead_s)
        held = max(node.engine_tokens, node.held_tokens) if node else 0
        move = weight * (router.cost.s_per_token * est.recompute_tokens + router.cost.fetch_factor * est.fetch_s)
        options.append((b, est, adm, held, (i - offset) % len(live), move, queued))
    roomy = [o for o in options if not o[2].saturated]
    best = min(roomy or options,
               key=lambda o: (o[1].ttft_s + o[5] + (0.0 if roomy else o[2].cost_s), -o[3], o[4]))
    holder = max(options, key=lambda o: (o[3], -o[4]))
    balanced = False
    if roomy:       # the least loaded, unless the lowest estimate beats it by the estimates' error
        lightest = min(roomy, key=lambda o: (o[6], o[0].running, o[4]))
        balanced = (lightest is not best
                    and lightest[1].ttft_s + lightest[5] - best[1].ttft_s - best[5] < router.cost.error_s)
        best = lightest if balanced else best
    if not roomy:
        route = "all-saturated"
    elif balanced:
        route = "load-balanced"
    elif holder[3] == 0:
        route = "no-prefix"
    elif best is holder or best[3] >= holder[3]:
        route = "prefix-holder"
    elif holder[2].saturated:
        route = "holder-saturated:pool" if best[1].fetch_tokens > 0 else "holder-saturated:recompute"
    else:
        route = "lower-cost"
    return best[0].name, route, holder[0].name if holder[3] > 0 else None, best[5] - min(o[5] for o in options)


def test_weighing_matches_the_per_backend_objects() -> None:
    rnd = random.Random(7)
    clock = [0.0]
    for trial in range(300):
        n = rnd.randint(1, 12)
        locator = FixedLocator()
        # time passes between a cluster's events: nodes are partway through what they were sent,
        # and some readings grow stale
        router = Router(RouterConfig.from_mapping({
            "policy": "pof", "backends": [{"name": f"b{i}", "url": f"http://b{i}.invalid"} for i in range(n)],
            "cost": {"tier_gbps": {"cpu_dram": 8.0, "remote": 3.0}, "balance_within_error": True,
                     "displacement_weight": rnd.choice([0.0, 1.0, 2.5])}}), locator, clock=lambda: clock[0])
        for _ in range(rnd.randint(0, 20)):          # learnt coefficients, not the start values
            est = router.cost.estimate(Candidate("b0", rnd.randint(10, 5000), waiting=rnd.randint(0, 3)))
            router.cost.observe(est, rnd.uniform(0.01, 2.0), rnd.choice([None, 0, 512]))
        for b in router.backends:
            for _ in range(rnd.randint(0, 4)):
                t = b.admit(rnd.randint(0, 4000), rnd.randint(0, 40))
                clock[0] += rnd.choice([0.0, rnd.uniform(0, 0.5), rnd.uniform(0, 3.0)])
                if rnd.random() < 0.5:
                    b.first_token(t)
            if rnd.random() < 0.8:
                b.record_load(EngineLoad(running=rnd.randint(0, 8), waiting=rnd.randint(0, 3),
                                         kv_usage=rnd.choice([None, rnd.random(), 0.95, 1.0]),
                                         kv_capacity_tokens=rnd.choice([None, 2048, 8192]), block_tokens=PAGE,
                                         preemptions=rnd.randint(0, 2)))
        prompt = rnd.randint(1, 3000)
        shared = NodeLocality("*", PAGE, {}, 0, {"remote": rnd.choice([0, 512])}, 0, None, INFO)
        nodes: dict[str, NodeLocality] = {}
        for b in router.backends:
            kind = rnd.random()
            if kind < 0.4:
                nodes[b.name] = shared
            elif kind < 0.9:
                own = rnd.choice([0, 256, 1024])
                nodes[b.name] = NodeLocality(
                    b.name, PAGE, {"cpu_dram": own} if own else {}, rnd.choice([0, 128, 2048]),
                    {"cpu_dram": own} if own else {"remote": rnd.choice([0, 512])}, own,
                    rnd.choice([None, EngineLoad(running=1, waiting=2, kv_usage=0.99, kv_capacity_tokens=2048,
                                                 block_tokens=PAGE)]), INFO)
        locator.answer = Locality("m", prompt, PAGE, nodes)
        max_tokens = rnd.randint(1, 600)
        offset = next(router._rr) + 1          # the offset the router's next choice takes
        router._rr = itertools.count(offset)
        want = reference(router, locator.answer, prompt, router.kv.need_tokens(prompt, max_tokens), offset)
        router._rr = itertools.count(offset)
        d = router.choose(list(range(prompt)), max_tokens=max_tokens)
        assert (d.backend.name, d.route, d.holder) == want[:3], f"trial {trial}"
        assert d.displacement_s == pytest.approx(want[3], rel=1e-6, abs=1e-6), f"trial {trial}"
        assert d.estimate is not None and d.admission is not None
        cand_node = nodes.get(d.backend.name)
        assert d.estimate.ttft_s == router.cost.ttft_s(
            d.estimate.recompute_tokens, d.estimate.fetch_s, d.backend.running, d.backend.waiting,
            d.backend.tokens_left(clock[0], router.cost.s_per_token)), "ttft_s and estimate() disagree"
        assert set(d.saturated) <= {b.name for b in router.backends}
        assert cand_node is None or d.prompt_tokens == prompt


def test_fit_tokens_says_saturated_exactly_when_verdict_does() -> None:
    """The router weighs a backend by ``need > fit_tokens(reading)``; verdict() is the rule."""
    from pof_connector.router.kv_admission import KvAdmission
    from pof_connector.router.router_config import CapacityConfig

    rnd = random.Random(11)
    for enabled in (True, False):
        kv = KvAdmission(CapacityConfig(enabled=enabled, block_tokens=16, high_watermark=rnd.choice([0.9, 0.5])))
        for _ in range(3000):
            load = rnd.choice([None, EngineLoad(
                running=rnd.randint(0, 5), waiting=rnd.randint(0, 2),
                kv_usage=rnd.choice([None, 0.0, 1.0, 1.2, -0.1, 0.9, 0.5, rnd.random()]),
                kv_capacity_tokens=rnd.choice([None, 0, 1000, 4096, rnd.randint(1, 100000)]),
                block_tokens=rnd.choice([None, 0, 16, 32, 128]), preemptions=0)])
            pending, preempting = rnd.randint(0, 300), rnd.random() < 0.3
            fit = kv.fit_tokens(load, pending, preempting)
            for need in (-5, 0, 1, 15, 16, 17, rnd.randint(0, 200000)):
                saturated = kv.verdict(load, pending, preempting, need, 1e-4, 0.01)[2]
                assert saturated == (fit is not None and max(need, 0) > fit), (load, pending, preempting, need, fit)
