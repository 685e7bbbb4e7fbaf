"""Tenants' quotas per tier: a hot tenant floods, a quiet one within its quota keeps its pages."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator

import numpy as np
import pytest

from pof_connector.config import ConfigError, PofConfig
from pof_connector.config.tenant_config import DEFAULT_TENANT
from pof_connector.index.stats_view import tenant_table
from pof_connector.metrics import register_prometheus
from pof_connector.pages.keys import PageKey
from pof_connector.pages.layout import PageSpec
from pof_connector.pool import Pool
from pof_connector.tiers.base import slot_bytes_for
from pof_connector.tiers.slot_table import SlotTable

SPEC = PageSpec(num_layers=2, segment_bytes=1024, page_tokens=16)
SLOT = slot_bytes_for(SPEC)
HOT_SALT, QUIET_SALT = "hot-salt-9f2c", "quiet-salt-71ab"


def content(k: PageKey) -> list[np.ndarray]:
    rng = np.random.default_rng(int.from_bytes(k.digest[:8], "little"))
    return [rng.integers(0, 255, SPEC.segment_bytes, dtype=np.uint8) for _ in range(SPEC.num_layers)]


def config(runtime_dir: str, tiers: dict[str, object], tenants: dict[str, object]) -> PofConfig:
    return PofConfig.from_mapping({"node_id": "a", "index_url": "local", "runtime_dir": runtime_dir,
                                   "heartbeat_s": 0.05, "node_ttl_s": 2.0, "tiers": tiers, "tenants": tenants})


TENANTS = {"named": {
    "hot": {"salt_sha256": hashlib.sha256(HOT_SALT.encode()).hexdigest(), "quota": {"cpu_dram": 6 * SLOT}},
    "quiet": {"salt": QUIET_SALT, "quota": {"cpu_dram": 4 * SLOT}},
}}


@pytest.fixture
def pool(runtime_dir: str, namespace: bytes) -> Iterator[Pool]:
    p = Pool(config(runtime_dir, {"cpu_dram": {"size": 8 * SLOT}}, TENANTS), SPEC, namespace)
    yield p
    p.close()


def store(pool: Pool, salt: str | None, tokens: np.ndarray) -> list[PageKey]:
    keys = pool.keys_for(tokens, cache_salt=salt)
    pool.store([(k, content(k)) for k in keys], tenant=pool.tenant_of(salt)).result()
    return keys


def test_a_hot_tenant_floods_and_a_quiet_one_within_quota_keeps_its_pages(pool: Pool) -> None:
    tier = pool.tiers[0]
    quiet = store(pool, QUIET_SALT, np.arange(16 * 3))             # 3 pages, within its 4
    for round_ in range(10):                                      # 10 x 4 pages of new prompts
        store(pool, HOT_SALT, np.arange(16 * 4) + 10_000 * (round_ + 1))
    assert all(tier.find(k, touch=False) is not None for k in quiet)      # every quiet page stays
    assert pool.lookup(quiet).pages == 3
    use = tier.tenant_use()      # the tier is full below hot's quota: hot gives its own pages, never quiet's
    assert use["hot"] == (5 * SLOT, 6 * SLOT) and use["quiet"] == (3 * SLOT, 4 * SLOT)
    assert pool.stats.get("store_refused_pages") == 0


def test_a_tenant_at_its_quota_evicts_its_own_pages_first_even_with_free_slots(pool: Pool) -> None:
    tier = pool.tiers[0]
    first = store(pool, QUIET_SALT, np.arange(16 * 4))
    more = store(pool, QUIET_SALT, np.arange(16 * 2) + 50_000)
    assert tier.free_slots == 4                                   # room in the tier, none in the quota
    assert tier.tenant_use()["quiet"][0] == 4 * SLOT
    assert all(tier.find(k, touch=False) is not None for k in more)
    # its oldest pages went; a chain's tail first (tail pages are stored first, so LRU takes them)
    assert sum(tier.find(k, touch=False) is not None for k in first) == 2


def test_no_quota_pages_are_evicted_for_a_tenant_within_its_quota(pool: Pool) -> None:
    tier = pool.tiers[0]
    unsalted = store(pool, None, np.arange(16 * 4))               # the default tenant: no quota here
    store(pool, HOT_SALT, np.arange(16 * 4) + 90_000)              # fills the tier: 8 slots
    quiet = store(pool, QUIET_SALT, np.arange(16 * 2) + 70_000)    # must take the default tenant's
    assert all(tier.find(k, touch=False) is not None for k in quiet)
    assert sum(tier.find(k, touch=False) is not None for k in unsalted) == 2
    assert tier.page_tenant(quiet[0]) == "quiet" and tier.page_tenant(unsalted[0]) == DEFAULT_TENANT


def test_a_store_that_may_evict_nothing_is_refused_and_counted(runtime_dir: str, namespace: bytes) -> None:
    tenants = {"named": {"a": {"salt": "sa", "quota": {"cpu_dram": 4 * SLOT}},
                         "b": {"salt": "sb", "quota": {"cpu_dram": 4 * SLOT}}},
               "default_quota": {"cpu_dram": 0}}
    p = Pool(config(runtime_dir, {"cpu_dram": {"size": 4 * SLOT}}, tenants), SPEC, namespace)
    try:
        a = store(p, "sa", np.arange(16 * 4))                      # fills the tier, within a's quota
        b = store(p, "sb", np.arange(16 * 2) + 1000)               # nothing of a's may go, b has none
        assert all(p.tiers[0].find(k, touch=False) is not None for k in a)
        assert not any(p.tiers[0].find(k, touch=False) is not None for k in b)
        assert p.stats.get("store_refused_pages", tenant="b") == 2
        store(p, None, np.arange(16) + 5000)                       # quota 0: the default tenant stores nothing
        assert p.stats.get("store_refused_pages", tenant=DEFAULT_TENANT) == 1
    finally:
        p.close()


def test_a_demoted_page_keeps_its_tenant_and_obeys_its_quota_below(runtime_dir: str, namespace: bytes,
                                                                   shm_path: str) -> None:
    tenants = {"named": {"hot": {"salt": HOT_SALT, "quota": {"cpu_dram": 2 * SLOT, "cxl": 2 * SLOT}}}}
    tiers = {"cpu_dram": {"size": 4 * SLOT}, "cxl": {"size": 16 * (SLOT + 4096), "path": shm_path}}
    p = Pool(config(runtime_dir, tiers, tenants), SPEC, namespace)
    try:
        for i in range(5):
            store(p, HOT_SALT, np.arange(16 * 2) + 1000 * i)
        dram, cxl = p.tiers
        assert dram.tenant_use()["hot"][0] == 2 * SLOT
        assert cxl.tenant_use()["hot"][0] == 2 * SLOT            # demoted, and capped there too
    finally:
        p.close()


def test_stats_and_metrics_show_names_never_salts(pool: Pool) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    store(pool, QUIET_SALT, np.arange(16 * 2))
    info = pool.node_info()
    usage = json.loads(info.meta["tenants"])
    assert usage["quiet"]["cpu_dram"] == [2 * SLOT, 4 * SLOT] and usage["hot"]["cpu_dram"] == [0, 6 * SLOT]
    registry = CollectorRegistry()
    register_prometheus(pool.stats, registry)
    text = generate_latest(registry).decode()
    assert 'pof_tenant_used_bytes{tenant="quiet",tier="cpu_dram"}' in text
    assert 'pof_tenant_quota_bytes{tenant="hot",tier="cpu_dram"}' in text
    table = tenant_table([info])
    assert table is not None and table.row_count == 2
    shown = json.dumps(info.to_json()) + text + repr(pool.config) + json.dumps(pool.config.to_mapping())
    for secret in (HOT_SALT, QUIET_SALT, hashlib.sha256(QUIET_SALT.encode()).hexdigest()):
        assert secret not in json.dumps(info.to_json()) + text + repr(pool.config)
    assert QUIET_SALT not in shown and HOT_SALT not in shown


def test_slot_table_without_tenants_keeps_plain_lru() -> None:
    t = SlotTable(range(2))
    for i in range(3):
        k = PageKey(bytes(16), i.to_bytes(32, "little"))
        got = t.prepare_store(k, "x")
        assert got is not None
        t.complete_store(k, ok=True)
    assert t.tenant_use() == {"x": 2}


@pytest.mark.parametrize("tenants,match", [
    ([], r"tenants: expected a mapping"),
    ({"quotas": {}}, r"tenants: unknown option 'quotas'; allowed: default_quota, named"),
    ({"named": {"default": {"salt": "s"}}}, r"reserved"),
    ({"named": {"a b": {"salt": "s"}}}, r"tenant name is 1-64 characters"),
    ({"named": {"a": {"quota": {}}}}, r"tenants\.named\.a: expected exactly one of salt_sha256"),
    ({"named": {"a": {"salt": "s", "salt_sha256": "0" * 64}}}, r"exactly one of"),
    ({"named": {"a": {"salt_sha256": "XYZ"}}}, r"tenants\.named\.a\.salt_sha256: expected 64 lower-case hex"),
    ({"named": {"a": {"salt": ""}}}, r"tenants\.named\.a\.salt: expected a non-empty string"),
    ({"named": {"a": {"salt": "s", "ttl": 1}}}, r"unknown option 'ttl'; allowed: salt, salt_sha256, quota"),
    ({"named": {"a": {"salt": "s"}, "b": {"salt": "s"}}}, r"tenants\.named\.b: the same salt as tenant 'a'"),
    ({"named": {"a": {"salt": "s", "quota": {"hbm": "1GiB"}}}},
     r"tenants\.named\.a\.quota: unknown medium 'hbm'; allowed: cpu_dram, cxl, peer_hbm"),
    ({"named": {"a": {"salt": "s", "quota": {"cpu_dram": "lots"}}}}, r"tenants\.named\.a\.quota\.cpu_dram: expected"),
    ({"default_quota": {"cpu_dram": -1}}, r"tenants\.default_quota\.cpu_dram: must be positive"),
])
def test_bad_tenant_config_names_the_key(tenants: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as err:
        PofConfig.from_mapping({"tenants": tenants})
    assert "s3cret" not in str(err.value)


def test_a_bad_salt_is_never_quoted_in_the_error() -> None:
    with pytest.raises(ConfigError) as err:
        PofConfig.from_mapping({"tenants": {"named": {"a": {"salt_sha256": "s3cret-not-hex"}}}})
    assert "s3cret" not in str(err.value)


def test_tenant_config_round_trips_without_its_salt() -> None:
    c = PofConfig.from_mapping({"tenants": {**TENANTS, "default_quota": {"cxl": "1GiB"}}})
    assert c.tenants.tenant_of(QUIET_SALT) == "quiet" and c.tenants.tenant_of("other") == DEFAULT_TENANT
    assert c.tenants.tenant_of(None) == DEFAULT_TENANT
    assert c.tenants.quota("quiet", "cxl") == 1 << 30 and c.tenants.quota(DEFAULT_TENANT, "cpu_dram") is None
    assert PofConfig.from_mapping(c.to_mapping()) == c
    assert QUIET_SALT not in json.dumps(c.to_mapping())
