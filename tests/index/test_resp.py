"""Pre-encoded RESP (pof_connector.index.resp): the framing a lookup sends must be what redis-py's
encoder would send."""

from __future__ import annotations

import numpy as np
import pytest

from pof_connector.index.resp import frame, hmget_resp


def framed(rows: np.ndarray) -> bytes:
    """RESP bulk strings of ``rows``, one at a time."""
    return b"".join(b"$%d\r\n%s\r\n" % (len(r), r.tobytes()) for r in rows)


@pytest.mark.parametrize("shape", [(0, 16), (1, 16), (125, 16), (9000, 16), (3, 20), (125, 20)])
def test_frame_is_bulk_strings_of_each_row(shape: tuple[int, int]) -> None:
    """16-byte rows (a lookup's fields) take the template's path, other widths (record fields) the
    general one; both give the same bytes as framing each row, on a copy or a view."""
    rows = np.random.default_rng(shape[0]).integers(0, 256, shape, dtype=np.uint8)
    assert frame(rows) == framed(rows)
    assert frame(rows[::-1]) == framed(rows[::-1])


def test_hmget_is_the_command_with_its_fields() -> None:
    rows = np.random.default_rng(1).integers(0, 256, (4, 16), dtype=np.uint8)
    assert hmget_resp(b"k", rows) == b"*6\r\n$5\r\nHMGET\r\n$1\r\nk\r\n" + framed(rows)
