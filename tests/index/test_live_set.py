"""The live set a lookup counts (pof_connector.index.live_set)."""

from __future__ import annotations

from pof_connector.index.live_set import LiveSet


def at(ms: int) -> list[bytes]:
    """``TIME``'s reply at ``ms`` milliseconds."""
    return [str(ms // 1000).encode(), str(ms % 1000 * 1000).encode()]


def test_the_answer_is_reused_only_until_its_first_expiry() -> None:
    """The registry's reply repeats between heartbeats, so its parse is reused; a member whose
    lease ends while the reply stays the same must drop out all the same, and an earlier server
    time (a clock stepped back) must not reuse a later answer."""
    s = LiveSet()
    live = [[b"7", 5_000.0], [b"9", 9_000.0]]                 # RESP3: (member, expiry in ms)
    assert s.of(at(1_000), live).tolist() == [7, 9]
    assert s.of(at(4_999), live).tolist() == [7, 9]
    assert s.of(at(5_000), live).tolist() == [9]              # 7's lease ended, the reply unchanged
    assert s.of(at(4_000), live).tolist() == [7, 9]           # the clock stepped back
    assert s.of(at(9_000), live).tolist() == []
    assert s.of(at(4_000), [[b"7", 5_000.0]]).tolist() == [7]  # a new reply is parsed anew


def test_resp2_replies_and_bad_members() -> None:
    """RESP2 gives a flat list; incarnations outside 1..2^32-1 and repeats are not counted twice."""
    s = LiveSet()
    flat = [b"3", b"8000", b"0", b"8000", b"4294967296", b"8000", b"3", b"9000", b"2", b"100"]
    assert s.of(at(1_000), flat).tolist() == [3]
