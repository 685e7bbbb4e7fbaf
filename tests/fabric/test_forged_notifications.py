"""The forged-notification test: a lender's spill control messages, sent over real NIXL agents
(UCX over TCP loopback, three agents in this process: lender M, writer B, attacker X).

Malformed, forged and out-of-bounds messages are refused and counted, none takes a slot or
touches another writer's lease, a reply from an agent the request was not sent to is not taken,
one writer cannot take more than its share of M's slots, and M goes on serving B.

The ``live`` map stands in for the index's live node list that a pool's lender authorizes against
(:meth:`pof_connector.fabric.node.FabricNode.start`: a node's current agent, as it publishes it).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pof_connector.config import FabricConfig
from pof_connector.fabric import nixl_installed
from pof_connector.fabric.agent import NixlAgent
from pof_connector.fabric.notifier import PREFIX, Notifier
from pof_connector.fabric.slot_lender import SlotLender
from pof_connector.pages.layout import PageSpec
from pof_connector.tiers import CpuDramTier

pytestmark = [pytest.mark.nixl,
              pytest.mark.skipif(not nixl_installed(),
                                 reason="NIXL is not installed (pip install --no-deps nixl-cu13==1.5.1)")]

SPEC = PageSpec(num_layers=2, segment_bytes=1024, page_tokens=16)
SLOTS = 8


def wait_for(pred: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout}s"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def agents() -> Iterator[dict[str, NixlAgent]]:
    cfg = FabricConfig(enabled=True, tls="tcp", ucx_devices="lo")
    made = {n: NixlAgent(f"pof/{n}/1", cfg) for n in ("m", "b", "x")}
    try:
        for a in made.values():
            for other in made.values():
                if other is not a:
                    a.add_peer(other.metadata())
        yield made
    finally:
        for a in made.values():
            a.close()


def raw(agent: NixlAgent, to: str, message: Any) -> None:
    body = message if isinstance(message, bytes) else json.dumps(message).encode()
    agent.send_notif(to, PREFIX + body)


def test_forged_and_malformed_notifications_are_refused(agents: dict[str, NixlAgent]) -> None:
    m, b, x = agents["m"], agents["b"], agents["x"]
    live = {"b": b.name, "c": "pof/c/1"}                   # the index's live pool nodes; X is none of them
    tier = CpuDramTier(SPEC, SLOTS * (SPEC.page_bytes + 64))
    lender = SlotLender("m", [tier], 5.0, 0.5, lambda node, agent: live.get(node) == agent, max_lent_fraction=0.5)
    m_notes = Notifier(m, lender.handle)
    b_notes = Notifier(b, None)
    try:
        grant = {"op": "grant", "node": "b", "medium": "cpu_dram", "n": 2, "lease_s": 5.0}
        reply = b_notes.request(m.name, grant, 5.0)
        assert reply is not None and len(reply["slots"]) == 2
        b_slots = [s for s, _ in reply["slots"]]
        c_slots = [s for s, _ in lender.grant("c", "cpu_dram", 2, 5.0)]   # another writer's leases

        # Not even a message: the notifier refuses it.
        for junk in (b"\xff\xfe", b"[1, 2]", b"[" * 100_000, b'"grant"'):
            raw(x, m.name, junk)
        # Not from a live pool node's current agent.
        for forged in ({**grant, "node": "x"}, grant,
                       {"op": "renew", "node": "b", "medium": "cpu_dram", "slots": b_slots},
                       {"op": "release", "node": "b", "medium": "cpu_dram", "slots": b_slots}):
            raw(x, m.name, forged)
        # From B, but malformed.
        malformed = [{**grant, "n": -5}, {**grant, "n": "2"}, {**grant, "n": True}, {**grant, "n": 0},
                     {**grant, "lease_s": float("nan")}, {**grant, "lease_s": -1}, {**grant, "lease_s": float("inf")},
                     {**grant, "medium": "nope"}, {**grant, "op": "format"}, {**grant, "node": 7},
                     {"op": "renew", "node": "b", "medium": "cpu_dram", "slots": "all"},
                     {"op": "release", "node": "b", "medium": "cpu_dram", "slots": [1.5]},
                     {"op": "release", "node": "b", "medium": "cpu_dram", "slots": list(range(5000))},
                     {"op": "written", "node": "b", "medium": "cpu_dram", "pages": "x"}]
        for bad in malformed:
            raw(b, m.name, bad)
        # From B, naming slots that are not its leases (C's, outside the tier).
        others = [*c_slots, -1, 10**12]
        for op in ("renew", "release"):
            raw(b, m.name, {"op": op, "node": "b", "medium": "cpu_dram", "slots": others})
        raw(b, m.name, {"op": "written", "node": "b", "medium": "cpu_dram",
                        "pages": [[c_slots[0], "00" * 16, "11" * 32], [10**12, "00" * 16, "11" * 32]]})

        wait_for(lambda: m_notes.refused["malformed"] >= 4 and lender.refused["unauthorized"] >= 4
                 and lender.refused["malformed"] >= len(malformed) and lender.refused["not_leased"] >= 10,
                 "every forged message refused")
        assert m_notes.refused == {"malformed": 4, "forged_reply": 0, "handler_error": 0}
        assert lender.refused == {"malformed": len(malformed), "unauthorized": 4, "not_leased": 10, "writer_cap": 0}
        assert lender.usage() == {"cpu_dram": (4, 2)} and tier.free_slots == SLOTS - 4   # none taken, none freed

        # A reply from an agent the request was not sent to is not taken: B asks X (which never
        # answers) while M answers in X's place.
        got: list[Any] = []
        asking = threading.Thread(target=lambda: got.append(b_notes.request(x.name, grant, 1.0)))
        asking.start()
        while asking.is_alive():
            for rid in range(1, 40):
                raw(m, b.name, {"op": "reply", "id": rid, "slots": [[0, 1]], "lease_s": 5.0})
            time.sleep(0.05)
        assert got == [None] and b_notes.refused["forged_reply"] >= 1

        # One writer holds at most its share of M's slots (half of 8 here).
        more = b_notes.request(m.name, {**grant, "n": 10**30}, 5.0)
        assert more is not None and len(more["slots"]) == 2                # 2 + 2 = its share of 4
        b_slots += [s for s, _ in more["slots"]]
        capped = b_notes.request(m.name, grant, 5.0)
        assert capped is not None and capped["slots"] == []                # the writer backs off as from a full node
        assert lender.refused["writer_cap"] == 1

        # M still serves B: renew, written, release of its own slots.
        renew = {"op": "renew", "node": "b", "medium": "cpu_dram", "slots": b_slots, "lease_s": 5.0}
        got_renew = b_notes.request(m.name, renew, 5.0)
        assert got_renew is not None and sorted(got_renew["slots"]) == sorted(b_slots)
        written = {"op": "written", "node": "b", "medium": "cpu_dram", "pages": [[b_slots[0], "00" * 16, "22" * 32]]}
        assert (b_notes.request(m.name, written, 5.0) or {}).get("written") == 1
        release = {"op": "release", "node": "b", "medium": "cpu_dram", "slots": b_slots}
        assert (b_notes.request(m.name, release, 5.0) or {}).get("released") == 4
        assert lender.usage() == {"cpu_dram": (2, 1)}                       # C's leases untouched
        assert m_notes._thread.is_alive() and b_notes._thread.is_alive()
    finally:
        b_notes.close()
        m_notes.close()
        lender.reclaim_all()
