"""`pof sim` with the router's displacement price at weight 0 and 1 (stop 57): the same workloads,
seed and profile as `pof sim sweep --profile h200` (250 requests a node). One JSON line per run.

    PYTHONPATH=. python docs/bench/issue47-sim-displacement-ab.py > issue47-sim-displacement-ab.jsonl
"""

import json
from typing import Any

from pof_connector.router.router_config import RouterConfig
from pof_connector.sim import pof_policy
from pof_connector.sim.mixes import make_mix
from pof_connector.sim.profile import Profile, load_profile
from pof_connector.sim.sim_run import run_sim

stock = pof_policy.router_config


def weighted(weight: float) -> Any:
    def config(profile: Profile, nodes: int, *, learn: bool = True) -> RouterConfig:
        c = stock(profile, nodes, learn=learn)
        return c.model_copy(update={"cost": c.cost.model_copy(update={"displacement_weight": weight})})
    return config


profile = load_profile("h200")
for mix, nodes in [("long-context", 8), ("long-context", 32), ("prefix-heavy", 8)]:
    requests = make_mix(mix, nodes=nodes, requests=250 * nodes, seed=0, kv_tokens=profile.kv_tokens)
    for weight in (0.0, 1.0):
        pof_policy.router_config = weighted(weight)     # PofPolicy.bind builds its router with it
        report = run_sim(profile, requests, nodes=nodes, policies=("static", "pof"))
        j = report.to_json()
        best = report.goodput["pof"].best
        print(json.dumps({"mix": mix, "nodes": nodes, "weight": weight, "ratio": report.ratio(),
                          "slo": j["slo_ttft_s"], "goodput": {k: v["goodput_rps"] for k, v in j["policies"].items()},
                          "pof_recomputed": best.counters.recomputed_tokens if best else None,
                          "pof_loaded": dict(best.loaded_bytes) if best else None}), flush=True)
