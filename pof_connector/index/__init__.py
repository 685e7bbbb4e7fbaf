"""The locality index: where each page lives, cluster-wide.

* :mod:`.base` — the :class:`~.base.LocalityIndex` interface and its records;
* :mod:`.redis` — the Redis implementation (schema in its docstring); :mod:`.redis_cluster` — the
  same on a Redis Cluster (``redis+cluster://``); :mod:`.local` — in-process;
* :mod:`.server` — starting a Redis-protocol server; :mod:`.embedded` — the per-host embedded
  server and its supervisor;
* :mod:`.guarded` — index calls that never raise into the pool or the relay (count, back off,
  log once);
* :mod:`.reach` — the one rule for which holders' runs a node can load, used by the pool's
  lookup and the locator;
* :mod:`.cli` and :mod:`.stats_view` — ``pof index ...`` and ``pof stats``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pof_connector.config import PofConfig
from pof_connector.config.cluster_url import is_cluster_url
from pof_connector.config.credentials import IndexAuth
from pof_connector.index.base import (
    LOOKUP_ROUNDS,
    MEDIA,
    IndexTimeout,
    IndexUnavailable,
    LocalityIndex,
    Location,
    Matches,
    NodeIdTaken,
    NodeInfo,
    PrefixMatch,
    TierUsage,
)
from pof_connector.index.local import LocalIndex, LocalTable

if TYPE_CHECKING:
    from pof_connector.index.redis import RedisIndex

__all__ = ["LOOKUP_ROUNDS", "MEDIA", "IndexTimeout", "IndexUnavailable", "LocalIndex", "LocalTable", "LocalityIndex",
           "Location", "Matches", "NodeIdTaken", "NodeInfo", "PrefixMatch", "TierUsage", "open_index", "redis_index",
           "resolve_url"]


def resolve_url(config: PofConfig) -> str:
    """The Redis URL for ``config.index_url``, starting the embedded server when needed."""
    if config.index_url == "embedded":
        from pof_connector.index.embedded import ensure_embedded

        return ensure_embedded(config.runtime_dir)
    return config.index_url


def open_index(config: PofConfig, node_id: str | None, *, table: LocalTable | None = None) -> LocalityIndex:
    """An index client for ``config``; ``node_id=None`` gives a lookup-only client."""
    if config.index_url == "local":
        return LocalIndex(node_id, table)
    return redis_index(resolve_url(config), node_id, timeout_s=config.index_timeout_s, auth=config.index_auth)


def redis_index(url: str, node_id: str | None, *, timeout_s: float = 1.0, auth: IndexAuth | None = None) -> RedisIndex:
    """A client of the server or cluster at ``url`` (``redis+cluster://``: a Redis Cluster)."""
    if is_cluster_url(url):
        from pof_connector.index.redis_cluster import RedisClusterIndex

        return RedisClusterIndex(url, node_id, timeout_s=timeout_s, auth=auth)
    from pof_connector.index.redis import RedisIndex

    return RedisIndex(url, node_id, timeout_s=timeout_s, auth=auth)
