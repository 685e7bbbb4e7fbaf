"""The one place a Redis client for the index is built: URL plus :class:`IndexAuth`."""

from __future__ import annotations

from typing import Any

import redis

from pof_connector.config.credentials import IndexAuth


def redis_client(url: str, auth: IndexAuth | None = None, *, timeout_s: float | None, **kw: Any) -> redis.Redis:
    """A client of the index server at ``url``, authenticated and over TLS as ``auth`` says
    (``None``: as the URL says); ``timeout_s=None`` waits as long as a call takes. The password
    is read now and lives only in the client. Raises
    :class:`~pof_connector.config.ConfigError` when ``auth``'s secret cannot be read."""
    extra = auth.redis_kwargs() if auth is not None else {}
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, **extra, **kw)


__all__ = ["redis_client"]
