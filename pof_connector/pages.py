"""The canonical page: a header and one contiguous segment per layer.

Byte layout (little-endian)::

    0   magic "POFP"         4s     56  generation         u64
    4   version              u16    64  num_layers         u32
    6   kind (0 mha, 1 mla)  u16    68  segment_bytes      u32
    8   key namespace        16s    72  page_tokens        u32
    24  key chain digest     32s    76  reserved (0)       u32
                                    80  header checksum    u64   xxh3 of bytes [0,80) + [88,header_bytes)
    88  segment checksums    u64 × num_layers (see below)
    ... zero padding to a multiple of 64 bytes (``header_bytes``)
    header_bytes + l * segment_bytes: segment of layer l

Versions: **2** (written now) checksums each segment with :mod:`pof_connector.page_sum` (sums of
32-bit words that a GPU can recompute with torch where the bytes land, and that the CPU computes
inside the copy) and covers the header's padding too, so every byte of a page is checked. **1**
(xxh3-64 of each segment; header checksum over ``[0,80) + [88, 88 + 8 * num_layers)``) is still
read and verified, on the slower two-pass path; any other version is refused as ``bad_header``.

A segment holds one layer's KV for ``page_tokens`` tokens in the canonical order: MHA is K then
V, each ``[page_tokens, kv_heads, head_dim]``; MLA is the latent ``[page_tokens, 1, dim]``.
Engines' native layouts are converted in the adapters. Segments have their own checksums so a
reader can validate and hand over layer 0 before later layers arrive.

A reader accepts a page only when magic, version, geometry, key, generation and checksums all
match; :class:`PageError` says which did not. :meth:`PageHeader.parse` raises nothing else, for
any input.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np
import xxhash

from pof_connector import page_sum
from pof_connector.keys import PageKey

MAGIC = b"POFP"
VERSION = 2
"""The format this build writes."""
READABLE_VERSIONS = (1, 2)
KIND_MHA = 0
KIND_MLA = 1
MAX_LAYERS = 1024
MAX_SEGMENT_BYTES = 1 << 30
HEADER_ALIGN = 64
_ZERO_KEY = PageKey(bytes(16), bytes(32))

_FIXED = struct.Struct("<4sHH16s32sQIIII")   # everything before the header checksum
_CHECKSUM = struct.Struct("<Q")
_CHECKSUM_AT = _FIXED.size                   # 80
_SUMS_AT = _CHECKSUM_AT + _CHECKSUM.size     # 88
GENERATION_AT = 56
assert _CHECKSUM_AT == 80 and struct.calcsize("<4sHH16s32s") == GENERATION_AT


class PageError(ValueError):
    """A page was rejected. ``reason`` is one of: bad_header, geometry, wrong_key,
    stale_generation, bad_checksum, bad_location (a slot outside its region: a hostile or broken
    index record), and the read errors of the fabric."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def header_bytes_for(num_layers: int) -> int:
    raw = _SUMS_AT + 8 * num_layers
    return (raw + HEADER_ALIGN - 1) // HEADER_ALIGN * HEADER_ALIGN


def checksum(data: Any, version: int = VERSION) -> int:
    """The segment checksum of format ``version`` over a buffer (bytes, memoryview, contiguous numpy
    array): :mod:`pof_connector.page_sum`'s for v2, xxh3-64 for v1."""
    if version == 1:
        return xxhash.xxh3_64_intdigest(data)
    return page_sum.checksum(as_array(data))


@dataclass(frozen=True)
class PageSpec:
    """The geometry every page of one namespace shares."""

    num_layers: int
    segment_bytes: int
    page_tokens: int
    kind: int = KIND_MHA

    def __post_init__(self) -> None:
        if not 1 <= self.num_layers <= MAX_LAYERS:
            raise ValueError(f"num_layers must be 1..{MAX_LAYERS}, got {self.num_layers}")
        if not 1 <= self.segment_bytes <= MAX_SEGMENT_BYTES:
            raise ValueError(f"segment_bytes must be 1..{MAX_SEGMENT_BYTES}, got {self.segment_bytes}")
        if self.page_tokens < 1:
            raise ValueError(f"page_tokens must be positive, got {self.page_tokens}")

    @cached_property
    def header_bytes(self) -> int:
        return header_bytes_for(self.num_layers)

    @cached_property
    def page_bytes(self) -> int:
        return self.header_bytes + self.num_layers * self.segment_bytes

    def segment_offset(self, layer: int) -> int:
        return self.header_bytes + layer * self.segment_bytes

    def segment(self, page: Any, layer: int) -> Any:
        """The bytes of ``layer`` inside a page buffer (a slice of the same type)."""
        start = self.segment_offset(layer)
        return page[start:start + self.segment_bytes]


