"""Record the routing states and decisions that tests/router/test_weighing_recorded.py replays (not a
test; run by hand).

    PYTHONPATH=$PWD nice -n 19 ~/.cache/pof/venvs/core/bin/python \
        tests/router/data/record_weighing_states.py tests/router/data/weighing_states.jsonl

Recorded 2026-12-01 with the router as it was before its weighing loop read a per-reading KV limit
and a lock-free pressure snapshot (commit dbf27d9), so the test pins that the faster loop decides as
the old one did. States come from `pof sim` runs that drive the real router (8 and 12 nodes; the
h200 profile at high load, where nodes saturate, and the cpu-bench profile, whose 60-block nodes
saturate at once), sampled so that every route occurs, and from random clusters that exercise what
the simulator never does (missing readings, the relay's reading as a fallback, no KV capacity, per
node block sizes). One JSON object per line: the router configuration, the cost coefficients, every
backend's load and KV reading, the locality answer (entries shared by several nodes listed once),
the prompt, KV need and round-robin offset, and the decision the router made.
"""

from __future__ import annotations

import itertools
import json
import random
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

from pof_connector.index.base import NodeInfo
from pof_connector.locality.engine_load import EngineLoad
from pof_connector.locality.locator import Locality, NodeLocality
from pof_connector.router.cost_model import Candidate
from pof_connector.router.router import Decision, Router
from pof_connector.router.router_config import RouterConfig
from tests.router.test_weighing_recorded import decision_json  # one JSON shape for recording and replaying

PER_ROUTE = 8
"""Sim states kept per route and source."""
RANDOM_STATES = 60


def load_json(load: EngineLoad | None) -> list[Any] | None:
    if load is None:
        return None
    return [load.running, load.waiting, load.kv_usage, load.kv_capacity_tokens, load.block_tokens, load.preemptions]


def state_of(router: Router, mapping: dict[str, Any], found: Locality, n_tokens: int, need: int,
             offset: int, live: list[Any]) -> dict[str, Any]:
    entries: list[NodeLocality] = []
    index: dict[int, int] = {}
    where: dict[str, int] = {}
    for name, node in found.nodes.items():
        k = index.get(id(node))
        if k is None:
            k = index[id(node)] = len(entries)
            entries.append(node)
        where[name] = k
    backends = []
    for b in live:
        load, pending, preempting = b.pressure_fields(router.config.capacity.stale_after_s)
        backends.append([b.name, b.running, b.waiting, b.waiting_tokens, load_json(load), pending, preempting])
    return {
        "config": mapping, "theta": [float(v) for v in router.cost._theta], "n_tokens": n_tokens, "need": need,
        "offset": offset, "backends": backends, "where": where,
        "entries": [{"page_tokens": e.page_tokens, "held": e.held, "engine_tokens": e.engine_tokens,
                     "usable": e.usable, "near_tokens": e.near_tokens, "load": load_json(e.load),
                     "page_bytes": e.info.meta.get("page_bytes") if e.info else None} for e in entries],
    }


