from __future__ import annotations

import time

from pof_connector.pages.keys import PageKey
from pof_connector.tiers.slot_table import SlotTable


def key(i: int) -> PageKey:
    return PageKey(bytes(16), i.to_bytes(32, "little"))


def test_two_phase_store_and_lru() -> None:
    t = SlotTable(range(3))
    for i in range(3):
        got = t.prepare_store(key(i))
        assert got is not None and got[1] is None
        assert t.lookup(key(i)) is None           # pending pages are invisible
        t.complete_store(key(i), ok=True)
    assert t.prepare_store(key(1)) is None        # already stored
    t.lookup(key(0))                              # 0 becomes most recent; 1 is now the LRU page
    slot, evicted = t.prepare_store(key(3))       # type: ignore[misc]
    assert evicted == key(1) and t.lookup(key(1)) is None
    t.complete_store(key(3), ok=False)            # a failed write frees the slot again
    assert t.used == 2 and t.prepare_store(key(4)) == (slot, None)


def test_pinned_pages_are_not_evicted() -> None:
    t = SlotTable(range(2))
    for i in range(2):
        t.prepare_store(key(i))
        t.complete_store(key(i), ok=True)
    s0 = t.lookup(key(0), pin=True)
    s1 = t.lookup(key(1), pin=True)
    assert s0 is not None and s1 is not None
    assert not t.can_allocate() and t.prepare_store(key(2)) is None
    t.unpin(s0)
    got = t.prepare_store(key(2))
    assert got is not None and got[1] == key(0)


def test_lent_slots_are_used_never_evicted_and_taken_back() -> None:
    t = SlotTable(range(3))
    t.prepare_store(key(0))
    t.complete_store(key(0), ok=True)
    lent = t.lend(5)                                  # only free slots are lent: never our pages
    assert sorted(lent) == [1, 2] and t.used == 3 and t.lent == 2
    assert t.lend(1) == []
    got = t.prepare_store(key(1))                     # no free slot: our own LRU page makes room
    assert got is not None and got[1] == key(0) and got[0] not in lent
    assert t.take_back(lent[0]) and not t.take_back(lent[0]) and not t.take_back(got[0])
    assert t.lent == 1 and t.used == 2


def test_a_pinned_page_that_is_removed_keeps_its_slot_until_the_last_unpin() -> None:
    """The race in Placement._make_room: the victim is chosen unpinned, a reader pins it, then it is
    removed. The slot must not be reused under the reader."""
    t = SlotTable(range(2))
    for i in range(2):
        t.prepare_store(key(i))
        t.complete_store(key(i), ok=True)
    victim = t.victim()
    assert victim is not None and victim[0] == key(0)
    slot = t.lookup(key(0), pin=True)             # the reader, between victim choice and removal
    assert slot == victim[1]
    assert t.detach(key(0)) == (slot, True)      # removed while pinned: its bytes stay
    assert t.lookup(key(0)) is None and not t.contains(key(0))    # nobody else is offered it
    got = t.prepare_store(key(2))
    assert got is not None and got[0] != slot     # another page makes room; the reader's slot is kept
    t.complete_store(key(2), ok=True)
    assert t.used == 2
    assert t.unpin(slot) is True                  # the last reader is done: the tier invalidates it,
    t.release(slot)                               # then frees it
    assert t.used == 1
    got = t.prepare_store(key(3))
    assert got == (slot, None)


def test_give_takes_free_slots_first_then_cold_pages_and_adopt_takes_slots_in() -> None:
    t = SlotTable(range(4))
    for i in range(3):
        t.prepare_store(key(i))
        t.complete_store(key(i), ok=True)
    now = 100.0 + time.monotonic()
    assert t.coldest_age(now) == float("inf")        # a free slot: nothing need be evicted
    t.pin(t.lookup(key(0), touch=False))              # type: ignore[arg-type]  # a reader holds page 0
    slots, dropped = t.give(3, unused_for=50.0, now=now)
    assert len(slots) == 3 and [k for k, _ in dropped] == [key(1), key(2)]    # never the pinned one
    assert t.capacity == 1 and t.lookup(key(1)) is None and t.lookup(key(0)) is not None
    assert t.adopt(slots[:2]) == 2 and t.capacity == 3 and not t.needs_room()


def test_pages_used_lately_are_not_given() -> None:
    t = SlotTable(range(2))
    for i in range(2):
        t.prepare_store(key(i))
        t.complete_store(key(i), ok=True)
    now = time.monotonic()
    assert t.give(2, unused_for=10.0, now=now) == ([], [])
    age = t.coldest_age(now + 20.0)
    assert age is not None and 19.0 < age < 21.0
    unused = t.unused_for(key(0), now + 20.0)
    assert unused is not None and 19.0 < unused < 21.0 and t.unused_for(key(9), now) is None
