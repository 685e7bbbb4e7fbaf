"""Tenant isolation end to end, without an engine (the engines' own salt handling is tested in
tests/adapters/test_vllm_safety.py): tenant A's pages are stored with A's ``cache_salt`` in real
tiers, listed in a real Redis-protocol index. A request without A's salt (none, or tenant B's)
can neither hit them nor tell they exist through the locality API, `pof router`'s answer headers,
or the relay's event stream (a prefix-probing side channel is a known attack on shared caches)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pof_connector.index.redis import RedisIndex
from pof_connector.index.server import RedisServer
from pof_connector.locality.api import make_app as locality_app
from pof_connector.locality.locator import Locator
from pof_connector.pages.keys import PageKey, page_keys
from pof_connector.relay.kv_events import BlockStored, encode_batch
from pof_connector.router.proxy import make_app as router_app
from pof_connector.router.serve import build
from tests.locality.test_api import NS, node
from tests.relay.conftest import ctx  # noqa: F401  (fixture)
from tests.relay.test_relay import Harness, cpu, engine_pages, stored, wait_for
from tests.router.test_proxy import SEG, StandInEngine, engines, router_config  # noqa: F401  (fixture)

SALT_A, SALT_B = "tenant-a-secret-salt", "tenant-b-salt"
PAGES = 4
A_PROMPT = list(range(7000, 7000 + 16 * PAGES))
NEVER_SEEN = list(range(9000, 9000 + 16 * PAGES))
PROBES = [{}, {"cache_salt": SALT_B}]
"""What another tenant can send with A's tokens: no salt, or its own."""


@pytest.fixture
def index(redis_server: RedisServer) -> Iterator[RedisIndex]:
    reader = RedisIndex(redis_server.url, None)
    yield reader
    reader.close()


@pytest.fixture
def tenant_a(redis_server: RedisServer, runtime_dir: str, index: RedisIndex) -> Iterator[Any]:
    """Pool node "a" holding A's prompt, stored with A's salt."""
    pool = node("a", redis_server.url, runtime_dir)
    pool.store([(k, SEG) for k in pool.keys_for(A_PROMPT, cache_salt=SALT_A)]).result()
    wait_for(lambda: Locator(index).locate(A_PROMPT, cache_salt=SALT_A).nodes.get("a") is not None,
             what="A's pages in the index")
    yield pool
    pool.close()


def test_the_locality_api_shows_a_tenants_pages_only_with_its_salt(tenant_a: Any, index: RedisIndex) -> None:
    client = TestClient(locality_app(index))
    own = client.post("/v1/locality", json={"tokens": A_PROMPT, "cache_salt": SALT_A}).json()
    assert own["nodes"][0]["matched_tokens"] == len(A_PROMPT)
    for probe in PROBES:
        seen = client.post("/v1/locality", json={"tokens": A_PROMPT, **probe})
        fresh = client.post("/v1/locality", json={"tokens": NEVER_SEEN, **probe})
        assert seen.status_code == fresh.status_code == 200
        assert seen.json() == fresh.json() and seen.json()["nodes"] == [], (probe, seen.text)
        assert {k: v for k, v in seen.headers.items() if k != "date"} == \
            {k: v for k, v in fresh.headers.items() if k != "date"}


def answer_headers(client: TestClient, prompt: list[int], **kw: Any) -> dict[str, str]:
    r = client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 4, **kw})
    assert r.status_code == 200, r.text
    # x-pof-router-overhead is a timing, like the TTFT the client measures anyway: it differs per request
    timings = ("x-pof-router-overhead", "x-pof-router-stages")     # per-stage timings, ditto
    return {k: v for k, v in r.headers.items() if k.startswith("x-pof-") and k not in timings}