def record_sim(out: list[dict[str, Any]], profile_name: str, mix: str, nodes: int, factor: float, seed: int,
               kv_blocks: int) -> None:
    from pof_connector.sim.mixes import make_mix
    from pof_connector.sim.pof_policy import PofPolicy, router_config
    from pof_connector.sim.profile import load_profile
    from pof_connector.sim.sim_config import SimConfig
    from pof_connector.sim.simulator import Simulator

    profile = load_profile(profile_name)
    mapping_holder: dict[str, Any] = {}
    cfg = router_config(profile, nodes)
    full = json.loads(cfg.model_dump_json())
    mapping_holder["config"] = {"backends": [b["name"] for b in full["backends"]], "cost": full["cost"],
                                "capacity": full["capacity"]}
    # the mix of a full-sized node on nodes with ``kv_blocks``: memory binds, nodes saturate
    requests = make_mix(mix, nodes=nodes, requests=600 * nodes // 8, seed=seed, kv_tokens=profile.kv_tokens)
    profile = replace(profile, kv_blocks=kv_blocks)
    original = Router._by_cost
    by_route: dict[str, list[dict[str, Any]]] = defaultdict(list)
    seen: dict[str, int] = defaultdict(int)
    rnd = random.Random(seed)

    def hooked(self: Router, tokens: list[int], cache_salt: str | None, live: list[Any], need: int) -> Decision:
        offset = next(self._rr)
        self._rr = itertools.count(offset)
        assert self.locator is not None
        found = self.locator.locate(tokens, self.config.model, cache_salt)
        state = state_of(self, mapping_holder["config"], found, len(tokens), need, offset, live)
        d = original(self, tokens, cache_salt, live, need)
        state["decision"] = decision_json(d)
        state["source"] = f"sim {profile_name} {mix} {nodes} nodes x{factor}"
        kept = by_route[d.route]              # a uniform sample of each route's states (reservoir)
        seen[d.route] += 1
        if len(kept) < PER_ROUTE:
            kept.append(state)
        elif (k := rnd.randrange(seen[d.route])) < PER_ROUTE:
            kept[k] = state
        return d

    Router._by_cost = hooked  # type: ignore[method-assign]
    try:
        Simulator(profile, PofPolicy(profile), SimConfig(nodes=nodes, rate_factor=factor, slo_s=None,
                                                         give_up=False)).run(requests)
    finally:
        Router._by_cost = original  # type: ignore[method-assign]
    for route, kept in sorted(by_route.items()):
        print(f"{profile_name} {mix} x{factor}: {route}: {len(kept)}", file=sys.stderr)
        out.extend(kept)


def config_of(mapping: dict[str, Any]) -> RouterConfig:
    """The router configuration a recorded state's ``config`` stands for."""
    return RouterConfig.from_mapping({
        "policy": "pof", "backends": [{"name": n, "url": f"http://{n}.invalid"} for n in mapping["backends"]],
        "cost": mapping["cost"], "capacity": mapping["capacity"]})


class FixedLocator:
    def __init__(self) -> None:
        self.answer: Locality | None = None

    def locate(self, tokens: list[int], model: str | None = None, cache_salt: str | None = None) -> Locality:
        assert self.answer is not None
        return self.answer


def record_random(out: list[dict[str, Any]], seed: int) -> None:
    rnd = random.Random(seed)
    page = 16
    info = NodeInfo("x", meta={"page_bytes": str(page * 4096), "model": "m"})
    for _ in range(RANDOM_STATES):
        n = rnd.randint(1, 12)
        mapping = {"backends": [f"b{i}" for i in range(n)],
                   "cost": {"tier_gbps": {"cpu_dram": 8.0, "remote": 3.0}},
                   "capacity": {"block_tokens": page, "stale_after_s": 1e12,
                                "high_watermark": rnd.choice([0.9, 0.5])}}
        cfg = config_of(mapping)
        locator = FixedLocator()
        router = Router(cfg, locator)
        for _ in range(rnd.randint(0, 20)):
            est = router.cost.estimate(Candidate("b0", rnd.randint(10, 5000), waiting=rnd.randint(0, 3)))
            router.cost.observe(est, rnd.uniform(0.01, 2.0), rnd.choice([None, 0, 512]))
        for b in router.backends:
            if rnd.random() < 0.8:
                b.record_load(EngineLoad(running=0, waiting=0, preemptions=0))
            for _ in range(rnd.randint(0, 4)):
                t = b.admit(rnd.randint(0, 4000), rnd.randint(0, 40))
                if rnd.random() < 0.5:
                    b.first_token(t)
            if b.engine_load is not None:
                b.record_load(EngineLoad(running=rnd.randint(0, 8), waiting=rnd.randint(0, 3),
                                         kv_usage=rnd.choice([None, rnd.random(), 0.95, 1.0, 0.5]),
                                         kv_capacity_tokens=rnd.choice([None, 2048, 8192, 0]),
                                         block_tokens=rnd.choice([page, page, None, 32]),
                                         preemptions=rnd.randint(0, 2)))
                for _ in range(rnd.randint(0, 2)):
                    b.admit(rnd.randint(0, 4000), rnd.randint(0, 60))
        prompt = rnd.randint(1, 3000)
        shared = NodeLocality("*", page, {}, 0, {"remote": rnd.choice([0, 512])}, 0, None, info)
        nodes: dict[str, NodeLocality] = {}
        for b in router.backends:
            kind = rnd.random()
            if kind < 0.4:
                nodes[b.name] = shared
            elif kind < 0.9:
                own = rnd.choice([0, 256, 1024])
                nodes[b.name] = NodeLocality(
                    b.name, page, {"cpu_dram": own} if own else {}, rnd.choice([0, 128, 2048]),
                    {"cpu_dram": own} if own else {"remote": rnd.choice([0, 512])}, own,
                    rnd.choice([None, EngineLoad(running=1, waiting=rnd.randint(0, 2), kv_usage=rnd.random(),
                                                 kv_capacity_tokens=2048, block_tokens=page)]),
                    rnd.choice([info, info, None]))
        locator.answer = Locality("m", prompt, page, nodes)
        max_tokens = rnd.randint(1, 600)
        need = router.kv.need_tokens(prompt, max_tokens)
        offset = rnd.randint(0, 50)
        state = state_of(router, mapping, locator.answer, prompt, need, offset, router.backends)
        router._rr = itertools.count(offset)
        d = router._by_cost(list(range(prompt)), None, router.backends, need)
        state["decision"] = decision_json(d)
        state["source"] = "random"
        out.append(state)


def main() -> None:
    out: list[dict[str, Any]] = []
    record_sim(out, "h200", "long-context", 8, 8.0, 1, 50000)
    record_sim(out, "h200", "long-context", 8, 2.0, 2, 12000)
    record_sim(out, "h200", "prefix-heavy", 12, 3.0, 3, 4000)
    record_sim(out, "h200", "uniform", 8, 2.0, 5, 3000)
    record_random(out, 4)
    with Path(sys.argv[1]).open("w") as f:
        for s in out:
            f.write(json.dumps(s, separators=(",", ":")) + "\n")
    print(f"{len(out)} states", file=sys.stderr)


if __name__ == "__main__":
    main()
