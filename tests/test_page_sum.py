"""Format v2's segment checksum: one definition on every implementation (native kernel, numpy
fallback, torch), fused copies that match plain ones, v1 pages still read, and no flipped bit
anywhere in a page gets past a load."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from pof_connector import page_sum
from pof_connector.keys import PageKey
from pof_connector.pages import PageError, PageHeader, PageSpec, encode_header, pack_page, verify_page
from pof_connector.tiers import CpuDramTier, SlotRef

ROOT = Path(__file__).resolve().parents[1]

KEY = PageKey(bytes(range(16)), bytes(range(32)))
SPEC = PageSpec(num_layers=3, segment_bytes=1000, page_tokens=4)     # 1000: not a multiple of 64


def reference(data: bytes) -> int:
    """The definition, word by word in Python integers."""
    padded = data + bytes(-len(data) % 4)
    words = struct.unpack(f"<{len(padded) // 4}I", padded)
    n = len(words)
    a = sum(words)
    b = sum((n - i) * w for i, w in enumerate(words))
    return (a + page_sum.MIX * b) % (1 << 64)


@pytest.fixture(params=["native", "numpy"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each test runs on the native kernel and on the numpy fallback (what an install without a C
    compiler runs)."""
    if request.param == "native":
        if page_sum.NATIVE is None:
            pytest.skip("the native kernel was not built here")
    else:
        monkeypatch.setattr(page_sum, "_native", None)
    yield request.param


def test_a_kernel_built_before_the_whole_page_calls_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """An editable install whose extension was not rebuilt has the old kernel: pages still store
    and load, on the Python path, instead of raising AttributeError in every tier call."""
    if page_sum.NATIVE is None:
        pytest.skip("the native kernel was not built here")
    monkeypatch.setattr(page_sum, "_native", _OldKernel(page_sum._native))
    tier = CpuDramTier(SPEC, 2 * SPEC.page_bytes + 256)
    layers = [np.full(SPEC.segment_bytes, i, dtype=np.uint8) for i in range(SPEC.num_layers)]
    got = tier.prepare_store(KEY)
    assert got is not None
    tier.write(got[0], KEY, layers)
    tier.complete_store(KEY, True)
    out = np.zeros(SPEC.page_bytes, dtype=np.uint8)
    tier.read(got[0], KEY, out)
    assert np.array_equal(out[SPEC.header_bytes:], np.concatenate(layers))


class _OldKernel:
    """The kernel as built before the whole-page calls: every function but those two."""

    def __init__(self, kernel: Any) -> None:
        self._k = kernel

    def __getattr__(self, name: str) -> Any:
        if name in ("store_page", "load_page"):
            raise AttributeError(name)
        return getattr(self._k, name)


def test_native_kernel_is_built() -> None:
    """CI builds the package with its kernel (pip install -e .): a silent fallback would halve the
    data path's speed. Set POF_ALLOW_NO_NATIVE=1 where no compiler exists on purpose."""
    import os

    if os.environ.get("POF_ALLOW_NO_NATIVE") != "1":
        assert page_sum.NATIVE in ("avx2", "generic")


@settings(max_examples=300, deadline=None)
@given(data=st.binary(min_size=1, max_size=600))
def test_every_implementation_matches_the_definition(data: bytes) -> None:
    arr = np.frombuffer(data, dtype=np.uint8)
    want = reference(data)
    assert page_sum._numpy_checksum(arr) == want
    if page_sum._native is not None:
        assert page_sum._native.checksums(arr, len(arr)) == (want,)
        dst = np.zeros(len(arr), dtype=np.uint8)
        assert page_sum._native.copy_checksums(dst, arr, len(arr)) == (want,) and dst.tobytes() == data


