"""The router's weighing decides as it did before it was made faster: 166 states recorded from
`pof sim` runs that drive the real router (nodes with room, saturated holders, all nodes saturated)
and from random clusters (missing readings, the relay's reading as a fallback, unknown capacity,
other block sizes), each with the decision the router made then (tests/router/data/
record_weighing_states.py, run on commit dbf27d9). Each state is rebuilt through the backends'
own API (readings recorded, tickets admitted) and must give the same backend, reason, route,
saturated set, holder, estimate and admission, to the last bit of every float."""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pof_connector.index.base import NodeInfo
from pof_connector.locality.engine_load import EngineLoad
from pof_connector.locality.locator import Locality, NodeLocality
from pof_connector.router.backend import Backend
from pof_connector.router.router import Decision, Router
from pof_connector.router.router_config import RouterConfig

STATES = Path(__file__).parent / "data" / "weighing_states.jsonl"


class FixedLocator:
    def __init__(self, answer: Locality) -> None:
        self.answer = answer

    def locate(self, tokens: list[int], model: str | None = None, cache_salt: str | None = None) -> Locality:
        return self.answer


def load_of(fields: list[Any] | None) -> EngineLoad | None:
    if fields is None:
        return None
    running, waiting, usage, capacity, block, preemptions = fields
    return EngineLoad(running=running, waiting=waiting, kv_usage=usage, kv_capacity_tokens=capacity,
                      block_tokens=block, preemptions=preemptions)


def rebuild(b: Backend, running: int, waiting: int, waiting_tokens: int, load: EngineLoad | None, pending: int,
            preempting: bool) -> None:
    """Put ``b`` in the recorded state the way the router gets there: readings, then tickets."""
    if load is not None:
        if preempting:
            assert load.preemptions is not None
            b.record_load(EngineLoad(running=0, waiting=0, preemptions=load.preemptions - 1))
        b.record_load(load)
    for k in range(waiting):
        b.admit(waiting_tokens if k == 0 else 0, pending if k == 0 else 0)
    for k in range(running - waiting):
        t = b.admit(0, pending if k == 0 and waiting == 0 else 0)
        b.first_token(t)
    assert (b.running, b.waiting, b.waiting_tokens) == (running, waiting, waiting_tokens)
    assert b.pressure(1e12) == b.pressure(1e12).__class__(load, pending if load else 0, preempting)


def decision_json(d: Decision) -> dict[str, Any]:
    est, adm = d.estimate, d.admission
    return {"backend": d.backend.name, "reason": d.reason, "route": d.route, "saturated": list(d.saturated),
            "holder": d.holder, "pool_tokens": d.pool_tokens, "prompt_tokens": d.prompt_tokens,
            "estimate": None if est is None else [est.ttft_s, est.recompute_tokens, est.fetch_tokens, est.fetch_s,
                                                  list(est.features)],
            "admission": None if adm is None else [adm.need_blocks, adm.free_blocks, adm.saturated, adm.why,
                                                   adm.cost_s]}


def replay(state: dict[str, Any]) -> dict[str, Any]:
    cfg = state["config"]
    entries = [NodeLocality("*", e["page_tokens"], e["held"], e["engine_tokens"], e["usable"], e["near_tokens"],
                            load_of(e["load"]),
                            None if e["page_bytes"] is None else NodeInfo("x", meta={"page_bytes": e["page_bytes"]}))
               for e in state["entries"]]
    found = Locality("m", state["n_tokens"], 16, {name: entries[k] for name, k in state["where"].items()})
    router = Router(RouterConfig.from_mapping({
        "policy": "pof", "backends": [{"name": n, "url": f"http://{n}.invalid"} for n in cfg["backends"]],
        # recorded before moves were priced for what they displace: the rule then (weight 0);
        # test_weighing.py checks the weighing with it on
        "cost": {"displacement_weight": 0.0, **cfg["cost"]}, "capacity": cfg["capacity"]}), FixedLocator(found),
        # recorded before a node's progress on what it was sent counted: the rule then (no time passes)
        clock=lambda: 0.0)
    router.cost._theta = np.array(state["theta"])
    router.cost._coef = tuple(state["theta"])
    by_name = {b.name: b for b in router.backends}
    live = []
    for name, running, waiting, waiting_tokens, load, pending, preempting in state["backends"]:
        b = by_name[name]
        rebuild(b, running, waiting, waiting_tokens, load_of(load), pending, preempting)
        live.append(b)
    router._rr = itertools.count(state["offset"])
    return decision_json(router._by_cost(list(range(state["n_tokens"])), None, live, state["need"]))


@functools.cache
def states() -> list[dict[str, Any]]:
    with STATES.open() as f:
        return [json.loads(line) for line in f]


def test_the_recorded_states_cover_every_route() -> None:
    routes = {s["decision"]["route"] for s in states()}
    assert routes == {"prefix-holder", "lower-cost", "no-prefix", "holder-saturated:pool",
                      "holder-saturated:recompute", "all-saturated"}
    assert any(s["decision"]["saturated"] for s in states() if s["decision"]["route"] != "all-saturated")


@pytest.mark.parametrize("k", range(len(states())))
def test_the_router_decides_as_recorded(k: int) -> None:
    state = states()[k]
    assert replay(state) == state["decision"], state["source"]
