"""The one reachability rule (pof_connector.index.reach), as Pool.lookup and the locator use it.

One table, cases taken from both call sites: a row gives the index's runs (holder, first page,
media of its pages), what ``me`` reads of each holder (plain loads / fabric), and the expected
leading sources (holder and medium, ``*`` marks a fabric read) and ``elsewhere``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest

from pof_connector.index import LOOKUP_ROUNDS, MEDIA, Location, PrefixMatch
from pof_connector.index.reach import Run, gather_runs, reach
from pof_connector.pages.keys import DIGEST_BYTES, NAMESPACE_BYTES, PageKey


def run(node: str, at: int, *media: str) -> Run:
    codes = np.array([MEDIA.index(m) for m in media], dtype=np.uint8)
    return at, PrefixMatch(node, codes, np.arange(at, at + len(media)), np.ones(len(media), dtype=np.int64))


Case = tuple[list[Run], Mapping[str, list[str]], Mapping[str, list[str]], int, list[str], dict[str, int]]
CASES: dict[str, Case] = {
    # Pool.lookup: pages of a node sharing our CXL region are read with plain loads.
    "shared_cxl": ([run("b", 0, "cxl", "cxl")], {"b": ["cxl"]}, {}, 0, ["b:cxl", "b:cxl"], {}),
    # Pool.lookup: a tier not shared and no fabric: nothing loadable, the router learns of it.
    "not_shared_is_elsewhere": ([run("b", 0, "cpu_dram", "cpu_dram")], {"b": ["cxl"]}, {}, 0, [], {"b": 2}),
    # Pool.lookup: a chain's head in our own tiers (found first), its tail in a shared region.
    "own_head_shared_tail": ([run("b", 0, "cxl", "cxl", "cxl")], {"b": ["cxl"]}, {}, 1,
                             ["me:cpu_dram", "b:cxl", "b:cxl"], {}),
    # Pool.lookup, fabric: another node's DRAM over NIXL.
    "fabric": ([run("b", 0, "cpu_dram", "cpu_dram")], {}, {"b": ["cpu_dram"]}, 0, ["*b:cpu_dram", "*b:cpu_dram"], {}),
    # Both: the part of a run past the first unreadable page is reported elsewhere, the head is loaded.
    "run_stops_at_unreadable_page": ([run("b", 0, "cxl", "cpu_dram", "cxl")], {"b": ["cxl"]}, {}, 0,
                                     ["b:cxl"], {"b": 3}),
    # Both: a later round's run (a spilled tail, asked for from page 2) continues the chain.
    "later_round_continues": ([run("b", 0, "cxl", "cxl"), run("c", 2, "cxl", "cxl")], {"b": ["cxl"], "c": ["cxl"]},
                              {}, 0, ["b:cxl", "b:cxl", "c:cxl", "c:cxl"], {}),
    # Locator: own pages first, whatever order the index answered in.
    "own_first": ([run("b", 0, "cxl", "cxl"), run("me", 0, "cpu_dram")], {"b": ["cxl"]}, {}, 0,
                  ["me:cpu_dram", "b:cxl"], {}),
    # Locator: a page read with plain loads is preferred to one over the fabric, page by page.
    "near_before_far": ([run("b", 0, "cpu_dram", "cpu_dram", "cpu_dram"), run("c", 0, "cxl")],
                        {"c": ["cxl"]}, {"b": ["cpu_dram"]}, 0, ["c:cxl", "*b:cpu_dram", "*b:cpu_dram"], {}),
    # Locator: an engine's prefix cache is never loadable, even if someone claims to read it.
    "engine_never": ([run("b:engine", 0, "engine", "engine")], {"b:engine": ["engine"]}, {"b:engine": ["engine"]},
                     0, [], {"b:engine": 2}),
    # Both: the run ends at the first page nobody readable holds, even if later pages are readable.
    "gap_ends_the_run": ([run("b", 0, "cxl"), run("c", 2, "cxl")], {"b": ["cxl"], "c": ["cxl"]}, {}, 0,
                         ["b:cxl"], {}),
    # Pool.lookup: nothing in the index, only our own pages.
    "own_only": ([], {}, {}, 2, ["me:cpu_dram", "me:cpu_dram"], {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_reach_table(name: str) -> None:
    runs, near, far, own_pages, expected, elsewhere = CASES[name]
    own = [Location("me", "cpu_dram", i, 1) for i in range(own_pages)]
    got = reach("me", runs, near=near, far=far, own=own)
    shown = [("*" if f else "") + f"{s.node}:{s.medium}" for s, f in zip(got.sources, got.fabric, strict=True)]
    assert shown == expected
    assert got.elsewhere == elsewhere
    assert got.near_pages == next((i for i, s in enumerate(expected) if s.startswith("*")), len(expected))


def test_sources_are_the_holders_slots() -> None:
    """The loader reads page ``i`` from its holder's slot and generation for that page."""
    got = reach("me", [run("b", 0, "cxl"), run("c", 1, "cxl", "cxl")], near={"b": ["cxl"], "c": ["cxl"]}, far={})
    assert got.sources == [Location("b", "cxl", 0, 1), Location("c", "cxl", 1, 1), Location("c", "cxl", 2, 1)]


def test_length_bounds_the_answer() -> None:
    got = reach("me", [run("b", 0, "cxl", "cxl", "cxl")], near={"b": ["cxl"]}, far={}, length=2)
    assert got.pages == 2


def keys(n: int) -> list[PageKey]:
    return [PageKey(bytes(NAMESPACE_BYTES), bytes([i]) * DIGEST_BYTES) for i in range(n)]


def test_gather_runs_asks_again_from_where_the_runs_stop() -> None:
    """A chain over several holders in a row is asked for again from the covered page (both call sites)."""
    ks = keys(6)
    holders = {0: run("b", 0, "cxl", "cxl")[1], 2: run("c", 0, "cxl", "cxl", "cxl")[1], 5: run("d", 0, "cxl")[1]}
    asked: list[int] = []

    def ask(q: list[PageKey]) -> dict[str, PrefixMatch]:
        asked.append(len(ks) - len(q))
        m = holders.get(len(ks) - len(q))
        return {} if m is None else {m.node: m}

    runs = gather_runs(ks, ask, lambda rs: max(at + m.pages for at, m in rs))
    assert asked == [0, 2, 5] and [(at, m.node) for at, m in runs] == [(0, "b"), (2, "c"), (5, "d")]


def test_gather_runs_stops_without_progress_and_after_the_last_round() -> None:
    ks = keys(2 * LOOKUP_ROUNDS + 2)
    asked: list[int] = []

    def ask(q: list[PageKey]) -> dict[str, PrefixMatch]:
        asked.append(len(ks) - len(q))
        return {"b": run("b", 0, "cxl")[1]}

    gather_runs(ks, ask, lambda rs: 1)          # covers page 0 only: no progress after round 1
    assert asked == [0, 1]
    asked.clear()
    gather_runs(ks, ask, lambda rs: len(rs))    # one more page per round
    assert asked == list(range(LOOKUP_ROUNDS))
    assert gather_runs([], ask, lambda rs: 0) == []
    asked.clear()
    assert gather_runs(ks, lambda q: asked.append(0) or {}, lambda rs: 1 / 0) == [] and asked == [0]
