"""The owner's side of spill without NIXL: grants, leases, reclaims and the control messages."""

from __future__ import annotations

import time

import numpy as np

from pof_connector.fabric.slot_lender import SlotLender
from pof_connector.index import Location
from pof_connector.pages.keys import PageKey, page_keys
from pof_connector.pages.layout import PageSpec
from pof_connector.tiers import CpuDramTier

KEY = PageKey(bytes(16), bytes(range(32)))


def lender(spec: PageSpec, slots: int, lease_s: float = 0.2, known: str = "pof/b/1") -> tuple[SlotLender, CpuDramTier]:
    tier = CpuDramTier(spec, slots * (spec.page_bytes + 64))
    return SlotLender("m", [tier], lease_s, 0.05, lambda node, agent: (node, agent) == ("b", known)), tier


def test_grant_renew_release_and_reclaim(spec: PageSpec) -> None:
    owner, tier = lender(spec, 4)
    assert owner.can_grant("cpu_dram", 4) and not owner.can_grant("cpu_dram", 5) and not owner.can_grant("cxl")
    got = owner.grant("b", "cpu_dram", 3, lease_s=60)        # the writer asks for more than the owner allows
    assert len(got) == 3 and all(gen == 1 for _, gen in got) and tier.free_slots == 1
    assert owner.usage() == {"cpu_dram": (3, 1)}
    slots = [s for s, _ in got]
    assert owner.renew("c", "cpu_dram", slots, 60) == []      # not c's lease
    assert owner.release("b", "cpu_dram", slots[:1]) == 1 and tier.free_slots == 2
    time.sleep(0.15)
    assert sorted(owner.renew("b", "cpu_dram", slots, 60)) == sorted(slots[1:])
    time.sleep(0.15)                                          # 0.3 s > lease 0.2 + grace 0.05: renewed in time
    assert owner.reclaim_expired() == [] and tier.free_slots == 2
    assert owner.written("b", "cpu_dram", [(slots[1], KEY)]) == 1
    assert owner.written("c", "cpu_dram", [(slots[2], KEY)]) == 0            # not c's slot
    time.sleep(0.2)
    gone = owner.reclaim_expired()                        # the entry b published for slots[1] is withdrawn
    assert gone == [(KEY, Location("m", "cpu_dram", slots[1], 1))]
    assert tier.free_slots == 4 and owner.usage() == {"cpu_dram": (0, 0)}
    again = owner.grant("b", "cpu_dram", 1, 60)               # a reclaimed slot comes back with a new generation
    assert again and again[0][1] >= 2


def test_full_owner_grants_nothing_and_keeps_its_pages(spec: PageSpec) -> None:
    owner, tier = lender(spec, 2)
    own = PageKey(bytes(16), bytes(32))
    got = tier.prepare_store(own)
    assert got is not None
    tier.write(got[0], own, [np.zeros(spec.segment_bytes, np.uint8)] * spec.num_layers)
    tier.complete_store(own, ok=True)
    assert len(owner.grant("b", "cpu_dram", 2, 60)) == 1          # the free slot only
    assert owner.grant("b", "cpu_dram", 1, 60) == [] and not owner.can_grant("cpu_dram")
    assert tier.find(own) is not None


def test_messages(spec: PageSpec) -> None:
    owner, _ = lender(spec, 4)
    grant = {"op": "grant", "node": "b", "medium": "cpu_dram", "n": 2, "lease_s": 0.1, "id": 1}
    reply = owner.handle("pof/b/1", grant)
    assert reply is not None and len(reply["slots"]) == 2 and reply["lease_s"] == 0.1
    assert owner.handle("pof/b/OLD", grant) is None           # not b's current agent: no answer
    assert owner.handle("pof/b/1", {**grant, "n": "2"}) is None
    assert owner.handle("pof/b/1", {"op": "format", "node": "b", "medium": "cpu_dram"}) is None
    slots = [s for s, _ in reply["slots"]]
    assert owner.handle("pof/b/1", {"op": "renew", "node": "b", "medium": "cpu_dram", "slots": slots}) == {
        "slots": slots, "lease_s": 0.2}
    written = {"op": "written", "node": "b", "medium": "cpu_dram", "pages": [[slots[0], "00" * 16, "11" * 32], "x"]}
    assert owner.handle("pof/b/1", written) == {"written": 1}
    # A key with its place: the owner withdraws it from the index's segment the writer published it to.
    placed = page_keys(bytes(16), list(range(16 * 20)), 16)[19]
    written["pages"] = [[slots[1], *placed.wire()], [slots[1], "00" * 16, "11" * 32, 19, "zz"]]
    assert owner.handle("pof/b/1", written) == {"written": 1}
    owner._leases[("cpu_dram", slots[1])].expires = 0
    gone = owner.reclaim_expired()
    assert [k for k, _ in gone] == [placed] and gone[0][0].place == placed.place
    assert owner.handle("pof/b/1", {"op": "release", "node": "b", "medium": "cpu_dram", "slots": slots}) == {
        "released": 1}                                        # slots[1] was reclaimed


def test_a_writer_refuses_grant_replies_outside_the_owners_region() -> None:
    """A hostile or broken owner's grant reply: nothing is written to a slot outside its region."""
    from pof_connector.fabric.spill_writer import _granted
    assert _granted({"slots": [[0, 1], [7, 3]], "lease_s": 5.0}, 8) == [(0, 1), (7, 3)]
    assert _granted({"slots": [], "lease_s": 5.0}, 8) == []                        # full
    for bad in ({"slots": [[8, 1]], "lease_s": 5.0}, {"slots": [[-1, 1]], "lease_s": 5.0},
                {"slots": [[0, 0]], "lease_s": 5.0}, {"slots": [[0]], "lease_s": 5.0},
                {"slots": [[0, "1"]], "lease_s": 5.0}, {"slots": [[True, 1]], "lease_s": 5.0},
                {"slots": [[0, 1]], "lease_s": float("nan")}, {"slots": [[0, 1]], "lease_s": -1},
                {"slots": "all", "lease_s": 5.0}, {"slots": [[0, 1]]}):
        assert _granted(bad, 8) is None, bad


def test_a_writer_holds_at_most_its_share(spec: PageSpec) -> None:
    tier = CpuDramTier(spec, 10 * (spec.page_bytes + 64))
    owner = SlotLender("m", [tier], 5.0, 0.05, lambda node, agent: True, max_lent_fraction=0.3)
    assert len(owner.grant("b", "cpu_dram", 100, 60)) == 3 and owner.grant("b", "cpu_dram", 1, 60) == []
    assert len(owner.grant("c", "cpu_dram", 100, 60)) == 3                  # each writer its own share
    assert owner.refused["writer_cap"] == 1 and tier.free_slots == 4
