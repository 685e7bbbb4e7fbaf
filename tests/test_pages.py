from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pof_connector.pages.keys import PageKey
from pof_connector.pages.layout import (
    GENERATION_AT,
    PageError,
    PageHeader,
    PageSpec,
    encode_header,
    pack_page,
    verify_page,
)

KEY = PageKey(bytes(range(16)), bytes(range(32)))
OTHER = PageKey(bytes(range(16)), bytes(range(1, 33)))


def make_page(spec: PageSpec, key: PageKey = KEY, generation: int = 7) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(1)
    layers = [rng.integers(0, 255, spec.segment_bytes, dtype=np.uint8) for _ in range(spec.num_layers)]
    page = np.zeros(spec.page_bytes, dtype=np.uint8)
    pack_page(spec, key, generation, layers, page)
    return page, layers


def test_round_trip(spec: PageSpec) -> None:
    page, layers = make_page(spec)
    header = verify_page(spec, page, KEY, 7)
    assert header.key == KEY and header.generation == 7 and header.num_layers == spec.num_layers
    assert header.sum_seed == int.from_bytes(page[88:96].tobytes(), "little") != 0
    for i, layer in enumerate(layers):
        assert bytes(spec.segment(memoryview(page), i)) == layer.tobytes()
    assert spec.header_bytes % 64 == 0 and spec.segment_offset(0) == spec.header_bytes


def test_rejects_wrong_key_generation_checksum_geometry(spec: PageSpec) -> None:
    page, _ = make_page(spec)
    with pytest.raises(PageError) as e:
        verify_page(spec, page, OTHER, 7)
    assert e.value.reason == "wrong_key"
    with pytest.raises(PageError) as e:
        verify_page(spec, page, KEY, 8)
    assert e.value.reason == "stale_generation"
    bad = page.copy()
    bad[spec.segment_offset(2) + 5] ^= 1
    with pytest.raises(PageError) as e:
        verify_page(spec, bad, KEY, 7)
    assert e.value.reason == "bad_checksum"
    other_spec = PageSpec(spec.num_layers, spec.segment_bytes, spec.page_tokens * 2)
    with pytest.raises(PageError) as e:
        verify_page(other_spec, page, KEY, 7)
    assert e.value.reason == "geometry"
    torn = page.copy()
    torn[GENERATION_AT:GENERATION_AT + 8] = 0     # a writer mid-way: header generation zeroed
    with pytest.raises(PageError) as e:
        verify_page(spec, torn, KEY, 7)
    assert e.value.reason == "bad_header"


def test_header_bit_flips_are_caught(spec: PageSpec) -> None:
    page, _ = make_page(spec)
    for pos in range(spec.header_bytes):          # every byte: fields, seed, checksums, padding
        flipped = page.copy()
        flipped[pos] ^= 0x10
        with pytest.raises(PageError):
            verify_page(spec, flipped, KEY, 7)


@settings(max_examples=3000, deadline=None)
@given(st.binary(max_size=2048))
def test_parser_never_crashes_on_garbage(data: bytes) -> None:
    try:
        PageHeader.parse(data)
    except PageError:
        pass


@settings(max_examples=1000, deadline=None)
@given(st.data())
def test_parser_never_crashes_on_mutated_headers(data: st.DataObject) -> None:
    layers = data.draw(st.integers(1, 40))
    spec = PageSpec(layers, 64, 16)
    raw = bytearray(encode_header(spec, KEY, 3, list(range(layers)), 0xABCDEF))
    for _ in range(data.draw(st.integers(1, 8))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    try:
        h = PageHeader.parse(bytes(raw[:cut]))
    except PageError:
        return
    assert h.num_layers == layers and h.sum_seed == 0xABCDEF     # accepted only when intact


def test_pack_validates_inputs(spec: PageSpec) -> None:
    page = np.zeros(spec.page_bytes, dtype=np.uint8)
    with pytest.raises(ValueError):
        pack_page(spec, KEY, 1, [np.zeros(spec.segment_bytes, np.uint8)], page)
    with pytest.raises(ValueError):
        pack_page(spec, KEY, 1, [np.zeros(10, np.uint8)] * spec.num_layers, page)
    with pytest.raises(ValueError):
        PageSpec(0, 10, 10)


def test_the_v3_header_layout() -> None:
    """Byte for byte what the format says: seed at 88, checksums from 96, padding to 64 bytes, and
    the header checksum over [0, 80) + [88, header_bytes)."""
    import struct

    import xxhash

    spec = PageSpec(num_layers=5, segment_bytes=64, page_tokens=2)
    raw = encode_header(spec, KEY, 0x1122, [10, 20, 30, 40, 50], 0xDEADBEEF)
    assert spec.header_bytes == len(raw) == 192                    # roundup(96 + 40, 64)
    assert raw[:4] == b"POFP" and struct.unpack_from("<HH", raw, 4) == (3, 0)
    assert struct.unpack_from("<Q", raw, 56) == (0x1122,)
    assert struct.unpack_from("<IIII", raw, 64) == (5, 64, 2, 0)
    assert struct.unpack_from("<Q", raw, 88) == (0xDEADBEEF,)
    assert struct.unpack_from("<5Q", raw, 96) == (10, 20, 30, 40, 50) and raw[136:] == bytes(56)
    assert struct.unpack_from("<Q", raw, 80) == (xxhash.xxh3_64_intdigest(raw[:80] + raw[88:]),)
    header = PageHeader.parse(raw)
    assert header.sum_seed == 0xDEADBEEF and header.segment_checksums == (10, 20, 30, 40, 50)
