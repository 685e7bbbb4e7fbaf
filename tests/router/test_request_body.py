"""The router reads a body with msgspec first and json.loads where msgspec refuses: the result, or
the refusal, is json.loads' in every case; token ids are checked in one pass, as strictly as before."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pof_connector.router.request_body import MAX_TOKEN_ID, BadRequest, json_object, token_ids

_scalars = st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=False) | st.text()
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner,
                                                                                            max_size=5), max_leaves=30)


def _same(raw: bytes) -> None:
    try:
        want: Any = json.loads(raw)
    except (ValueError, RecursionError):
        with pytest.raises(BadRequest):
            json_object(raw)
        return
    if not isinstance(want, dict):
        with pytest.raises(BadRequest, match="must be a JSON object"):
            json_object(raw)
        return
    got = json_object(raw)
    assert got == want and json.dumps(got) == json.dumps(want)      # equal, and floats / ints not swapped


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(), _values, max_size=6))
def test_a_body_reads_as_json_loads_reads_it(body: dict[str, Any]) -> None:
    _same(json.dumps(body).encode())
    _same(json.dumps(body, ensure_ascii=False).encode())


@pytest.mark.parametrize("raw", [
    b'{"a": NaN}', b'{"a": Infinity}', b'{"a": 1e400}', b'{"a": "\\ud800"}', b'\xef\xbb\xbf{"a": 1}',
    '{"a": 1}'.encode("utf-16"), b'{"a": "\xff"}', b'{"a": 1}x', b"", b"[1, 2]", b'"text"',
    b'{"a": 123456789012345678901234567890}', b'{"a": 1, "a": 2}', b"[" * 100_000 + b"]" * 100_000,
    b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
])
def test_odd_bodies_read_or_refused_as_json_loads_does(raw: bytes) -> None:
    _same(raw)


def test_nesting_too_deep_is_named() -> None:
    with pytest.raises(BadRequest, match="nested too deeply"):
        json_object(b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")


@pytest.mark.parametrize("bad", [[True], [1, False], [1.0], [-1], [MAX_TOKEN_ID + 1], ["1"], [1, None], [[1]]])
def test_token_ids_refuse_what_is_not_an_id(bad: list[Any]) -> None:
    with pytest.raises(BadRequest, match="token ids"):
        token_ids(bad)


def test_token_ids_take_ids() -> None:
    assert token_ids([0, 1, MAX_TOKEN_ID]) == [0, 1, MAX_TOKEN_ID] and token_ids([]) == []
