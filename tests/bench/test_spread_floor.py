"""The spread floor: the least KV-usage spread any placement of the running requests could have."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pof_connector.bench.spread_floor import spread_floor


def best_spread(sizes: list[float], servers: int) -> float:
    """The least max - min over every placement of whole requests (the brute force the floor bounds)."""
    best = float("inf")
    for places in itertools.product(range(servers), repeat=len(sizes)):
        loads = [0.0] * servers
        for size, i in zip(sizes, places, strict=True):
            loads[i] += size
        best = min(best, max(loads) - min(loads))
    return best


def scrape(sizes: list[float], places: list[int], servers: int) -> tuple[list[float], list[int]]:
    """What each server's metrics say when request ``k`` of ``sizes`` runs on ``places[k]``."""
    usage, running = [0.0] * servers, [0] * servers
    for size, i in zip(sizes, places, strict=True):
        usage[i] += size
        running[i] += 1
    return usage, running


def test_one_long_request_leaves_its_size_whoever_places_it() -> None:
    assert spread_floor([0.83, 0.0], [1, 0]) == pytest.approx(0.83)
    assert spread_floor([0.0, 0.83], [0, 1]) == pytest.approx(0.83)


def test_requests_piled_on_one_server_could_have_been_split() -> None:
    # 0.6 on one server from two requests: sizes unknown, counted as divisible
    assert spread_floor([0.6, 0.0], [2, 0]) == 0.0
    # one whole 0.5 and 0.2 of divisible beside it: the 0.2 goes to the other server
    assert spread_floor([0.5, 0.2], [1, 3]) == pytest.approx(0.3)
    # two whole requests, one per server: moving either makes it worse
    assert spread_floor([0.7, 0.2], [1, 1]) == pytest.approx(0.5)
    assert spread_floor([0.7, 0.2], [2, 1]) == 0.0       # the 0.7 is two requests: some of it can move


def test_three_servers_pour_into_the_two_emptiest() -> None:
    # whole 0.9; 0.4 divisible: 0.2 on each of the others leaves 0.7
    assert spread_floor([0.9, 0.4, 0.0], [1, 2, 0]) == pytest.approx(0.7)
    assert spread_floor([0.3, 0.3, 0.3], [1, 1, 1]) == pytest.approx(0.0)
    assert spread_floor([0.5], [1]) == 0.0
    with pytest.raises(ValueError, match="usage has 2 servers, running 1"):
        spread_floor([0.5, 0.1], [1])


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 3).flatmap(lambda n: st.tuples(
    st.just(n), st.lists(st.tuples(st.floats(0.01, 0.9), st.integers(0, n - 1)), max_size=6))))
def test_the_floor_bounds_every_placement_and_is_exact_with_one_request_per_server(
        case: tuple[int, list[tuple[float, int]]]) -> None:
    servers, requests = case
    sizes, places = [s for s, _ in requests], [p for _, p in requests]
    usage, running = scrape(sizes, places, servers)
    floor = spread_floor(usage, running)
    assert floor <= max(usage) - min(usage) + 1e-9              # the placement that ran
    assert floor <= best_spread(sizes, servers) + 1e-9          # and the best one of the same requests
    if max(running) <= 1:                                       # every size seen: nothing is a guess
        assert floor == pytest.approx(best_spread(sizes, servers))


def test_many_servers_and_many_requests_stay_cheap() -> None:
    # 64 servers, 20 lone requests of 0.5: the search places 8 whole (up to renaming servers, not
    # 64^8 ways), the other 6.0 pours over the 56 emptiest; the true least spread is 0.5
    usage = [0.5] * 20 + [0.0] * 44
    assert spread_floor(usage, [1] * 20 + [0] * 44) == pytest.approx(0.5 - 6.0 / 56)
    assert spread_floor([0.4, 0.4, 0.1], [1, 1, 5]) == pytest.approx(0.3)
