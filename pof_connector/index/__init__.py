"""The locality index: where each page lives, cluster-wide (see :mod:`.base`)."""

from __future__ import annotations

from pof_connector.config import PofConfig
from pof_connector.index.base import (
    LOOKUP_ROUNDS,
    MEDIA,
    IndexTimeout,
    IndexUnavailable,
    LocalityIndex,
    Location,
    NodeIdTaken,
    NodeInfo,
    PrefixMatch,
    TierUsage,
)
from pof_connector.index.local import LocalIndex, LocalTable

__all__ = ["LOOKUP_ROUNDS", "MEDIA", "IndexTimeout", "IndexUnavailable", "LocalIndex", "LocalTable", "LocalityIndex",
           "Location", "NodeIdTaken", "NodeInfo", "PrefixMatch", "TierUsage", "open_index", "resolve_url"]


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
    from pof_connector.index.redis import RedisIndex

    return RedisIndex(resolve_url(config), node_id, timeout_s=config.index_timeout_s)