@pytest.mark.parametrize("seg", [1, 3, 64, 1000, 4096, 65_539])
def test_fused_copies_match_plain_ones(impl: str, seg: int) -> None:
    rng = np.random.default_rng(seg)
    src = rng.integers(0, 256, 4 * seg, dtype=np.uint8)
    want = tuple(reference(src[i:i + seg].tobytes()) for i in range(0, 4 * seg, seg))
    assert page_sum.checksums(src, seg) == want
    dst = np.zeros_like(src)
    assert page_sum.copy_checksums(dst, src, seg) == want and np.array_equal(dst, src)
    gathered = np.zeros_like(src)
    parts = [src[i:i + seg] for i in range(0, 4 * seg, seg)]
    assert page_sum.gather_checksums(gathered, parts) == want and np.array_equal(gathered, src)
    if seg > 1:
        with pytest.raises(ValueError):
            page_sum.copy_checksums(dst[:-1], src[:-1], seg)      # not a whole number of segments
    with pytest.raises(ValueError):
        page_sum.gather_checksums(gathered, [*parts[:3], src[:seg + 1]])


def at_offset(nbytes: int, offset: int) -> np.ndarray:
    """``nbytes`` zero bytes at an address ``offset`` past a 64-byte boundary: 0 takes the
    streaming stores (whole lines, 64-byte aligned blocks, as vLLM's are), 4 the plain ones."""
    raw = np.zeros(nbytes + 128, dtype=np.uint8)
    start = (-raw.ctypes.data) % 64 + offset
    return raw[start:start + nbytes]


def kt_blocks(tokens: int, heads: int, dim: int, word: type, blocks: int, offset: int = 0) -> np.ndarray:
    """A zeroed cache of ``blocks`` vLLM CPU blocks (``[blocks, heads * 2 * tokens * dim]`` words)
    ``offset`` bytes past a 64-byte boundary."""
    size = heads * 2 * tokens * dim * np.dtype(word).itemsize
    return at_offset(blocks * size, offset).view(word).reshape(blocks, -1)


@pytest.mark.parametrize("offset", [0, 4], ids=["aligned", "unaligned"])
@pytest.mark.parametrize(("tokens", "heads", "dim", "itemsize", "blocks", "skip"), [
    (32, 3, 24, 4, 2, 0),      # fp32, 8x8 register tiles (AVX2); aligned: pairs of them, streamed
    (32, 3, 24, 2, 3, 1),      # 16-bit, 8x8 register tiles (SSE2)
    (16, 2, 32, 4, 2, 1),      # V rows of whole 64-byte blocks: summed as they are copied (aligned: streamed)
    (8, 2, 16, 4, 2, 1),       # fp32 tokens not a multiple of 16: single tiles, plain stores
    (24, 2, 64, 2, 2, 0),      # 16-bit V rows of 128 bytes: summed as they are copied
    (12, 2, 8, 2, 2, 0),       # tokens not a multiple of 8: the plain loops
    (16, 1, 16, 1, 2, 1),      # 8-bit elements: the plain loops, V rows of 16 bytes summed apart
])
def test_kt_copy_writes_the_cpu_cache_layout_and_sums_the_segment(tokens: int, heads: int, dim: int, itemsize: int,
                                                                  blocks: int, skip: int, offset: int) -> None:
    """vLLM's CPU cache block per head: K^T [dim, tokens] then V [tokens, dim], from a canonical
    segment K [blocks * tokens, heads, dim] then V; checked against numpy's transpose. The page's
    blocks go to cache blocks in reverse order; the cache's other blocks stay zero."""
    if page_sum.NATIVE is None:
        pytest.skip("the native kernel was not built here")
    word = {1: np.uint8, 2: np.uint16, 4: np.uint32}[itemsize]
    rng = np.random.default_rng(tokens * heads * dim + itemsize)
    k, v = rng.integers(0, np.iinfo(word).max, (2, blocks * tokens, heads, dim), dtype=np.uint64).astype(word)
    segment = np.concatenate([k.ravel(), v.ravel()]).view(np.uint8)
    cache = kt_blocks(tokens, heads, dim, word, blocks + 2, offset)
    ids = list(range(blocks - skip, 0, -1))             # block 0 and the last one are not the page's
    got = page_sum.kt_copy_pages(cache.view(np.uint8), [(segment, ids, skip)], tokens, heads, dim, itemsize)
    assert got == [page_sum.checksum(segment)]
    for b, at in enumerate(ids, start=skip):
        block = cache[at].reshape(heads, 2, tokens * dim)
        rows = slice(b * tokens, (b + 1) * tokens)
        for h in range(heads):
            assert np.array_equal(block[h, 0].reshape(dim, tokens), k[rows, h].T)
            assert np.array_equal(block[h, 1].reshape(tokens, dim), v[rows, h])
    assert not cache[0].any() and not cache[-1].any()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kt_copy_of_many_pages_on_several_threads_writes_and_sums_each_page(threads: int) -> None:
    """Many pages in one call (as a vLLM layer's load is), copied side by side by the caller and
    the kernel's helper threads: every page lands in its own blocks, byte for byte what a page
    copied alone writes, and each page's checksum is its own."""
    if page_sum.NATIVE is None:
        pytest.skip("the native kernel was not built here")
    tokens, heads, dim, blocks = 32, 2, 16, 2
    rng = np.random.default_rng(threads)
    segments = [rng.integers(0, 1 << 32, 2 * blocks * tokens * heads * dim, dtype=np.uint64).astype(np.uint32)
                .view(np.uint8) for _ in range(9)]
    pages = [(seg, [2 * i + 1, 2 * i] if i % 2 else [2 * i, 2 * i + 1], 0) for i, seg in enumerate(segments)]
    cache = kt_blocks(tokens, heads, dim, np.uint32, 2 * len(pages))
    got = page_sum.kt_copy_pages(cache.view(np.uint8), pages, tokens, heads, dim, 4, threads=threads)
    assert got == [page_sum.checksum(seg) for seg in segments]
    for seg, ids, _ in pages:
        alone = kt_blocks(tokens, heads, dim, np.uint32, blocks)
        page_sum.kt_copy_pages(alone.view(np.uint8), [(seg, [0, 1], 0)], tokens, heads, dim, 4)
        assert np.array_equal(cache[ids], alone)


