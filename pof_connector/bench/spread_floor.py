"""The least KV-usage spread any placement of the requests running at one instant could have.

The capacity bench's fragmentation figure is the spread ``max - min`` of the servers'
``vllm:kv_cache_usage_perc``. Part of it is placement (static hashing filling one server), part is
granularity: a request's KV cannot be split between servers, so one 17K-token conversation filling
83 % of a server leaves a spread of 0.83 whoever places it. :func:`spread_floor` separates the two
from what one scrape of each server says (its usage and its running requests):

- a server running exactly one request shows that request's size: an item that goes whole to
  one server;
- a server running several (or none, holding blocks for a request it has not started) shows only
  their sum: counted as fluid, free to be split anywhere, which can only lower the floor.

The floor is the least spread over every assignment of the whole items to servers, the fluid then
poured into the emptiest. It is a lower bound for the requests that were running then: a different
placement would have run other requests at that instant (faster or slower), which no scrape shows.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

MAX_ITEMS = 8
"""Whole items placed by exhaustive search (servers being alike, the placements up to renaming
them: at most Bell(8) = 4,140, whatever the number of servers); past this, the largest
``MAX_ITEMS`` stay whole and the rest count as fluid (still a lower bound)."""


def spread_floor(usage: Sequence[float], running: Sequence[int]) -> float:
    """The least ``max - min`` usage over the servers for any placement of the running requests
    (``usage[i]``, ``running[i]``: server ``i``'s usage, 0-1, and running requests in one scrape).
    0.0 for fewer than two servers."""
    if len(usage) != len(running):
        raise ValueError(f"usage has {len(usage)} servers, running {len(running)}")
    servers = len(usage)
    if servers < 2:
        return 0.0
    whole = sorted((u for u, r in zip(usage, running, strict=True) if r == 1 and u > 0.0), reverse=True)
    fluid = sum(u for u, r in zip(usage, running, strict=True) if r != 1 and u > 0.0) + sum(whole[MAX_ITEMS:])
    return min(_poured(loads, fluid) for loads in _placements(whole[:MAX_ITEMS], servers))


def _placements(items: list[float], servers: int) -> Iterator[list[float]]:
    """Every server's load for each placement of ``items``, up to renaming the servers: item ``k``
    goes to a server already holding one, or to the first empty one."""
    loads = [0.0] * servers

    def place(k: int, used: int) -> Iterator[list[float]]:
        if k == len(items):
            yield loads
            return
        for i in range(min(used + 1, servers)):
            loads[i] += items[k]
            yield from place(k + 1, max(used, i + 1))
            loads[i] -= items[k]

    yield from place(0, 0)


def _poured(loads: list[float], fluid: float) -> float:
    """The spread of ``loads`` once ``fluid`` is poured into the emptiest servers (water filling:
    it raises the lowest to a common level, never the highest above the rest)."""
    levels = sorted(loads)
    below = 0.0                                  # the k lowest levels summed
    for k in range(1, len(levels)):
        below += levels[k - 1]
        if levels[k] * k - below >= fluid:       # the fluid raises the k lowest, not to the next one up
            return levels[-1] - (fluid + below) / k
    return 0.0                                   # every server reaches the top: the rest spreads evenly
