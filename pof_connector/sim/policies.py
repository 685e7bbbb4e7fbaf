"""The placement policies by name, each made fresh for a run."""

from __future__ import annotations

from collections.abc import Callable

from pof_connector.sim.base import Policy
from pof_connector.sim.cache_aware import CacheAware
from pof_connector.sim.pof_policy import PofPolicy
from pof_connector.sim.profile import Profile
from pof_connector.sim.round_robin import RoundRobin
from pof_connector.sim.static_affinity import StaticAffinity
from pof_connector.sim.workload import SimRequest, multi_turn_sessions

POLICIES = ("static", "round_robin", "cache_aware", "pof")


def policy_factory(name: str, profile: Profile, requests: list[SimRequest]) -> Callable[[], Policy]:
    if name == "static":
        multi = multi_turn_sessions(requests)
        return lambda: StaticAffinity(multi)
    if name == "round_robin":
        return RoundRobin
    if name == "cache_aware":
        return CacheAware
    if name == "pof":
        return lambda: PofPolicy(profile)
    raise ValueError(f"policy {name!r}: one of {', '.join(POLICIES)}")