class PageHeader(NamedTuple):
    """A decoded, self-checked header (immutable; a NamedTuple because one is built per page load
    and a frozen dataclass costs several times more to construct)."""

    key: PageKey
    generation: int
    kind: int
    num_layers: int
    segment_bytes: int
    page_tokens: int
    segment_checksums: tuple[int, ...]
    version: int = VERSION
    """The page format (see the module docstring): which segment checksum the page carries."""

    @classmethod
    def parse(cls, buf: Any, expected: PageKey | None = None) -> PageHeader:
        """Decode and self-check a header; raises only :class:`PageError`. ``expected``: the key
        the caller wants, reused as the header's when equal (saves building one per page load);
        ``None``: no expectation (check with :meth:`expect`)."""
        mv = memoryview(buf)
        if mv.ndim != 1 or mv.itemsize != 1:
            mv = mv.cast("B")
        if len(mv) < _SUMS_AT:
            raise PageError("bad_header", f"{len(mv)} bytes is shorter than a header")
        magic, version, kind, ns, digest, gen, layers, seg, tokens, _ = _FIXED.unpack_from(mv, 0)
        if magic != MAGIC:
            raise PageError("bad_header", f"magic {magic!r}")
        if version not in READABLE_VERSIONS:
            raise PageError("bad_header", f"page format version {version}; this build reads "
                                          f"{', '.join(map(str, READABLE_VERSIONS))}")
        if kind not in (KIND_MHA, KIND_MLA):
            raise PageError("bad_header", f"kind {kind}")
        if not 1 <= layers <= MAX_LAYERS or not 1 <= seg <= MAX_SEGMENT_BYTES or tokens < 1:
            raise PageError("bad_header", f"geometry layers={layers} segment={seg} tokens={tokens}")
        end = _SUMS_AT + 8 * layers if version == 1 else header_bytes_for(layers)
        if len(mv) < end:
            raise PageError("bad_header", f"header of {layers} layers needs {end} bytes, got {len(mv)}")
        (stored,) = _CHECKSUM.unpack_from(mv, _CHECKSUM_AT)
        h = xxhash.xxh3_64(mv[:_CHECKSUM_AT])
        h.update(mv[_SUMS_AT:end])
        if h.intdigest() != stored:
            raise PageError("bad_header", "header checksum mismatch")
        sums = _sums_struct(layers).unpack_from(mv, _SUMS_AT)
        if expected is not None and expected.digest == digest and expected.namespace == ns:
            key = expected
        else:
            key = PageKey(ns, digest)
        return cls(key, gen, kind, layers, seg, tokens, sums, version)

    def expect(self, spec: PageSpec, key: PageKey, generation: int | None) -> None:
        """Raise :class:`PageError` unless this header is ``key`` at ``generation`` with ``spec``'s
        geometry. ``generation=None`` accepts any generation (a reader with no location)."""
        if (self.num_layers, self.segment_bytes, self.page_tokens, self.kind) != (
            spec.num_layers, spec.segment_bytes, spec.page_tokens, spec.kind
        ):
            raise PageError("geometry", f"page has layers={self.num_layers} segment={self.segment_bytes} "
                                        f"tokens={self.page_tokens} kind={self.kind}, expected {spec}")
        if self.key != key:
            raise PageError("wrong_key", f"page holds {self.key.hex()}, expected {key.hex()}")
        if generation is not None and self.generation != generation:
            raise PageError("stale_generation", f"generation {self.generation}, expected {generation}")


def encode_header(spec: PageSpec, key: PageKey, generation: int, segment_checksums: Sequence[int],
                  version: int = VERSION) -> bytes:
    """A header; ``version`` 1 only to re-stamp a v1 page (its checksums are xxh3)."""
    if len(segment_checksums) != spec.num_layers:
        raise ValueError(f"{len(segment_checksums)} segment checksums for {spec.num_layers} layers")
    if version not in READABLE_VERSIONS:
        raise ValueError(f"page format version {version}; allowed: {READABLE_VERSIONS}")
    out = bytearray(spec.header_bytes)
    _header_struct(spec.num_layers).pack_into(
        out, 0, MAGIC, version, spec.kind, key.namespace, key.digest, generation, spec.num_layers,
        spec.segment_bytes, spec.page_tokens, 0, 0, *segment_checksums)
    mv = memoryview(out)
    h = xxhash.xxh3_64(mv[:_CHECKSUM_AT])
    h.update(mv[_SUMS_AT:_SUMS_AT + 8 * spec.num_layers if version == 1 else spec.header_bytes])
    _CHECKSUM.pack_into(out, _CHECKSUM_AT, h.intdigest())
    return bytes(out)