def test_kt_copy_from_several_callers_at_once_copies_each_callers_pages() -> None:
    """Callers on several threads at once (the crew of helpers serves one of them, the others copy
    alone): every call writes its own pages and returns its own checksums, many times over."""
    if page_sum.NATIVE is None:
        pytest.skip("the native kernel was not built here")
    tokens, heads, dim = 16, 2, 16
    seg_bytes = 2 * tokens * heads * dim * 4

    def caller(seed: int) -> bool:
        rng = np.random.default_rng(seed)
        segments = [rng.integers(0, 256, seg_bytes, dtype=np.uint8) for _ in range(8)]
        want = [page_sum.checksum(s) for s in segments]
        cache = kt_blocks(tokens, heads, dim, np.uint32, 8)
        ok = True
        for _ in range(200):
            got = page_sum.kt_copy_pages(cache.view(np.uint8), [(s, [i], 0) for i, s in enumerate(segments)],
                                         tokens, heads, dim, 4, threads=3)
            ok = ok and got == want
        alone = kt_blocks(tokens, heads, dim, np.uint32, 8)
        page_sum.kt_copy_pages(alone.view(np.uint8), [(s, [i], 0) for i, s in enumerate(segments)],
                               tokens, heads, dim, 4)
        return ok and np.array_equal(cache, alone)

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(caller, range(4)))


HELPERS_CHILD = """
import json, os
import numpy as np
from pof_connector import page_sum
os.sched_setaffinity(0, {0})          # pinned, as a CPU engine pins its forward thread
seg = np.arange(2 * 16 * 2 * 16 * 4, dtype=np.uint32).view(np.uint8)[: 2 * 16 * 2 * 16 * 4]
cache = np.zeros((4, 2, 2, 16 * 16 * 4), dtype=np.uint8)
before = set(os.listdir("/proc/self/task"))
page_sum.kt_copy_pages(cache.reshape(-1), [(seg, [i], 0) for i in range(4)], 16, 2, 16, 4, threads=2)
helpers = set(os.listdir("/proc/self/task")) - before
cpus = [os.sched_getaffinity(int(t)) for t in helpers]
pid = os.fork()
if pid == 0:          # a child of fork starts a crew of its own (none of the parent's threads came along)
    got = page_sum.kt_copy_pages(cache.reshape(-1), [(seg, [i], 0) for i in range(4)], 16, 2, 16, 4, threads=2)
    os._exit(0 if got == [page_sum.checksum(seg)] * 4 else 1)
_, status = os.waitpid(pid, 0)
print(json.dumps({"helpers": len(helpers), "cpus": sorted(set().union(*cpus)),
                  "child": os.waitstatus_to_exitcode(status)}))
"""


