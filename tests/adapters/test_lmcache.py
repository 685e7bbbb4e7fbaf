"""pof as an LMCache storage plugin, through LMCache's own engine (pof_connector/bench/lmcache_node.py).

Two processes, two pool nodes: node A stores chunks through its LMCache engine into a CXL region
(a file under /dev/shm); node B, another process with its own LMCache engine and an empty local
CPU cache, finds them through the locality index (a real Redis-protocol server) and retrieves them
from the shared region. Then the failures: a corrupt page, a lost tier and a dead index each give
misses (LMCache recomputes), never an exception and never wrong bytes.
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pof_connector.bench.lmcache import stop_node
from pof_connector.bench.lmcache_node import Shape, expected_kv, write_config
from pof_connector.index.server import RedisServer

pytestmark = [pytest.mark.lmcache, pytest.mark.slow]

CHUNKS = 8
SHAPE = Shape()
CHUNK = SHAPE.chunk
ROOT = Path(__file__).resolve().parents[2]


def node_env() -> dict[str, str]:
    # Without vLLM, LMCache hashes chunks with Python's hash(): the seed must match across processes.
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "0", "LMCACHE_LOG_LEVEL": "WARNING",
            "LMCACHE_TRACK_USAGE": "false"}


def node_args(config: Path, op: str, **extra: Any) -> list[str]:
    return [sys.executable, "-m", "pof_connector.bench.lmcache_node",
            json.dumps({"config": str(config), "op": op, "chunks": CHUNKS, **extra})]


@pytest.fixture
def configs(tmp_path: Path, runtime_dir: str, shm_path: str, redis_server: RedisServer) -> tuple[Path, Path]:
    a = write_config(tmp_path / "a.yaml", node="a", index_url=redis_server.url, runtime_dir=runtime_dir,
                     region=shm_path)
    b = write_config(tmp_path / "b.yaml", node="b", index_url=redis_server.url, runtime_dir=runtime_dir,
                     region=shm_path)
    return a, b


@pytest.fixture
def tags() -> dict[str, str] | None:
    """LMCache tags node A stores with (``None``: none)."""
    return None


def start_node(config: Path, **extra: Any) -> subprocess.Popen[str]:
    """A node that stored CHUNKS chunks through LMCache and stays alive until :func:`stop_node`."""
    with tempfile.TemporaryFile("w+") as log:    # not a pipe: a full pipe would block a long-lived node
        proc = subprocess.Popen(node_args(config, "store", **extra), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=log, text=True, env=node_env(), cwd=ROOT)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            stop_node(proc, timeout_s=30)
            log.seek(0)
            raise AssertionError(f"node failed: {log.read()[-3000:]}")
    stored = json.loads(line)
    assert (stored["stored"], stored["plugin"]) == (CHUNKS, "PoFStoragePlugin")
    return proc


@pytest.fixture
def stored(configs: tuple[Path, Path], tags: dict[str, str] | None) -> Iterator[subprocess.Popen[str]]:
    """Node A, alive, after storing CHUNKS chunks of seed 1 through LMCache."""
    proc = start_node(configs[0], tags=tags)
    try:
        yield proc
    finally:
        stop_node(proc, timeout_s=30)


def load(config: Path, op: str = "load", **extra: Any) -> tuple[dict[str, Any], str]:
    done = subprocess.run(node_args(config, op, **extra), capture_output=True, text=True, env=node_env(),
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]          # no exception escaped into LMCache's caller
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_chunks_stored_by_one_lmcache_are_retrieved_by_another(configs: tuple[Path, Path],
                                                             stored: subprocess.Popen[str]) -> None:
    got, _ = load(configs[1])
    assert got["plugin"] == "PoFStoragePlugin"
    assert got["lookup_tokens"] == CHUNKS * CHUNK
    assert got["retrieved_tokens"] == CHUNKS * CHUNK
    assert got["bytes_equal"]
    stats = got["stats"]
    assert stats["loaded_pages{tier=cxl}"] == CHUNKS            # read from A's pages in the shared region
    assert stats.get("tier_used_bytes{tier=cxl}", 0) == 0       # B itself stored nothing there


def test_lmcaches_scheduler_role_answers_lookups_from_the_index(configs: tuple[Path, Path],
                                                               stored: subprocess.Popen[str]) -> None:
    # LMCache's scheduler-side engine has no local CPU backend: pof gives it a client pool (no tiers)
    # that answers for its node, whose worker (alive, with its own chunks) registered what it can read.
    worker_b = start_node(configs[1], seed=2)
    try:
        got, _ = load(configs[1], "lookup", role="scheduler")
        assert got == {"lookup_tokens": CHUNKS * CHUNK, "plugin": "PoFStoragePlugin", "pool_role": "client"}
    finally:
        stop_node(worker_b, timeout_s=30)


def test_a_corrupt_page_is_a_miss(configs: tuple[Path, Path], shm_path: str, stored: subprocess.Popen[str]) -> None:
    bad = 3
    # Layer 0's K bytes of chunk `bad` open its page's first segment: find them in the region, flip one.
    needle = expected_kv(1, SHAPE, CHUNKS * CHUNK)[0, 0, bad * CHUNK:(bad + 1) * CHUNK].contiguous().view(torch.uint8)
    with open(shm_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as region:
        at = region.find(needle.numpy().tobytes()[:256])
        assert at >= 0
        region[at + 100] ^= 0xFF
    got, _ = load(configs[1])
    assert got["lookup_tokens"] == CHUNKS * CHUNK               # the index still lists it
    assert got["retrieved_tokens"] == bad * CHUNK               # LMCache keeps the prefix before it
    assert got["bytes_equal"] and got["rest_untouched"]         # no byte of the corrupt chunk reached the engine
    assert got["stats"]["load_failures{reason=bad_checksum}"] == 1


def test_a_lost_tier_is_a_miss(configs: tuple[Path, Path], shm_path: str, stored: subprocess.Popen[str]) -> None:
    os.unlink(shm_path)                                         # somebody removes A's CXL region
    time.sleep(2)                                               # A notices at its next heartbeat (0.2 s)
    got, _ = load(configs[1])
    assert got["plugin"] == "PoFStoragePlugin"
    assert (got["lookup_tokens"], got["retrieved_tokens"]) == (0, 0)
    assert got["rest_untouched"]


def test_a_dead_index_is_a_miss(configs: tuple[Path, Path], redis_server: RedisServer,
                                stored: subprocess.Popen[str]) -> None:
    redis_server.stop()
    got, _ = load(configs[1])
    assert (got["lookup_tokens"], got["retrieved_tokens"]) == (0, 0)
    assert got["rest_untouched"]


@pytest.mark.parametrize("tags", [{"tenant": "acme"}])
def test_lmcache_tags_are_part_of_the_namespace(configs: tuple[Path, Path], stored: subprocess.Popen[str]) -> None:
    other, _ = load(configs[1], tags={"tenant": "globex"})
    assert (other["lookup_tokens"], other["retrieved_tokens"]) == (0, 0)      # another tenant: nothing
    untagged, _ = load(configs[1])
    assert untagged["lookup_tokens"] == 0
    same, _ = load(configs[1], tags={"tenant": "acme"})
    assert same["retrieved_tokens"] == CHUNKS * CHUNK and same["bytes_equal"]


def test_a_bad_pof_key_is_named_and_the_plugin_left_out(tmp_path: Path, runtime_dir: str,
                                                         redis_server: RedisServer) -> None:
    cfg = write_config(tmp_path / "bad.yaml", node="b", index_url=redis_server.url, runtime_dir=runtime_dir,
                       region=None)
    cfg.write_text(cfg.read_text().replace("storage_plugin.pof.tiers", "storage_plugin.pof.tierz"))
    got, err = load(cfg)
    assert got["plugin"] is None                                # LMCache's launcher logs and skips it
    assert "tierz" in err



def test_an_engine_with_another_layer_count_finds_nothing(configs: tuple[Path, Path],
                                                           stored: subprocess.Popen[str]) -> None:
    """Issue 39, finding 6: an engine of the same model name, dtype and chunk size with fewer layers
    (its smaller pages fit A's region, which it reaches). Each of A's pages would be refused by its
    header (geometry), so no lookup may promise one: LMCache, told the tokens are cached, would miss
    on every request and never store the prefix itself. Before the fix: 128 of 128 tokens, 8 of 8."""
    fewer = {"layers": SHAPE.layers // 2}
    got, _ = load(configs[1], shape=fewer)
    assert (got["lookup_tokens"], got["contains"], got["retrieved_tokens"]) == (0, 0, 0)
    assert got["stats"].get("load_failures{reason=geometry}", 0) == 0         # nothing promised, nothing tried
    worker_b = start_node(configs[1], seed=2, shape=fewer)     # LMCache's scheduler-side instance answers for it
    try:
        looked, _ = load(configs[1], "lookup", role="scheduler", shape=fewer)
        assert looked["lookup_tokens"] == 0
    finally:
        stop_node(worker_b, timeout_s=30)
    same, _ = load(configs[1])                                 # A's own shape reaches all of it
    assert (same["lookup_tokens"], same["contains"], same["retrieved_tokens"]) == (CHUNKS * CHUNK, CHUNKS,
                                                                                   CHUNKS * CHUNK)
    assert same["bytes_equal"]