def header_template(spec: PageSpec) -> bytes:
    """A format-v2 header of ``spec``'s geometry with a zero key, generation and checksums: the fixed
    fields the native whole-page store and load (:func:`pof_connector.page_sum.store_page`) fill in
    and compare against."""
    return encode_header(spec, _ZERO_KEY, 0, [0] * spec.num_layers)


@functools.lru_cache(maxsize=64)
def _sums_struct(num_layers: int) -> struct.Struct:
    return struct.Struct(f"<{num_layers}Q")


@functools.lru_cache(maxsize=64)
def _header_struct(num_layers: int) -> struct.Struct:
    """Fixed fields, the header checksum (packed as 0, set after) and ``num_layers`` segment checksums."""
    return struct.Struct(f"<4sHH16s32sQIIIIQ{num_layers}Q")


def as_array(buf: Any) -> np.ndarray:
    """A flat uint8 array over a buffer (numpy array, CPU tensor, bytes, memoryview), no copy."""
    if type(buf) is np.ndarray and buf.dtype == np.uint8 and buf.ndim == 1 and buf.flags.c_contiguous:
        return buf      # the hot path: checked first, it costs ~0.2 µs instead of ~3 µs
    if type(buf).__module__ == "torch" and type(buf).__name__ == "Tensor":
        import torch  # only reached when the caller already uses torch

        buf = buf.view(-1).view(torch.uint8).numpy()   # view(-1) refuses a non-contiguous tensor
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("page segments must be contiguous")
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


def pack_page(spec: PageSpec, key: PageKey, generation: int, layers: Sequence[Any], out: Any) -> None:
    """Write a whole page (segments, then header) into ``out`` (``spec.page_bytes`` long)."""
    dst = as_array(out)
    if len(dst) < spec.page_bytes:
        raise ValueError(f"page buffer of {len(dst)} bytes, need {spec.page_bytes}")
    if len(layers) != spec.num_layers:
        raise ValueError(f"{len(layers)} layer segments for {spec.num_layers} layers")
    sums = page_sum.gather_checksums(dst[spec.header_bytes:spec.page_bytes], [as_array(layer) for layer in layers])
    dst[:spec.header_bytes] = np.frombuffer(encode_header(spec, key, generation, sums), dtype=np.uint8)


def verify_page(spec: PageSpec, page: Any, key: PageKey, generation: int | None = None) -> PageHeader:
    """Check a whole page buffer; returns its header or raises :class:`PageError`."""
    mv = as_array(page)
    header = PageHeader.parse(mv[:spec.header_bytes])
    header.expect(spec, key, generation)
    if header.version == 1:
        for layer in range(spec.num_layers):
            verify_segment(spec, header, layer, spec.segment(mv, layer))
    else:
        expect_checksums(header, page_sum.checksums(mv[spec.header_bytes:spec.page_bytes], spec.segment_bytes),
                         header.key.hex())
    return header


def verify_segment(spec: PageSpec, header: PageHeader, layer: int, segment: Any) -> None:
    if checksum(segment, header.version) != header.segment_checksums[layer]:
        raise PageError("bad_checksum", f"layer {layer} of {header.key.hex()}")


def expect_checksums(header: PageHeader, got: Sequence[int], where: str) -> None:
    """Raise ``bad_checksum`` naming the first layer whose checksum in ``got`` is not the header's."""
    if tuple(got) != header.segment_checksums:
        layer = next(i for i, (a, b) in enumerate(zip(got, header.segment_checksums, strict=True)) if a != b)
        raise PageError("bad_checksum", f"layer {layer} of {where}")


def expect_xxh3_checksums(spec: PageSpec, header: PageHeader, page: Any, where: str) -> None:
    """Format v1 (xxh3, host only): raise ``bad_checksum`` naming the first layer of ``page`` (a
    whole page in host memory) whose checksum is not the header's."""
    for layer, expected in enumerate(header.segment_checksums):
        if checksum(spec.segment(page, layer), 1) != expected:
            raise PageError("bad_checksum", f"layer {layer} of {where}")
