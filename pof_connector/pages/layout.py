"""The canonical page: a header and one contiguous segment per layer.

Byte layout (little-endian)::

    0   magic "POFP"         4s     56  generation         u64
    4   version (3)          u16    64  num_layers         u32
    6   kind (0 mha, 1 mla)  u16    68  segment_bytes      u32
    8   key namespace        16s    72  page_tokens        u32
    24  key chain digest     32s    76  reserved (0)       u32
                                    80  header checksum    u64   xxh3 of bytes [0,80) + [88,header_bytes)
                                    88  checksum seed      u64   the seed of the segment checksums
    96  segment checksums    u64 × num_layers (see below)
    ... zero padding to a multiple of 64 bytes (``header_bytes = roundup(96 + 8 * num_layers, 64)``)
    header_bytes + l * segment_bytes: segment of layer l

Version **3** (the only one written and read) checksums each segment with
:mod:`pof_connector.pages.page_sum` under the page's checksum seed (NH over 1 KiB blocks and a
polynomial mod 2**61 - 1: a stated collision bound for any two different segments, computed
inside the CPU copy and by a GPU where the bytes land); the header checksum covers the seed and
the header's padding too, so every byte of a page is checked. The seed is the writing tier's
(:attr:`pof_connector.tiers.Tier.sum_seed`) and travels with the page when it is re-stamped
elsewhere. Pages of earlier formats (1: xxh3 per segment; 2: word sums) are refused as
``bad_header``: a miss, never wrong bytes.

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

from pof_connector.pages import page_sum
from pof_connector.pages.keys import PageKey

MAGIC = b"POFP"
VERSION = 3
"""The format this build writes."""
READABLE_VERSIONS = (3,)
KIND_MHA = 0
KIND_MLA = 1
MAX_LAYERS = 1024
MAX_SEGMENT_BYTES = 1 << 30
HEADER_ALIGN = 64
_ZERO_KEY = PageKey(bytes(16), bytes(32))

_FIXED = struct.Struct("<4sHH16s32sQIIII")   # everything before the header checksum
_CHECKSUM = struct.Struct("<Q")
_CHECKSUM_AT = _FIXED.size                   # 80
SEED_AT = _CHECKSUM_AT + _CHECKSUM.size      # 88
_SUMS_AT = SEED_AT + 8                       # 96
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


def checksum(data: Any, seed: int) -> int:
    """The segment checksum under ``seed`` (:mod:`pof_connector.pages.page_sum`) of a buffer (bytes,
    memoryview, contiguous numpy array)."""
    return page_sum.checksum(as_array(data), seed)


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
    sum_seed: int
    """The seed the segment checksums were taken under (:mod:`pof_connector.pages.page_sum`)."""

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
                                          f"{', '.join(map(str, READABLE_VERSIONS))}")      # a miss, not wrong bytes
        if kind not in (KIND_MHA, KIND_MLA):
            raise PageError("bad_header", f"kind {kind}")
        if not 1 <= layers <= MAX_LAYERS or not 1 <= seg <= MAX_SEGMENT_BYTES or tokens < 1:
            raise PageError("bad_header", f"geometry layers={layers} segment={seg} tokens={tokens}")
        end = header_bytes_for(layers)
        if len(mv) < end:
            raise PageError("bad_header", f"header of {layers} layers needs {end} bytes, got {len(mv)}")
        (stored,) = _CHECKSUM.unpack_from(mv, _CHECKSUM_AT)
        h = xxhash.xxh3_64(mv[:_CHECKSUM_AT])
        h.update(mv[SEED_AT:end])
        if h.intdigest() != stored:
            raise PageError("bad_header", "header checksum mismatch")
        (seed,) = _CHECKSUM.unpack_from(mv, SEED_AT)
        sums = _sums_struct(layers).unpack_from(mv, _SUMS_AT)
        if expected is not None and expected.digest == digest and expected.namespace == ns:
            key = expected
        else:
            key = PageKey(ns, digest)
        return cls(key, gen, kind, layers, seg, tokens, sums, seed)

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
                  seed: int) -> bytes:
    """A format-v3 header; ``segment_checksums`` were taken under ``seed``."""
    if len(segment_checksums) != spec.num_layers:
        raise ValueError(f"{len(segment_checksums)} segment checksums for {spec.num_layers} layers")
    out = bytearray(spec.header_bytes)
    _header_struct(spec.num_layers).pack_into(
        out, 0, MAGIC, VERSION, spec.kind, key.namespace, key.digest, generation, spec.num_layers,
        spec.segment_bytes, spec.page_tokens, 0, 0, seed, *segment_checksums)
    mv = memoryview(out)
    h = xxhash.xxh3_64(mv[:_CHECKSUM_AT])
    h.update(mv[SEED_AT:spec.header_bytes])
    _CHECKSUM.pack_into(out, _CHECKSUM_AT, h.intdigest())
    return bytes(out)


def header_template(spec: PageSpec) -> bytes:
    """A format-v3 header of ``spec``'s geometry with a zero key, generation, seed and checksums:
    the fixed fields the native whole-page store and load (:func:`pof_connector.pages.page_sum.store_page`)
    fill in and compare against."""
    return encode_header(spec, _ZERO_KEY, 0, [0] * spec.num_layers, 0)


@functools.lru_cache(maxsize=64)
def _sums_struct(num_layers: int) -> struct.Struct:
    return struct.Struct(f"<{num_layers}Q")


@functools.lru_cache(maxsize=64)
def _header_struct(num_layers: int) -> struct.Struct:
    """Fixed fields, the header checksum (packed as 0, set after), the seed and ``num_layers`` segment checksums."""
    return struct.Struct(f"<4sHH16s32sQIIIIQQ{num_layers}Q")


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


def pack_page(spec: PageSpec, key: PageKey, generation: int, layers: Sequence[Any], out: Any,
              seed: int | None = None) -> int:
    """Write a whole page (segments, then header) into ``out`` (``spec.page_bytes`` long), its
    checksums under ``seed`` (``None``: a fresh one); returns the seed."""
    dst = as_array(out)
    if len(dst) < spec.page_bytes:
        raise ValueError(f"page buffer of {len(dst)} bytes, need {spec.page_bytes}")
    if len(layers) != spec.num_layers:
        raise ValueError(f"{len(layers)} layer segments for {spec.num_layers} layers")
    if seed is None:
        seed = page_sum.new_seed()
    sums = page_sum.gather_checksums(dst[spec.header_bytes:spec.page_bytes], [as_array(layer) for layer in layers],
                                     seed)
    dst[:spec.header_bytes] = np.frombuffer(encode_header(spec, key, generation, sums, seed), dtype=np.uint8)
    return seed


def verify_page(spec: PageSpec, page: Any, key: PageKey, generation: int | None = None) -> PageHeader:
    """Check a whole page buffer; returns its header or raises :class:`PageError`."""
    mv = as_array(page)
    header = PageHeader.parse(mv[:spec.header_bytes])
    header.expect(spec, key, generation)
    expect_checksums(header, page_sum.checksums(mv[spec.header_bytes:spec.page_bytes], spec.segment_bytes,
                                                header.sum_seed), header.key.hex())
    return header


def verify_segment(spec: PageSpec, header: PageHeader, layer: int, segment: Any) -> None:
    """Raise ``bad_checksum`` unless ``segment`` (layer ``layer`` of the page of ``header``) has the
    header's checksum."""
    if checksum(segment, header.sum_seed) != header.segment_checksums[layer]:
        raise PageError("bad_checksum", f"layer {layer} of {header.key.hex()}")


def expect_checksums(header: PageHeader, got: Sequence[int], where: str) -> None:
    """Raise ``bad_checksum`` naming the first layer whose checksum in ``got`` is not the header's."""
    if tuple(got) != header.segment_checksums:
        layer = next(i for i, (a, b) in enumerate(zip(got, header.segment_checksums, strict=True)) if a != b)
        raise PageError("bad_checksum", f"layer {layer} of {where}")
