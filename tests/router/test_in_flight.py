"""Prefixes in flight: a request the router sent and has not seen end holds its prompt's pages in
its engine (computed by its prefill, which comes first in that node's queue), before the node's
relay tells the index. A second request of a new system prompt, sent while the first still computed
it, saw no holder and recomputed the whole prompt on the other node (issue 42, dear workload:
request 5, the hot tenant's second, took 2.0-3.2 s through pof, 0.8 s through power_of_two when it
followed the first). The clock is the router's own, so the tests set the time."""

from __future__ import annotations

from pof_connector.locality.locator import Locality
from pof_connector.router.backend import Backend
from pof_connector.router.router import Router
from pof_connector.router.router_config import BackendConfig, RouterConfig

PAGE = 16
S_PER_TOKEN = 1e-3


def chain(tenant: str, pages: int, user: str = "") -> tuple[bytes, ...]:
    """Page digests of a prompt: ``pages`` pages of ``tenant``'s system prompt, then one of
    ``user``'s own words (chained: a digest stands for everything before it)."""
    out = tuple(f"{tenant}/{i}".encode() for i in range(pages))
    return out + ((f"{tenant}/{user}".encode(),) if user else ())


class ChainLocator:
    """The index holds nothing of any prompt (its first request is still computing it); the
    prompt's page digests are given by the test."""

    def __init__(self) -> None:
        self.chain: tuple[bytes, ...] = ()

    def locate(self, tokens: list[int], model: str | None = None, cache_salt: str | None = None) -> Locality:
        return Locality("m", len(tokens), PAGE, {}, self.chain)


def test_a_backend_counts_the_leading_pages_its_live_requests_share() -> None:
    b = Backend(BackendConfig(name="a", url="http://a.invalid"), 3)
    assert b.in_flight_tokens(chain("t", 8, "u1"), PAGE) == 0
    first = b.admit(200, chain=chain("t", 8, "u1"))
    second = b.admit(200, chain=chain("t", 4, "u2"))
    assert b.in_flight_tokens(chain("t", 8, "u3"), PAGE) == 8 * PAGE       # all the system prompt, not u3
    assert b.in_flight_tokens(chain("t", 8, "u1"), PAGE) == 9 * PAGE
    assert b.in_flight_tokens(chain("other", 8), PAGE) == 0
    b.first_token(first)
    assert b.in_flight_tokens(chain("t", 8, "u3"), PAGE) == 8 * PAGE       # running: its KV is still there
    b.finish(first)
    assert b.in_flight_tokens(chain("t", 8, "u3"), PAGE) == 4 * PAGE       # the second's four pages remain
    b.finish(second)
    assert b.in_flight_tokens(chain("t", 8, "u3"), PAGE) == 0
    b.finish(second)                                                        # twice: nothing counted twice
    assert b.in_flight_tokens(chain("t", 4), PAGE) == 0


def test_the_second_request_of_a_new_prompt_follows_the_first_while_it_computes() -> None:
    clock = [0.0]
    locator = ChainLocator()
    router = Router(RouterConfig.from_mapping({
        "policy": "pof", "backends": [{"name": "a", "url": "http://a.invalid"}, {"name": "b", "url": "http://b.invalid"}],
        "cost": {"prefill_s_per_token": S_PER_TOKEN, "request_overhead_s": 0.02, "learn": False}}),
        locator, clock=lambda: clock[0])
    a, b = router.backends
    prompt = list(range(75 * PAGE + 8))                 # 75 pages of system prompt, then the user's words
    locator.chain = chain("t", 75, "u1")
    first = router.choose(prompt)
    assert first.route == "no-prefix" and first.chain == locator.chain
    holder = first.backend
    ticket = holder.admit(first.prefill_tokens, first.kv_blocks, first.chain)
    other = b if holder is a else a
    clock[0] = 0.7                                      # 1,208 tokens begun at 0: about 500 left
    locator.chain = chain("t", 75, "u2")
    second = router.choose(prompt)
    # the holder: ~500 queued + 8 of its own (plus one page: the engine computes the last token)
    # against 1,208 recomputed on the idle node
    assert second.backend is holder, second
    assert second.route == "prefix-holder" and second.holder == holder.name
    assert second.estimate is not None and second.estimate.recompute_tokens == 8
    assert second.estimate.queued_tokens == 508
    # without the request in flight, the idle node: the engine would have had to recompute it
    holder.finish(ticket)
    holder.admit(first.prefill_tokens)                  # the same load, its prompt not known
    third = router.choose(prompt)
    assert third.backend is other and third.route == "no-prefix", third
