"""``redis+cluster://`` / ``rediss+cluster://`` index URLs: a Redis Cluster named by its seed nodes.

Form: ``redis+cluster://[user[:password]@]host:port[,host:port...]`` (``rediss+`` for TLS). Any
live node of the cluster is enough to start from: the client learns the rest from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote

CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
CLUSTER_FORM = "'redis+cluster://[user[:password]@]host:port[,host:port...]' (or 'rediss+cluster://' for TLS)"


def is_cluster_url(url: str) -> bool:
    return url.startswith(CLUSTER_SCHEMES)


@dataclass(frozen=True)
class ClusterUrl:
    """A parsed cluster URL: ``username`` / ``password`` ``None`` when the URL has none."""

    tls: bool
    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None

    @classmethod
    def parse(cls, url: str) -> ClusterUrl:
        """Raises ``ValueError`` saying what is wrong (never showing the password)."""
        if not is_cluster_url(url):
            raise ValueError(f"expected {CLUSTER_FORM}")
        scheme, _, rest = url.partition("://")
        userinfo, at, hosts = rest.rpartition("@")
        username = password = None
        if at:
            user, colon, secret = userinfo.partition(":")
            username = unquote(user) or None
            password = unquote(secret) if colon else None
        nodes = []
        for part in hosts.rstrip("/").split(","):
            host, colon, port = part.strip().rpartition(":")
            if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"expected {CLUSTER_FORM}: {part.strip()!r} is not host:port")
            nodes.append((host.strip("[]"), int(port)))
        return cls(scheme.startswith("rediss"), tuple(nodes), username, password)
