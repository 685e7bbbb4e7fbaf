"""ChunkStore: engine-cache chunks (LMCache's ``[kv, layers, tokens, hidden]``) as pof pages, on a
real pool (local index, a CXL region under /dev/shm). The LMCache adapter on top of it is tested
through LMCache's own engine in tests/adapters/test_lmcache.py."""

from __future__ import annotations

import mmap
from collections.abc import Iterator

import numpy as np
import pytest

from pof_connector.config import PofConfig
from pof_connector.pages.keys import PageKey
from pof_connector.pool import Pool
from pof_connector.pool.chunk_store import ChunkGeometry, ChunkOwner, ChunkStore, chunk_digest, chunk_key

GEO = ChunkGeometry(kv=2, layers=3, tokens=16, hidden_bytes=64)
OWNER = ChunkOwner("m", 1, 0, "bfloat16")


def chunk(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, GEO.shape, dtype=np.uint8)


@pytest.fixture
def store(runtime_dir: str, shm_path: str) -> Iterator[ChunkStore]:
    config = PofConfig.from_mapping({"node_id": "n", "index_url": "local", "runtime_dir": runtime_dir,
                                     "tiers": {"cxl": {"path": shm_path, "size": "1MiB"}}})
    pool = Pool(config, GEO.spec, OWNER.namespace(GEO))
    yield ChunkStore(pool, GEO)
    pool.close()


def test_namespaces_keep_models_ranks_dtypes_and_tags_apart() -> None:
    variants = [OWNER, ChunkOwner("m2", 1, 0, "bfloat16"), ChunkOwner("m", 2, 0, "bfloat16"),
                ChunkOwner("m", 2, 1, "bfloat16"), ChunkOwner("m", 1, 0, "float16"),
                ChunkOwner("m", 1, 0, "bfloat16", (("tenant", "a"),)),
                ChunkOwner("m", 1, 0, "bfloat16", (("tenant", "b"),))]
    spaces = {v.namespace(GEO) for v in variants}
    spaces |= {OWNER.namespace(GEO, "ops-ns"), OWNER.namespace(ChunkGeometry(2, 3, 32, 64))}
    assert len(spaces) == len(variants) + 2
    assert OWNER.namespace(GEO) == ChunkOwner("m", 1, 0, "bfloat16").namespace(GEO)     # stable


def test_chunks_of_another_layer_count_are_not_found(store: ChunkStore) -> None:
    """Issue 39, finding 6: the namespace had the chunk's kv, hidden bytes and tokens but not its
    layers, so an engine with another layer count found these chunks by lookup, and every load of
    one was refused by its header. Any geometry field of the page now makes another namespace."""
    ns = OWNER.namespace(GEO)
    keys = [chunk_key(ns, h) for h in range(3)]
    assert store.put([(k, chunk(20 + i)) for i, k in enumerate(keys)]).result() == 3
    for other in (ChunkGeometry(GEO.kv, GEO.layers - 1, GEO.tokens, GEO.hidden_bytes),
                  ChunkGeometry(GEO.kv, GEO.layers + 1, GEO.tokens, GEO.hidden_bytes)):
        theirs = [chunk_key(OWNER.namespace(other), h) for h in range(3)]
        assert store.count_prefix(theirs) == 0
    assert store.count_prefix(keys) == 3


def test_chunk_digests_take_any_integer() -> None:
    hashes = [0, 1, -1, 2**63 - 1, -(2**63), 2**200, 12345]
    digests = {chunk_digest(h) for h in hashes}
    assert len(digests) == len(hashes) and all(len(d) == 32 for d in digests)
    assert chunk_digest(-1) == chunk_digest(-1)


def test_put_then_get_is_byte_exact_with_a_gap(store: ChunkStore) -> None:
    ns = OWNER.namespace(GEO)
    keys = [chunk_key(ns, h) for h in range(5)]
    data = {i: chunk(i) for i in (0, 1, 3, 4)}            # chunk 2 never stored
    assert store.put([(keys[i], d) for i, d in data.items()]).result() == 4
    assert store.count_prefix(keys) == 2
    outs = [np.zeros(GEO.shape, np.uint8) for _ in keys]
    assert store.get(keys, outs) == [True, True, False, True, True]
    for i, d in data.items():
        assert np.array_equal(outs[i], d)
    assert not outs[2].any()
    assert store.put([(keys[0], data[0])]).result() == 0   # already held: skipped


def test_a_corrupt_chunk_is_false_and_never_copied_as_good(store: ChunkStore, shm_path: str) -> None:
    ns = OWNER.namespace(GEO)
    keys = [chunk_key(ns, h) for h in range(3)]
    data = [chunk(10 + i) for i in range(3)]
    store.put(list(zip(keys, data, strict=True))).result()
    with open(shm_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as region:
        at = region.find(data[1][:, 2].tobytes()[:64])     # layer 2 of chunk 1 (K then V)
        assert at >= 0
        region[at + 5] ^= 0x01
    outs = [np.zeros(GEO.shape, np.uint8) for _ in keys]
    assert store.get(keys, outs) == [True, False, True]
    assert np.array_equal(outs[0], data[0]) and np.array_equal(outs[2], data[2])
    assert store.pool.stats.get("load_failures", reason="bad_checksum") == 1


def test_a_chunk_of_another_shape_is_refused(store: ChunkStore) -> None:
    key = PageKey(OWNER.namespace(GEO), chunk_digest(1))
    with pytest.raises(ValueError, match="shape"):
        store.put([(key, np.zeros((2, 3, 8, 64), np.uint8))])