def test_router_headers_show_a_tenants_pages_only_with_its_salt(tenant_a: Any, engines: dict[str, StandInEngine],  # noqa: F811
                                                                redis_server: RedisServer) -> None:
    # cost learning off: each answer would move the estimates of the next, hit or not
    router, idx = build(router_config(engines, index_url=redis_server.url, cost={"learn": False}))
    try:
        with TestClient(router_app(router)) as client:
            time.sleep(0.3)
            own = answer_headers(client, A_PROMPT, cache_salt=SALT_A)
            assert own["x-pof-backend"] == "a" and own["x-pof-reason"] == "pof"
            for probe in PROBES:
                # the idle backends take turns on ties: compare each probe with a never-seen prompt on
                # the same backend, and see both backends
                seen = {h["x-pof-backend"]: h for h in (answer_headers(client, A_PROMPT, **probe) for _ in range(4))}
                fresh = {h["x-pof-backend"]: h for h in (answer_headers(client, NEVER_SEEN, **probe) for _ in range(4))}
                assert seen == fresh and set(seen) == {"a", "b"}, (probe, seen, fresh)
                assert float(seen["a"]["x-pof-estimated-ttft"]) > float(own["x-pof-estimated-ttft"])
    finally:
        assert idx is not None
        idx.close()


def test_router_sticky_sessions_are_per_tenant(engines: dict[str, StandInEngine]) -> None:  # noqa: F811
    """A session id is chosen by the client: another tenant sending the same one must not be told
    (``x-pof-reason: sticky``) that it exists, nor be routed by it."""
    router, _ = build(router_config(engines, policy="round_robin", sticky_header="x-session"))
    with TestClient(router_app(router)) as client:
        first = client.post("/v1/completions", headers={"x-session": "s1"},
                            json={"prompt": [1, 2, 3], "cache_salt": SALT_A})
        again = client.post("/v1/completions", headers={"x-session": "s1"},
                            json={"prompt": [1, 2, 3], "cache_salt": SALT_A})
        assert again.headers["x-pof-reason"] == "sticky"
        assert again.headers["x-pof-backend"] == first.headers["x-pof-backend"]
        for probe in PROBES:
            r = client.post("/v1/completions", headers={"x-session": "s1"}, json={"prompt": [1, 2, 3], **probe})
            assert r.headers["x-pof-reason"] == "round_robin", (probe, r.headers)


def test_the_relay_publishes_no_salted_tokens(ctx: Any, tenant_a: Any, index: RedisIndex) -> None:  # noqa: F811
    """vLLM's own events carry a salted prompt's tokens, with the salt in its first block's
    extra_keys; the relay forwarded them unchanged to every subscriber. It now drops salted
    blocks and every block chained after one."""
    h = Harness(ctx, tenant_a)
    try:
        wait_for(lambda: any(n.node_id == "a:engine" for n in index.nodes()), what="relay registered")
        h.connect()
        a_first = stored([31, 32], A_PROMPT[:32])
        a_first.extra_keys = [(SALT_A,), None]            # vLLM: the salt in the first block's keys
        h.engine.send(a_first, stored([33, 34], A_PROMPT[32:], parent=32))
        public = list(range(100, 100 + 32))                      # an unsalted prompt: still relayed
        h.engine.send(stored([41, 42], public))
        tenant_a.store([(k, SEG) for k in tenant_a.keys_for(public)]).result()
        events = h.tap.wait(lambda ev: bool(cpu(ev, BlockStored)), "the unsalted prompt's pool residency")
        time.sleep(0.3)                                          # a few more pool syncs
        events = h.tap.events()
        assert any(isinstance(e, BlockStored) and e.token_ids == public for e in events)
        raw = b"".join(encode_batch(b) for _, b in h.tap.got)
        assert SALT_A.encode() not in raw
        for e in events:
            if isinstance(e, BlockStored):
                assert not set(e.token_ids) & set(A_PROMPT), e
            assert not set(getattr(e, "block_hashes", ())) & {31, 32, 33, 34}, e
        assert engine_pages(index, A_PROMPT) == 0
    finally:
        h.close()


