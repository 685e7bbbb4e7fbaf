"""Secrets taken from an environment variable or a file, never written into a config.

A config names *where* a secret is (``index_password_env: POF_INDEX_PASSWORD``,
``api_key_file: /run/secrets/router-key``); the secret itself is read when a client or server
is built and kept only there. Every error names the key and the variable or path, never the
value. :class:`IndexAuth` is how the locality index is reached: an ACL user's password and TLS
(``rediss://``) files, turned into a Redis client by :func:`pof_connector.index.client.redis_client`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pof_connector.config.config_error import ConfigError

INDEX_AUTH_KEYS = ("index_username", "index_password_env", "index_password_file", "index_tls_ca_file",
                   "index_tls_cert_file", "index_tls_key_file")
"""Keys of the pool and router configs that say how to authenticate to the index."""
OWN_SERVER_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")
"""``index_url`` forms of a server (or cluster) that the operator runs: those take credentials."""


def read_secret(env: str | None, path: str | None, key: str) -> str | None:
    """The secret in environment variable ``env`` or in file ``path`` (its trailing newline
    stripped); ``None`` when neither is given. ``key`` names the config key (``api_key``) whose
    ``_env`` / ``_file`` form was used, for the :class:`ConfigError` raised when the variable is
    unset, the file cannot be read, both are given or the secret is empty."""
    if env is not None and path is not None:
        raise ConfigError(f"{key}_env, {key}_file: give one of them, not both")
    if env is not None:
        value = os.environ.get(env)
        if value is None:
            raise ConfigError(f"{key}_env: the environment variable {env!r} is not set")
        where = f"{key}_env: the environment variable {env!r}"
    elif path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                value = f.read().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
            raise ConfigError(f"{key}_file: cannot read {path!r}: {why}") from None
        where = f"{key}_file: {path!r}"
    else:
        return None
    if not value:
        raise ConfigError(f"{where} is empty")
    return value


def _opt_str(raw: Mapping[str, Any], key: str) -> str | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}: expected a non-empty string, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class IndexAuth:
    """How to authenticate to the index server; holds names and paths, never the password.

    ``username``: a Redis ACL user (``None``: the one in the URL, else ``default``).
    ``password_env`` / ``password_file``: where its password is (``None`` for both: the URL's
    password, or none). ``tls_ca_file``: the CA that signed a ``rediss://`` server's certificate
    (``None``: the system's CAs). ``tls_cert_file`` / ``tls_key_file``: a client certificate for
    servers that require one (``None``: none).
    """

    username: str | None = None
    password_env: str | None = None
    password_file: str | None = None
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], index_url: str | None) -> IndexAuth:
        """The ``index_*`` keys of a config, checked against ``index_url`` and read once, so a
        missing variable or file is a :class:`ConfigError` at start-up, not a failing index."""
        auth = cls(username=_opt_str(raw, "index_username"), password_env=_opt_str(raw, "index_password_env"),
                   password_file=_opt_str(raw, "index_password_file"),
                   tls_ca_file=_opt_str(raw, "index_tls_ca_file"),
                   tls_cert_file=_opt_str(raw, "index_tls_cert_file"),
                   tls_key_file=_opt_str(raw, "index_tls_key_file"))
        auth.check(index_url)
        return auth

    @property
    def given(self) -> bool:
        return any(getattr(self, k[len("index_"):]) is not None for k in INDEX_AUTH_KEYS)

    def check(self, index_url: str | None) -> None:
        """Raise :class:`ConfigError` naming the key when these settings cannot work."""
        if not self.given:
            return
        if index_url is None or not index_url.startswith(OWN_SERVER_SCHEMES):
            raise ConfigError(f"{self._first_key()}: only for an index server of your own (index_url redis://, "
                              f"rediss://, unix://, redis+cluster:// or rediss+cluster://); the embedded and "
                              f"local indexes take no credentials")
        userinfo = index_url.partition("://")[2].rpartition("@")[0]
        # redis-py lets the URL's user and password win over these keys: refuse the ambiguity.
        if userinfo and self.username is not None:
            raise ConfigError("index_username: index_url names a user too; give it once")
        if ":" in userinfo and (self.password_env is not None or self.password_file is not None):
            raise ConfigError("index_password_env / index_password_file: index_url carries a password too; "
                              "give it once (and not in the URL)")
        self.password()
        tls = {"index_tls_ca_file": self.tls_ca_file, "index_tls_cert_file": self.tls_cert_file,
               "index_tls_key_file": self.tls_key_file}
        for key, path in tls.items():
            if path is None:
                continue
            if not index_url.startswith(("rediss://", "rediss+cluster://")):
                raise ConfigError(f"{key}: TLS files are for a rediss:// or rediss+cluster:// index_url")
            if not os.access(path, os.R_OK):
                raise ConfigError(f"{key}: cannot read {path!r}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError("index_tls_cert_file, index_tls_key_file: a client certificate needs both")

    def _first_key(self) -> str:
        return next(k for k in INDEX_AUTH_KEYS if getattr(self, k[len("index_"):]) is not None)

    def password(self) -> str | None:
        """The password, read now; ``None`` when none is configured here."""
        return read_secret(self.password_env, self.password_file, "index_password")

    def redis_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``redis.Redis.from_url`` that carry these settings."""
        kw: dict[str, Any] = {}
        if self.username is not None:
            kw["username"] = self.username
        password = self.password()
        if password is not None:
            kw["password"] = password
        if self.tls_ca_file is not None:
            kw["ssl_ca_certs"] = self.tls_ca_file
        if self.tls_cert_file is not None:
            kw["ssl_certfile"] = self.tls_cert_file
            kw["ssl_keyfile"] = self.tls_key_file
        return kw

    def to_mapping(self) -> dict[str, Any]:
        return {k: getattr(self, k[len("index_"):]) for k in INDEX_AUTH_KEYS}


__all__ = ["INDEX_AUTH_KEYS", "IndexAuth", "read_secret"]
