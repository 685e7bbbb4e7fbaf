"""Prefix pins on a Redis-protocol index: one hash, a field per pin (records: :mod:`pof_connector.pins.pin`)."""

from __future__ import annotations

from typing import Any

from pof_connector.index.keyspace import K_PINS


class RedisPins:
    """Mixed into :class:`~pof_connector.index.redis.RedisIndex`: the pin calls of
    :class:`~pof_connector.index.base.LocalityIndex` (the key carries the registry's hash tag, so
    a cluster keeps it on the registry's master: :meth:`_pin_client`)."""

    _call: Any
    _r: Any

    def _pin_client(self) -> Any:
        return self._r

    def put_pin(self, pin_id: str, record: str) -> None:
        self._call("put_pin", lambda: self._pin_client().hset(K_PINS, pin_id, record))

    def pins(self) -> dict[str, str]:
        raw = self._call("pins", lambda: self._pin_client().hgetall(K_PINS))
        return {_text(k): _text(v) for k, v in raw.items()}

    def remove_pin(self, pin_id: str) -> bool:
        return bool(self._call("remove_pin", lambda: self._pin_client().hdel(K_PINS, pin_id)))


def _text(v: bytes | str) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else v
