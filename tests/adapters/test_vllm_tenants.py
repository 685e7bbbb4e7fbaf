"""Tenants' quotas on real vLLM CPU servers (issue 44, must-show 1): a hot tenant floods the pool,
a quiet tenant within its quota keeps its hit rate; the same run on a server without quotas shows
what the quota bought. Tenants are told apart by vLLM's own ``cache_salt`` request field.

Two servers run side by side, each with its own pool (one DRAM tier of :data:`TIER_PAGES` pages,
its own embedded index): ``quota`` maps the two salts to tenants with quotas, ``open`` has no
tenants at all. Each server sees the same requests: the quiet tenant's prompts (computed, then
asked again after the engine forgot its own prefix cache: every hit comes from the pool), the hot
tenant's flood, and the quiet prompts again. Hit rate = the pool's hit tokens / the tokens a pool
hit can cover (whole pages, never the last token), from vLLM's own
``vllm:external_prefix_cache_hits_total``. Greedy answers from pool hits equal the first,
computed ones. ``POF_ISSUE44_JSON=path`` writes the figures there (docs/bench/issue44-*.json).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from pof_connector.bench.vllm_server import VllmServer, connector_config
from pof_connector.index.embedded import stop_embedded
from pof_connector.pages import PageSpec
from pof_connector.tiers.base import slot_bytes_for
from tests.adapters.test_vllm import BLOCK, DTYPE, HITS, model, pool_tokens, prompt, workdir

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
__all__ = ["model", "workdir"]

# The tiny model in float32: 2 layers x 128 tokens x 2 KV heads x (32 + 32) x 4 bytes per layer segment.
SLOT = slot_bytes_for(PageSpec(num_layers=2, segment_bytes=BLOCK * 2 * 64 * 4, page_tokens=BLOCK))
TIER_PAGES = 24
QUIET_QUOTA, HOT_QUOTA = 10, 14                   # pages; together the whole tier
PROMPT_TOKENS = 4 * BLOCK + 1                     # 4 whole pages each
QUIET_PROMPTS, HOT_PROMPTS = 2, 12                # 8 quiet pages (within 10), a 48-page flood
QUIET_SALT, HOT_SALT = "quiet-org-salt-5b1d", "hot-org-salt-c07e"
QUERIES = "vllm:external_prefix_cache_queries_total"


def server(model: Path, workdir: Path, name: str, tenants: dict[str, Any] | None) -> VllmServer:
    cfg: dict[str, Any] = {"node_id": name, "index_url": "embedded", "runtime_dir": str(workdir / f"rt-{name}"),
                           "tiers": {"cpu_dram": {"size": TIER_PAGES * SLOT}}}
    if tenants is not None:
        cfg["tenants"] = tenants
    return VllmServer(model, workdir / name, kv_transfer=connector_config(cfg), dtype=DTYPE)


TENANTS = {"named": {
    "quiet": {"salt": QUIET_SALT, "quota": {"cpu_dram": QUIET_QUOTA * SLOT}},
    "hot": {"salt": HOT_SALT, "quota": {"cpu_dram": HOT_QUOTA * SLOT}},
}}


@pytest.fixture(scope="module")
def servers(model: Path, workdir: Path) -> Iterator[dict[str, VllmServer]]:
    fleet = {"quota": server(model, workdir, "quota", TENANTS), "open": server(model, workdir, "open", None)}
    try:
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda s: s.start(timeout_s=900), fleet.values()))
        yield fleet
    finally:
        for name, s in fleet.items():
            s.stop()
            stop_embedded(workdir / f"rt-{name}")


class Tenant:
    """A tenant's prompts and the answers they got first (computed: nothing of them was pooled)."""

    def __init__(self, salt: str, count: int, seed: int) -> None:
        self.salt = salt
        self.prompts = [prompt(PROMPT_TOKENS, seed=seed + i) for i in range(count)]
        self.first: list[list[int]] = []

    def run(self, s: VllmServer, newest_first: bool = False) -> dict[str, Any]:
        """Ask every prompt once, one at a time (``newest_first``: the last one first); the pool
        hits they got, by vLLM's counters."""
        m0 = s.metrics([HITS, QUERIES])
        order = range(len(self.prompts) - 1, -1, -1) if newest_first else range(len(self.prompts))
        got = {i: s.complete(self.prompts[i], max_tokens=4, cache_salt=self.salt) for i in order}
        answers = [got[i] for i in range(len(self.prompts))]
        if not self.first:
            self.first = answers
        assert answers == self.first, "an answer from pool hits differs from the computed one"
        m1 = s.metrics([HITS, QUERIES])
        hits = int(m1[HITS] - m0[HITS])
        possible = len(self.prompts) * pool_tokens(PROMPT_TOKENS)
        return {"hit_tokens": hits, "poolable_tokens": possible, "hit_rate": round(hits / possible, 4),
                "queried_tokens": int(m1[QUERIES] - m0[QUERIES])}


def settle(s: VllmServer) -> None:
    """Let the store thread publish what the last requests saved, then make the engine forget its
    own prefix cache: the next hits can only come from the pool."""
    time.sleep(1.5)
    s.reset_prefix_cache()