def test_kt_copy_helpers_run_beside_a_pinned_caller_and_survive_fork() -> None:
    """The first call with ``threads=2`` starts one helper, placed on the cores the (pinned)
    caller does not use; a forked child copies right (its own crew, no lock held from the parent)."""
    if page_sum.NATIVE is None:
        pytest.skip("the native kernel was not built here")
    cpus = os.sched_getaffinity(0)
    if 0 not in cpus or len(cpus) < 2:
        pytest.skip("needs CPU 0 and another one")
    out = json.loads(subprocess.run([sys.executable, "-c", HELPERS_CHILD], capture_output=True, text=True,
                                    timeout=60, check=True).stdout)
    assert out["helpers"] == 1 and out["cpus"] and 0 not in out["cpus"]
    assert out["child"] == 0


LATE_HELPER_CHILD = """
import json, os, time
import numpy as np
from pof_connector import page_sum
native = page_sum._native
tokens, heads, dim = 32, 4, 32
rng = np.random.default_rng(0)
segs = [rng.integers(0, 256, 2 * tokens * heads * dim * 4, dtype=np.uint8) for _ in range(64)]
want = [page_sum.checksum(s) for s in segs]
cache = np.zeros((64, 2 * tokens * heads * dim * 4), dtype=np.uint8)
alone = cache.copy()
page_sum.kt_copy_pages(alone.reshape(-1), [(s, [i], 0) for i, s in enumerate(segs)], tokens, heads, dim, 4)
calls = []
for _ in range(40):          # until the helper claims a page (it may not wake before the caller is done)
    t0 = time.perf_counter()
    got = page_sum.kt_copy_pages(cache.reshape(-1), [(s, [i], 0) for i, s in enumerate(segs)], tokens, heads, dim,
                                 4, threads=2)
    calls.append((time.perf_counter() - t0, got == want))
    if native.crew_stats()[1]:
        break
late = native.crew_stats()
t0 = time.perf_counter()
page_sum.settle()
print(json.dumps({"calls": calls, "late": late, "settle_s": time.perf_counter() - t0,
                  "after": native.crew_stats(), "same": bool(np.array_equal(cache, alone))}))
"""


def test_kt_copy_does_not_wait_for_a_late_helper_and_settle_does() -> None:
    """A helper stalled mid-page (fault injection: it sleeps 0.5 s on every page it claims, as a
    helper the OS descheduled) holds nobody up: the caller copies that page again itself and
    returns with every page right; the late helper's call stays alive until it left, and
    ``settle`` returns only then."""
    if page_sum.NATIVE is None:
        pytest.skip("the native kernel was not built here")
    env = {**os.environ, "POF_CREW_STALL_US": "500000"}
    run = subprocess.run([sys.executable, "-c", LATE_HELPER_CHILD], capture_output=True, text=True, timeout=120,
                         check=True, env=env)
    out = json.loads(run.stdout)
    _, stolen, retired = out["late"]
    assert stolen >= 1 and retired == 1, out          # the caller took the helper's page over
    assert all(right for _, right in out["calls"]), out
    assert out["calls"][-1][0] < 0.25, out           # ... without waiting out the helper's 0.5 s
    assert out["settle_s"] > 0.1 and out["after"][2] == 0, out
    assert out["same"]


