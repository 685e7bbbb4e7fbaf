"""Redis commands pre-encoded in RESP with numpy: a lookup's 125-2,000 fields framed in one pass
(redis-py's encoding of them cost as much as the round trip)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pof_connector.index.record_runs import FIELD_BYTES
from pof_connector.pages.keys import DIGEST_BYTES, PageKey


def resp(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


_FIELD_RESP = np.frombuffer(b"$16\r\n" + bytes(FIELD_BYTES) + b"\r\n", dtype=np.uint8)


FIELD_RESP_BYTES = len(_FIELD_RESP)
_FIELDS_TEMPLATE = np.tile(_FIELD_RESP, (8192, 1))
"""The framing of up to 8,192 fields, copied whole (faster than filling it in for each lookup)."""


def fields_resp(fields: np.ndarray) -> bytes:
    """The 16-byte ``fields`` as RESP bulk strings, one after the other, built with numpy."""
    n = len(fields)
    body = (_FIELDS_TEMPLATE[:n] if n <= len(_FIELDS_TEMPLATE)
            else np.broadcast_to(_FIELD_RESP, (n, FIELD_RESP_BYTES))).copy()
    body[:, 5:5 + FIELD_BYTES] = fields
    return body.tobytes()


def hmget_head(key: bytes, count: int) -> bytes:
    """The start of ``HMGET key`` with ``count`` fields, in RESP (the fields follow)."""
    return b"*%d\r\n$5\r\nHMGET\r\n$%d\r\n%s\r\n" % (count + 2, len(key), key)


def page_fields(keys: Sequence[PageKey]) -> np.ndarray:
    """The keys' per-page fields (their digests' first 16 bytes), ``[len(keys), 16]`` uint8."""
    return np.frombuffer(b"".join([k.digest for k in keys]), dtype=np.uint8).reshape(-1, DIGEST_BYTES)[:, :FIELD_BYTES]


def hmget_resp(key: bytes, fields: np.ndarray) -> bytes:
    """``HMGET key f1 f2 …`` in RESP: every field is 16 bytes."""
    return hmget_head(key, len(fields)) + fields_resp(fields)


def frame(fields: np.ndarray) -> bytes:
    """Equal-length ``fields`` (rows of uint8) as RESP bulk strings, one after the other."""
    n, width = fields.shape
    if width == FIELD_BYTES:          # the template's copy: a third of the time of filling in the framing
        return fields_resp(fields)
    head = b"$%d\r\n" % width
    body = np.empty((n, len(head) + width + 2), dtype=np.uint8)
    body[:, :len(head)] = np.frombuffer(head, dtype=np.uint8)
    body[:, len(head):len(head) + width] = fields
    body[:, -2:] = np.frombuffer(b"\r\n", dtype=np.uint8)
    return body.tobytes()
