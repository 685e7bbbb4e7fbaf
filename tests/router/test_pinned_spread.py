"""A pinned prefix does not tie routing to one worker (issue 44): with ``replicas: 2`` a second
node copies the prefix, both hold it whole, and `pof router` spreads the prefix's concurrent
requests over them; with one copy that every node can load from the pool (a shared region), the
router spreads them too, the others loading it. Real pool nodes on a real Redis-protocol index,
the router's own choice (no engine: requests in flight are admitted on the backends as the proxy
does)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

import pytest

from pof_connector.index import redis_index
from pof_connector.index.server import RedisServer
from pof_connector.locality.locator import Locator
from pof_connector.pins.pin import HARD
from pof_connector.pins.pin_desk import PinDesk
from pof_connector.pool import Pool
from pof_connector.router.router import Router
from tests.router.pool_pair import pool_pair

PREFIX = list(range(7000, 7000 + 16 * 8))          # an organisation's system prompt: 8 pages


def wait_for(pred: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():        # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


@pytest.fixture
def fleet(redis_server: RedisServer, runtime_dir: str, shm_path: str) -> Iterator[tuple[Router, Pool, Pool, PinDesk]]:
    with pool_pair(redis_server.url, runtime_dir, shm_path, PREFIX, timeout_s=10.0) as (router, a, b):
        pins = redis_index(redis_server.url, None)
        try:
            yield router, a, b, PinDesk(pins, Locator(pins, nodes_ttl_s=0.0))
        finally:
            pins.close()


def spread(router: Router, n: int) -> tuple[Counter[str], Counter[str], Counter[str]]:
    """``n`` requests of the prefix (each its own tail) in flight at once: where they went, why,
    and the prefix tokens each backend was to load from the pool."""
    where: Counter[str] = Counter()
    why: Counter[str] = Counter()
    pooled: Counter[str] = Counter()
    for i in range(n):
        d = router.choose([*PREFIX, 90 + i, 91, 92], max_tokens=16)
        d.backend.admit(d.prefill_tokens, d.kv_blocks)       # sent, no first token yet
        where[d.backend.name] += 1
        why[d.route] += 1
        pooled[d.backend.name] += d.pool_tokens
    return where, why, pooled


def test_a_pin_with_two_replicas_spreads_its_requests_over_both_holders(
        fleet: tuple[Router, Pool, Pool, PinDesk]) -> None:
    router, _, b, desk = fleet
    desk.pin(PREFIX, model=None, cache_salt=None, ttl_s=600, kind=HARD, replicas=2)
    # b's heartbeat copied it; the copy counts its pages after they are stored, so wait for both
    wait_for(lambda: all(b.contains(k) for k in b.keys_for(PREFIX)) and b.stats.get("pin_copied_pages") == 8)
    assert b.stats.get("pin_copied_pages") == 8
    where, why, _ = spread(router, 8)
    assert where == {"a": 4, "b": 4}
    assert why == {"prefix-holder": 8}                # each went to a node holding the whole prefix


def test_one_copy_every_node_can_load_is_not_a_tie_to_its_holder(fleet: tuple[Router, Pool, Pool, PinDesk]) -> None:
    router, _, b, desk = fleet
    desk.pin(PREFIX, model=None, cache_salt=None, ttl_s=600, kind=HARD, replicas=1)
    where, why, pooled = spread(router, 8)
    assert where["a"] and where["b"], (where, why)
    # wherever it went, a request was to load the prefix from the pool (b: from a's shared region)
    assert pooled == {n: len(PREFIX) * k for n, k in where.items()}
    assert not any(b.contains(k) for k in b.keys_for(PREFIX))           # replicas 1: no copy was made