def test_kt_copy_refuses_pages_that_do_not_fit_the_cache() -> None:
    if page_sum.NATIVE is None:
        pytest.skip("the native kernel was not built here")
    tokens, heads, dim = 16, 2, 16
    cache = kt_blocks(tokens, heads, dim, np.uint32, 3).view(np.uint8)
    seg = np.zeros(2 * 2 * tokens * heads * dim * 4, dtype=np.uint8)        # two blocks
    with pytest.raises(IndexError):
        page_sum.kt_copy_pages(cache, [(seg, [1, 3], 0)], tokens, heads, dim, 4)     # no block 3
    with pytest.raises(IndexError):
        page_sum.kt_copy_pages(cache, [(seg, [-1], 1)], tokens, heads, dim, 4)
    with pytest.raises(ValueError):
        page_sum.kt_copy_pages(cache, [(seg, [0], 0)], tokens, heads, dim, 4)        # two blocks, one id
    with pytest.raises(ValueError):
        page_sum.kt_copy_pages(cache, [(seg[:-64], [0, 1], 0)], tokens, heads, dim, 4)
    with pytest.raises(ValueError):
        page_sum.kt_copy_pages(cache.ravel()[:-64], [(seg, [0, 1], 0)], tokens, heads, dim, 4)  # not whole blocks
    with pytest.raises(TypeError):
        page_sum.kt_copy_pages(cache, [[seg, [0, 1], 0]], tokens, heads, dim, 4)       # not a tuple
    with pytest.raises(TypeError):
        page_sum.kt_copy_pages(bytes(cache), [(seg, [0, 1], 0)], tokens, heads, dim, 4)   # a read-only cache
    assert not cache.any()          # nothing was written by a refused call