def run_tenants(s: VllmServer) -> dict[str, Any]:
    quiet = Tenant(QUIET_SALT, QUIET_PROMPTS, seed=4400)
    hot = Tenant(HOT_SALT, HOT_PROMPTS, seed=4500)
    quiet.run(s)                                   # computed and stored
    settle(s)
    before = quiet.run(s)
    settle(s)
    flood = hot.run(s)                             # computed: 48 pages of the hot tenant
    settle(s)
    after = quiet.run(s)
    settle(s)
    # The hot tenant's prompts again, newest first (oldest first, each miss would evict the next
    # prompt's pages under its quota: LRU's sequential-scan case).
    hot_again = hot.run(s, newest_first=True)
    return {"quiet_before_flood": before, "hot_flood": flood, "quiet_after_flood": after,
            "hot_after_flood": hot_again}


def test_a_quiet_tenant_within_its_quota_keeps_its_hit_rate_through_a_flood(servers: dict[str, VllmServer]) -> None:
    with ThreadPoolExecutor(2) as ex:
        got = dict(zip(servers, ex.map(run_tenants, servers.values()), strict=True))
    quota, open_ = got["quota"], got["open"]
    for run in (quota, open_):
        assert run["quiet_before_flood"]["hit_rate"] == 1.0
        assert run["hot_flood"]["hit_tokens"] == 0
    # The quota: the quiet tenant keeps every page; the hot tenant keeps what its own quota holds.
    assert quota["quiet_after_flood"]["hit_rate"] == 1.0
    assert 0 < quota["hot_after_flood"]["hit_tokens"] <= HOT_QUOTA * BLOCK
    # Without quotas, plain LRU: the flood evicted the quiet tenant's pages.
    assert open_["quiet_after_flood"]["hit_rate"] == 0.0
    out = {"what": "issue 44 must-show 1: a hot tenant floods a pool tier, a quiet tenant within its quota keeps "
                   "its pool hit rate (vLLM CPU servers, tiny model, float32; hits from "
                   "vllm:external_prefix_cache_hits_total after /reset_prefix_cache)",
           "setup": {"tier": "cpu_dram", "tier_pages": TIER_PAGES, "page_tokens": BLOCK,
                     "quotas_pages": {"quiet": QUIET_QUOTA, "hot": HOT_QUOTA},
                     "quiet": {"prompts": QUIET_PROMPTS, "pages": QUIET_PROMPTS * 4},
                     "hot": {"prompts": HOT_PROMPTS, "pages": HOT_PROMPTS * 4},
                     "prompt_tokens": PROMPT_TOKENS, "tenant_selected_by": "cache_salt"},
           "with_quotas": quota, "without_quotas": open_}
    print(json.dumps(out, indent=1))
    path = os.environ.get("POF_ISSUE44_JSON")
    if path:
        Path(path).write_text(json.dumps(out, indent=1) + "\n")



LOCAL_HITS = "vllm:prefix_cache_hits_total"


def test_two_salts_share_an_orgs_prompt_and_keep_each_users_turns_private(servers: dict[str, VllmServer]) -> None:
    """The two-salt request shape on a real server: the user's salt as ``cache_salt``, the org's
    in ``kv_transfer_params``. user-2 of org A loads the org prompt's pages that user-1's request
    stored, never user-1's turn; a user of org B loads nothing. The engine's own prefix cache keeps
    a stricter boundary (vLLM puts ``cache_salt`` in its first block hash: users share nothing in it)."""
    s = servers["open"]
    org = prompt(2 * BLOCK, seed=4410)
    turn = prompt(2 * BLOCK + 1, seed=4411)          # user-1's turn: two whole pages, and a token

    def ask(user: str, org_salt: str) -> tuple[int, int]:
        """(pool hit tokens, engine prefix-cache hit tokens) of org + turn for ``user``."""
        m0 = s.metrics([HITS, LOCAL_HITS])
        out = s.post("/v1/completions", {"model": "m", "prompt": org + turn, "max_tokens": 4, "temperature": 0,
                                         "return_token_ids": True, "ignore_eos": True, "cache_salt": user,
                                         "kv_transfer_params": {"pof_shared_salt": org_salt,
                                                                "pof_shared_tokens": len(org)}})
        answers.append(list(out["choices"][0]["token_ids"]))
        m1 = s.metrics([HITS, LOCAL_HITS])
        return int(m1[HITS] - m0[HITS]), int(m1[LOCAL_HITS] - m0[LOCAL_HITS])

    answers: list[list[int]] = []
    settle(s)
    assert ask("user-1", "org-a") == (0, 0)          # computed; its pages stored
    time.sleep(1.5)
    got = {"user-2 of org A (no reset)": ask("user-2", "org-a")}
    settle(s)
    got["user-1 of org A"] = ask("user-1", "org-a")
    settle(s)
    got["user-3 of org B"] = ask("user-3", "org-b")
    assert got == {"user-2 of org A (no reset)": (2 * BLOCK, 0),    # the org prompt from the pool, not the turn
                   "user-1 of org A": (4 * BLOCK, 0),              # its own prompt and turn
                   "user-3 of org B": (0, 0)}, got
    assert all(a == answers[0] for a in answers)     # pool hits or not, the same greedy answer
    path = os.environ.get("POF_ISSUE44_JSON")
    if path:
        out = json.loads(Path(path).read_text()) if Path(path).exists() else {}
        out["two_salts"] = {"prompt": "org prompt 256 tokens + user-1's turn 257 tokens",
                            "pool_and_engine_hit_tokens": {k: {"pool": v[0], "engine_prefix_cache": v[1]}
                                                           for k, v in got.items()}}
        Path(path).write_text(json.dumps(out, indent=1) + "\n")