def test_router_sessions_are_bounded(engines: dict[str, StandInEngine], monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Session ids come from clients: one sending a new id per request grew the table without end."""
    import pof_connector.router.router as router_module

    monkeypatch.setattr(router_module, "MAX_SESSIONS", 3, raising=False)
    router, _ = build(router_config(engines, policy="round_robin", sticky_header="x-session"))
    for i in range(10):
        router.choose([1, 2], session=f"s{i}")
    assert len(router._sessions) == 3
    assert router.choose([1, 2], session="s9").reason == "sticky"


# ---- two salts: an organisation's shared prompt, each user's own turns ---------------------------

ORG_A, ORG_B = "org-a-salt", "org-b-salt"
ORG_PAGES = 2
ORG_PROMPT = list(range(3000, 3000 + 16 * ORG_PAGES))
TURN = list(range(4000, 4000 + 16 * 2))


def two_salt_keys(user_salt: str | None, org_salt: str, tokens: list[int] | None = None) -> list[PageKey]:
    return page_keys(NS, ORG_PROMPT + TURN if tokens is None else tokens, 16, cache_salt=user_salt,
                     shared_salt=org_salt, shared_tokens=len(ORG_PROMPT))


def test_users_of_one_org_share_its_prompt_and_never_each_others_turns() -> None:
    u1, u2 = two_salt_keys("user-1", ORG_A), two_salt_keys("user-2", ORG_A)
    assert u1[:ORG_PAGES] == u2[:ORG_PAGES]                                  # the org prompt: shared
    assert u1[:ORG_PAGES] == page_keys(NS, ORG_PROMPT, 16, cache_salt=ORG_A)  # = the org salt alone
    assert not set(u1[ORG_PAGES:]) & set(u2[ORG_PAGES:])                     # the turns: never
    other_org = two_salt_keys("user-1", ORG_B)                               # same user salt, other org
    assert not set(other_org) & set(u1)
    for single in (None, "user-1", ORG_A):                                   # no single-salt chain meets a turn
        assert not set(page_keys(NS, ORG_PROMPT + TURN, 16, cache_salt=single)[ORG_PAGES:]) & set(u1[ORG_PAGES:])


def test_a_shared_part_that_ends_inside_a_page_keeps_that_page_private() -> None:
    k = page_keys(NS, ORG_PROMPT + TURN, 16, cache_salt="u", shared_salt=ORG_A, shared_tokens=len(ORG_PROMPT) + 8)
    assert k[:ORG_PAGES] == two_salt_keys("u", ORG_A)[:ORG_PAGES]
    assert k[ORG_PAGES] != two_salt_keys("v", ORG_A)[ORG_PAGES]


def test_the_vllm_chain_computes_the_same_two_salt_keys() -> None:
    from types import SimpleNamespace

    from pof_connector.adapters.vllm_chain import Chain

    request = SimpleNamespace(cache_salt="user-1", lora_request=None, prompt_embeds=None, mm_features=None,
                              kv_transfer_params={"pof_shared_salt": ORG_A, "pof_shared_tokens": len(ORG_PROMPT)})
    chain = Chain(NS, request, "default", 16)
    tokens = ORG_PROMPT + TURN
    chain.upto(tokens, 1, 16)                                 # grown page by page, across the switch
    chain.upto(tokens, 3, 16)
    assert chain.upto(tokens, 4, 16) == two_salt_keys("user-1", ORG_A)
    request.kv_transfer_params = {"pof_shared_salt": ORG_A, "pof_shared_tokens": "many"}     # malformed: one salt
    assert Chain(NS, request, "default", 16).upto(tokens, 4, 16) == page_keys(NS, tokens, 16, cache_salt="user-1")


@pytest.fixture
def org_user(redis_server: RedisServer, runtime_dir: str, index: RedisIndex) -> Iterator[Any]:
    """Pool node "a" holding user-1 of org A's conversation (org prompt + their turn)."""
    pool = node("a", redis_server.url, runtime_dir)
    keys = page_keys(pool.namespace, ORG_PROMPT + TURN, 16, cache_salt="user-1", shared_salt=ORG_A,
                     shared_tokens=len(ORG_PROMPT))
    pool.store([(k, SEG) for k in keys]).result()
    wait_for(lambda: Locator(index).locate(ORG_PROMPT, cache_salt=ORG_A).nodes.get("a") is not None,
             what="the org prompt's pages in the index")
    yield pool
    pool.close()


def test_the_locality_api_shows_another_org_or_a_saltless_probe_nothing(org_user: Any, index: RedisIndex) -> None:
    client = TestClient(locality_app(index))
    org = client.post("/v1/locality", json={"tokens": ORG_PROMPT, "cache_salt": ORG_A}).json()
    assert org["nodes"][0]["matched_tokens"] == len(ORG_PROMPT)              # org members see the org prompt
    for probe in [{}, {"cache_salt": ORG_B}, {"cache_salt": "user-1"}]:
        seen = client.post("/v1/locality", json={"tokens": ORG_PROMPT + TURN, **probe})
        fresh = client.post("/v1/locality", json={"tokens": NEVER_SEEN, **probe})
        assert seen.json() == fresh.json() and seen.json()["nodes"] == [], (probe, seen.text)
        assert {k: v for k, v in seen.headers.items() if k != "date"} == \
            {k: v for k, v in fresh.headers.items() if k != "date"}


OTHER_TURN = list(range(5000, 5000 + 16 * 2))         # a turn nobody sent


def two_salts(user: str, org: str) -> dict[str, Any]:
    """The two-salt request shape: the user's salt as ``cache_salt``, the org's in ``kv_transfer_params``."""
    return {"cache_salt": user, "kv_transfer_params": {"pof_shared_salt": org, "pof_shared_tokens": len(ORG_PROMPT)}}


def locality_query(user: str, org: str) -> dict[str, Any]:
    """The same for the locality API (its own fields: it takes no request body of an engine)."""
    return {"cache_salt": user, "shared_salt": org, "shared_tokens": len(ORG_PROMPT)}


def test_the_locality_api_answers_two_salt_queries_by_the_same_boundary(org_user: Any, index: RedisIndex) -> None:
    client = TestClient(locality_app(index))

    def ask(tokens: list[int], **q: Any) -> Any:
        r = client.post("/v1/locality", json={"tokens": tokens, **q})
        assert r.status_code == 200, r.text
        return r

    own = ask(ORG_PROMPT + TURN, **locality_query("user-1", ORG_A)).json()
    assert own["nodes"][0]["matched_tokens"] == len(ORG_PROMPT + TURN)     # user-1: the org prompt and its turn
    peer = ask(ORG_PROMPT + TURN, **locality_query("user-2", ORG_A))
    assert peer.json()["nodes"][0]["matched_tokens"] == len(ORG_PROMPT)   # user-2: the org prompt only
    unsent = ask(ORG_PROMPT + OTHER_TURN, **locality_query("user-2", ORG_A))
    # user-1's turn tells user-2 nothing: the answer is the one for a turn nobody sent
    assert peer.json() == unsent.json()
    assert {k: v for k, v in peer.headers.items() if k != "date"} == \
        {k: v for k, v in unsent.headers.items() if k != "date"}
    for probe in [locality_query("user-1", ORG_B), locality_query("user-3", ORG_B)]:   # another org: nothing
        seen, fresh = ask(ORG_PROMPT + TURN, **probe), ask(NEVER_SEEN, **probe)
        assert seen.json() == fresh.json() and seen.json()["nodes"] == [], (probe, seen.text)


def test_router_headers_keep_the_two_salt_boundary(org_user: Any, engines: dict[str, StandInEngine],  # noqa: F811
                                                    redis_server: RedisServer) -> None:
    router, idx = build(router_config(engines, index_url=redis_server.url, cost={"learn": False}))
    try:
        with TestClient(router_app(router)) as client:
            time.sleep(0.3)
            own = answer_headers(client, ORG_PROMPT + TURN, **two_salts("user-1", ORG_A))
            assert own["x-pof-backend"] == "a" and own["x-pof-route-reason"] == "prefix-holder"

            def both(prompt: list[int], **kw: Any) -> dict[str, dict[str, str]]:
                """Answers by backend (idle backends take turns on ties: ask until both answered)."""
                return {h["x-pof-backend"]: h for h in (answer_headers(client, prompt, **kw) for _ in range(4))}

            # user-2 of the same org: the org prompt counts (its pages are on a), user-1's turn does not
            peer = both(ORG_PROMPT + TURN, **two_salts("user-2", ORG_A))
            assert peer == both(ORG_PROMPT + OTHER_TURN, **two_salts("user-2", ORG_A))
            assert float(peer["a"]["x-pof-estimated-ttft"]) > float(own["x-pof-estimated-ttft"])
            # another org: the same answers as for a prompt nobody sent
            for user in ("user-1", "user-3"):
                seen = both(ORG_PROMPT + TURN, **two_salts(user, ORG_B))
                assert seen == both(NEVER_SEEN, **two_salts(user, ORG_B)) and set(seen) == {"a", "b"}, seen
                assert float(seen["a"]["x-pof-estimated-ttft"]) > float(peer["a"]["x-pof-estimated-ttft"])
    finally:
        assert idx is not None
        idx.close()