@pytest.mark.parametrize(("tokens", "heads", "dim", "blocks", "skip"), [
    (16, 2, 16, 2, 0),         # one 16-token group, one 8-word register tile per row
    (32, 3, 48, 3, 1),         # two groups, three tiles per row
    (48, 1, 80, 2, 1),         # three groups, five tiles per row
])
def test_vnni_copy_writes_the_amx_layout_and_sums_the_segment(tokens: int, heads: int, dim: int, blocks: int,
                                                              skip: int) -> None:
    """vLLM's CPU cache block per head with the amx ISA (bf16): element (token t, dim d) of K at
    (t // 16) * 16 * dim + (d // 2) * 32 + (t % 16) * 2 + d % 2, of V at tokens * dim +
    (d // 16) * tokens * 16 + (t // 2) * 32 + (d % 16) * 2 + t % 2; checked element by element."""
    if page_sum.NATIVE is None:
        pytest.skip("the native kernel was not built here")
    rng = np.random.default_rng(tokens + heads + dim)
    k, v = rng.integers(0, 1 << 16, (2, blocks * tokens, heads, dim), dtype=np.uint64).astype(np.uint16)
    segment = np.concatenate([k.ravel(), v.ravel()]).view(np.uint8)
    cache = kt_blocks(tokens, heads, dim, np.uint16, blocks - skip)
    ids = list(range(blocks - skip))
    got = page_sum.kt_copy_pages(cache.view(np.uint8), [(segment, ids, skip)], tokens, heads, dim, 2, True)
    assert got == [page_sum.checksum(segment)]
    t, d = np.meshgrid(np.arange(tokens), np.arange(dim), indexing="ij")
    k_at = (t // 16) * 16 * dim + (d // 2) * 32 + (t % 16) * 2 + d % 2
    v_at = tokens * dim + (d // 16) * tokens * 16 + (t // 2) * 32 + (d % 16) * 2 + t % 2
    for b, at in enumerate(ids, start=skip):
        block = cache[at].reshape(heads, 2 * tokens * dim)
        rows = slice(b * tokens, (b + 1) * tokens)
        for h in range(heads):
            assert np.array_equal(block[h][k_at], k[rows, h]) and np.array_equal(block[h][v_at], v[rows, h])
    with pytest.raises(ValueError):      # VNNI tiles are 16-bit, in 16-token and 16-dimension steps
        page_sum.kt_copy_pages(cache.view(np.uint8), [(segment, ids, skip)], tokens, heads, dim, 4, True)


def test_single_word_errors_and_swaps_change_the_checksum() -> None:
    rng = np.random.default_rng(7)
    seg = rng.integers(0, 256, 4096, dtype=np.uint8)
    base = page_sum.checksum(seg)
    for pos in (0, 1, 2047, 4095):
        for bit in range(8):
            x = seg.copy()
            x[pos] ^= 1 << bit
            assert page_sum.checksum(x) != base
    words = seg.view("<u4").copy()
    words[[3, 900]] = words[[900, 3]]
    assert words[3] != words[900] and page_sum.checksum(words.view(np.uint8)) != base


def make_page(spec: PageSpec, seed: int = 1, generation: int = 9) -> np.ndarray:
    rng = np.random.default_rng(seed)
    layers = [rng.integers(0, 256, spec.segment_bytes, dtype=np.uint8) for _ in range(spec.num_layers)]
    page = np.zeros(spec.page_bytes, dtype=np.uint8)
    pack_page(spec, KEY, generation, layers, page)
    return page


def test_pages_round_trip_on_both_implementations(impl: str) -> None:
    page = make_page(SPEC)
    header = verify_page(SPEC, page, KEY, 9)
    assert header.version == 2
    tier = CpuDramTier(SPEC, 4 * SPEC.page_bytes + 256)
    ref = tier.prepare_store(KEY)
    assert ref is not None
    tier.write_page(ref[0], page)
    out = np.zeros(SPEC.page_bytes, dtype=np.uint8)
    tier.read(ref[0], KEY, out)
    assert np.array_equal(out[SPEC.header_bytes:], page[SPEC.header_bytes:])


def v1_page(spec: PageSpec, generation: int = 9) -> np.ndarray:
    """A page as a build of format v1 wrote it (xxh3 segment checksums)."""
    page = make_page(spec, generation=generation)
    sums = [xxhash.xxh3_64_intdigest(spec.segment(page, i).tobytes()) for i in range(spec.num_layers)]
    page[:spec.header_bytes] = np.frombuffer(encode_header(spec, KEY, generation, sums, version=1), dtype=np.uint8)
    return page


def test_v1_pages_are_still_read_and_checked() -> None:
    page = v1_page(SPEC)
    assert verify_page(SPEC, page, KEY, 9).version == 1
    tier = CpuDramTier(SPEC, 4 * SPEC.page_bytes + 256)
    got = tier.prepare_store(KEY)
    assert got is not None
    ref = got[0]
    tier.write_page(ref, page)                     # re-stamped, still v1 with its xxh3 checksums
    out = np.zeros(SPEC.page_bytes, dtype=np.uint8)
    assert tier.read(ref, KEY, out).version == 1
    header = tier.read_header(ref, KEY, np.zeros(SPEC.header_bytes, dtype=np.uint8))
    tier.check_segment(ref, header, 2)
    tier.segment_view(ref, 2)[5] ^= 1
    with pytest.raises(PageError) as e:
        tier.check_segment(ref, header, 2)
    assert e.value.reason == "bad_checksum"
    with pytest.raises(PageError) as e:            # the whole-page read checks v1 sums too, by layer
        tier.read(ref, KEY, out)
    assert e.value.reason == "bad_checksum" and "layer 2" in str(e.value)
    bad = page.copy()
    bad[SPEC.segment_offset(1)] ^= 4
    with pytest.raises(PageError) as e:
        verify_page(SPEC, bad, KEY, 9)
    assert e.value.reason == "bad_checksum"


def test_unknown_versions_are_refused_by_name() -> None:
    raw = bytearray(encode_header(SPEC, KEY, 3, [0] * SPEC.num_layers))
    raw[4:6] = (3).to_bytes(2, "little")
    with pytest.raises(PageError) as e:
        PageHeader.parse(bytes(raw))
    assert e.value.reason == "bad_header" and "version 3" in str(e.value) and "reads 1, 2" in str(e.value)


@pytest.fixture(scope="module")
def stored() -> tuple[CpuDramTier, np.ndarray]:
    tier = CpuDramTier(SPEC, 2 * SPEC.page_bytes + 256)
    got = tier.prepare_store(KEY)
    assert got is not None
    tier.write_page(got[0], make_page(SPEC, generation=1))
    tier.complete_store(KEY, True)
    return tier, tier.region[:SPEC.page_bytes].copy()


@settings(max_examples=400, deadline=None)
@given(bit=st.integers(0, 8 * SPEC.page_bytes - 1))
def test_a_flipped_bit_anywhere_in_a_page_is_refused(stored: tuple[CpuDramTier, np.ndarray], bit: int) -> None:
    """Header (fields, checksums, padding), generation word and every segment: any single flipped
    bit makes the whole-page load, the layer-wise load and a plain verify refuse the page."""
    tier, clean = stored
    ref = next(r for _, r in tier.stored())
    flipped = clean.copy()
    flipped[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(PageError):
        verify_page(SPEC, flipped, KEY, ref.generation)
    slot = tier.region[tier.slot_offset(ref.slot):tier.slot_offset(ref.slot) + SPEC.page_bytes]
    np.copyto(slot, flipped)
    try:
        with pytest.raises(PageError):
            tier.read(ref, KEY, np.zeros(SPEC.page_bytes, dtype=np.uint8))
        with pytest.raises(PageError):         # the zero-copy load: header, then each layer's check
            header = tier.read_header(ref, KEY, np.zeros(SPEC.header_bytes, dtype=np.uint8))
            for layer in range(SPEC.num_layers):
                tier.check_segment(ref, header, layer)
    finally:
        np.copyto(slot, clean)
    tier.read(ref, KEY, np.zeros(SPEC.page_bytes, dtype=np.uint8))      # restored: accepted again


@pytest.mark.torch
def test_torch_computes_the_same_checksums() -> None:
    """What a GPU engine runs over the bytes where they landed, on CPU tensors here."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    devices = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]     # ci/gpu_check.sh: on GPUs too
    for device in devices:
        for seg in (1, 6, 64, 1000, 65_536):
            pages = rng.integers(0, 256, (2, 3, seg), dtype=np.uint8)
            got = page_sum.torch_checksums(torch.from_numpy(pages).to(device))
            assert got.shape == (2, 3) and got.dtype == torch.int64 and got.device == torch.device(device)
            want = [[page_sum.as_int64(reference(pages[i, j].tobytes())) for j in range(3)] for i in range(2)]
            assert got.tolist() == want, device
        # whole pages where they landed: segments viewed in place after each page's header
        raw = torch.from_numpy(rng.integers(0, 256, (4, 128 + 3 * 512), dtype=np.uint8)).to(device)
        got = page_sum.torch_checksums(raw[:, 128:].view(4, 3, 512))
        host = raw.cpu().numpy()
        assert got.tolist() == [[page_sum.as_int64(page_sum.checksum(host[p, 128 + 512 * j:128 + 512 * (j + 1)]))
                                 for j in range(3)] for p in range(4)]


_TRITON_CHECK = """
import numpy as np, torch
from pof_connector import page_sum, page_sum_triton
rng = np.random.default_rng(9)
shapes = ((5, 64), (2, 3, 1000), (2, 2, 2, 4096), (2, 65_548))    # the last: 3 programs per segment
cases = [rng.integers(0, 256, shape, dtype=np.uint8) for shape in shapes]
cases.append(np.full((2, 3, 4096), 255, dtype=np.uint8))          # every word at its maximum: the sums wrap
raw = torch.from_numpy(rng.integers(0, 256, (4, 128 + 3 * 512), dtype=np.uint8))
tensors = [torch.from_numpy(c) for c in cases] + [raw[:, 128:].view(4, 3, 512)]     # whole pages, in place
for t in tensors:
    got = page_sum_triton.checksums(t, page_sum._MIX_SIGNED)
    flat = t.reshape(-1, t.shape[-1]).numpy()
    want = [page_sum.as_int64(page_sum.checksum(np.ascontiguousarray(row))) for row in flat]
    assert got is not None and got.shape == t.shape[:-1] and got.reshape(-1).tolist() == want, t.shape
assert page_sum_triton.checksums(torch.zeros(2, 6, dtype=torch.uint8), page_sum._MIX_SIGNED) is None
print("ok")
"""


@pytest.mark.torch
def test_the_triton_kernel_computes_the_same_checksums() -> None:
    """The kernel that sums pages on a GPU (ci/gpu_check.sh runs it there), here on CPU tensors in
    Triton's interpreter (set before Triton is imported, hence a child process)."""
    pytest.importorskip("torch")
    if importlib.util.find_spec("triton") is None:
        pytest.skip("no Triton in this venv (torch CUDA builds bring it; the GPU check runs the kernel)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _TRITON_CHECK], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.torch
def test_a_triton_kernel_that_cannot_build_leaves_the_torch_sums(monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """A GPU whose Triton fails at the first launch still gets its pages checked (by torch ops,
    same values), and the log says so once."""
    torch = pytest.importorskip("torch")
    if importlib.util.find_spec("triton") is None:
        pytest.skip("no Triton in this venv")
    from pof_connector import page_sum_triton

    def broken(segments: object, mix: int) -> object:
        raise RuntimeError("PTX .version 9.9 does not support .target sm_99")

    monkeypatch.setattr(page_sum_triton, "checksums", broken)
    monkeypatch.setattr(page_sum, "_triton_state", "untried")
    t = torch.from_numpy(np.random.default_rng(2).integers(0, 256, (2, 64), dtype=np.uint8))
    with caplog.at_level(logging.WARNING, logger="pof_connector.page_sum"):
        assert page_sum._triton_checksums(t) is None
        assert page_sum._triton_checksums(t) is None
    assert page_sum._triton_state == "off"
    assert [r.getMessage().count("sm_99") for r in caplog.records] == [1]
    assert page_sum.torch_checksums(t).tolist() == [page_sum.as_int64(page_sum.checksum(r)) for r in t.numpy()]


@pytest.mark.parametrize("spec", [SPEC, PageSpec(num_layers=8, segment_bytes=8192, page_tokens=64)])
def test_whole_page_calls_write_what_the_python_path_writes(spec: PageSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    """The native whole-page store (header built in C) and the numpy fallback leave the same bytes
    in a slot, and each implementation reads back what the other wrote."""
    if page_sum.NATIVE is None:
        pytest.skip("the native kernel was not built here")
    rng = np.random.default_rng(3)
    layers = [rng.integers(0, 256, spec.segment_bytes, dtype=np.uint8) for _ in range(spec.num_layers)]
    native, fallback = (CpuDramTier(spec, 2 * spec.page_bytes + 256) for _ in range(2))
    refs = []
    for tier in (native, fallback):
        if tier is fallback:
            monkeypatch.setattr(page_sum, "_native", None)
        got = tier.prepare_store(KEY)
        assert got is not None
        tier.write(got[0], KEY, layers)
        tier.complete_store(KEY, True)
        refs.append(got[0])
    assert refs[0] == refs[1]
    assert np.array_equal(native.region, fallback.region)
    out = np.zeros(spec.page_bytes, dtype=np.uint8)
    want = fallback.read(refs[1], KEY, out)           # still the fallback: native's bytes, read by numpy
    monkeypatch.undo()
    assert native.read(refs[0], KEY, out) == want     # native load: the same header, checksums included
    assert np.array_equal(out[spec.header_bytes:], np.concatenate(layers))
    assert np.array_equal(out[:spec.header_bytes], fallback.region[:spec.header_bytes])


def test_whole_page_load_names_why_it_refused(impl: str) -> None:
    """The native load only says yes or no; a refused page still fails with the reason the Python
    checks give (stale or torn slot, another key, a bad header, a bad segment)."""
    tier = CpuDramTier(SPEC, 2 * SPEC.page_bytes + 256)
    got = tier.prepare_store(KEY)
    assert got is not None
    ref = got[0]
    rng = np.random.default_rng(4)
    tier.write(ref, KEY, [rng.integers(0, 256, SPEC.segment_bytes, dtype=np.uint8) for _ in range(3)])
    out = np.zeros(SPEC.page_bytes, dtype=np.uint8)
    slot = tier.region[tier.slot_offset(ref.slot):tier.slot_offset(ref.slot) + SPEC.page_bytes]

    def reason(r: SlotRef = ref, k: PageKey = KEY) -> str:
        with pytest.raises(PageError) as e:
            tier.read(r, k, out)
        return e.value.reason

    assert reason(SlotRef(ref.slot, ref.generation + 1)) == "stale_generation"
    assert reason(k=PageKey(bytes(16), bytes(32))) == "wrong_key"
    for at, why in ((SPEC.header_bytes + 999, "bad_checksum"), (81, "bad_header"), (90, "bad_header"),
                    (SPEC.header_bytes - 1, "bad_header")):      # a segment; header checksum, sums, padding
        slot[at] ^= 0x10
        assert reason() == why, at
        slot[at] ^= 0x10
    tier.read(ref, KEY, out)
    tier._set_live_generation(ref.slot, 0)        # a writer took the slot (the race: tests/tiers/test_cxl.py)
    assert reason() == "bad_header"               # the copied header's generation no longer matches its checksum
    with pytest.raises(ValueError):
        tier.read(ref, KEY, out[:-1])
