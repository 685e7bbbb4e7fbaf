"""Page keys: a chained prefix hash, exactly SGLang HiCache's, plus a namespace.

Page ``i`` of a token sequence has the chain digest

    c_i = sha256(c_{i-1} || tokens of page i as little-endian uint32)

where ``c_{-1}`` is SGLang's storage seed: nothing when the request has neither ``extra_key``
nor ``cache_salt``, else ``sha256(b"sglang-cache-namespace-v1" + part(extra_key) +
part(cache_salt))`` with ``part(None) = b"\\x00"`` and ``part(s) = b"\\x01" + len8le(s) + s``.
Because a digest covers every token before it, page ``i`` exists only as the continuation of
pages ``0..i-1``; the SGLang adapter takes the engine's hex keys as given and the vLLM adapter
computes the same chain from token ids.

The namespace (16 bytes) is a digest of what makes KV bytes differ for the same tokens: model,
KV dtype, layout, the page geometry (a :class:`~pof_connector.pages.layout.PageSpec`: kind, layers,
segment bytes, page tokens), tensor- and pipeline-parallel rank and size, and the operator's
namespace string. It is stored beside the chain digest in every key, so two models, two TP ranks
or two PP stages never collide. Every field a page header is checked against on a load is in the
digest, so a lookup never finds a page that its own engine's loads would refuse.
Nothing here uses Python's ``hash()``: keys are the same in every process and on every host.

**Two salts** (:class:`ChainSeeds`): an organisation's prompt of ``K`` tokens shared by its users,
the rest of each request private to its user. With ``P`` tokens per page and ``s = K // P`` (the
pages wholly inside the first ``K`` tokens):

* pages ``0..s-1`` chain from ``storage_seed(extra_key, shared_salt)``, exactly as a request with
  ``cache_salt = shared_salt`` would: every user of the organisation gets the same keys for them;
* page ``s`` chains from ``sha256(b"pof-two-salts-v1" || c_{s-1} || storage_seed(extra_key,
  user_salt))`` (``c_{s-1}``: the shared part's last digest; when ``s = 0``, nothing), and later
  pages chain as usual.

So a user's turns depend on their own salt's seed (two users' turns never have equal keys unless
sha256 collides), on the organisation's prompt and salt through ``c_{s-1}`` (a user of another
organisation with the same user salt gets other keys), and the tag keeps them apart from any
single-salt chain (whose pages chain from a digest or a seed alone, never from a tagged one).
Without a user salt the chain simply continues under the shared salt.
"""

from __future__ import annotations

import array
import hashlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pof_connector.pages.layout import PageSpec  # pages imports this module: no import at run time

NAMESPACE_BYTES = 16
DIGEST_BYTES = 32
SEGMENT_PAGES = 16
"""Pages per segment of a chain: the locality index keeps the holders of a segment's pages under one
field, found from the segment's head page (see :class:`ChainPlace`). Persistent: an index written
with one value is read wrongly (as misses) with another."""
_SEED_TAG = b"sglang-cache-namespace-v1"
_TWO_SALTS_TAG = b"pof-two-salts-v1"


@dataclass(frozen=True, slots=True)
class ChainPlace:
    """Where a page sits in its chain: its ``position`` (page 0 is the first) and the chain digest
    of its segment's head, the page at ``position - position % SEGMENT_PAGES``."""

    position: int
    head: bytes

    @property
    def offset(self) -> int:
        """The page's place in its segment."""
        return self.position % SEGMENT_PAGES


@dataclass(frozen=True, slots=True)
class PageKey:
    """The identity of one page: ``(namespace, chain digest)``.

    ``place``: where the page sits in its chain, known where the chain was computed from tokens
    (``None``: not known, e.g. a digest an engine handed over). It is not part of the identity
    (equality and hashing ignore it): a digest determines its place."""

    namespace: bytes
    digest: bytes
    place: ChainPlace | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.namespace) != NAMESPACE_BYTES or len(self.digest) != DIGEST_BYTES:
            raise ValueError(f"PageKey needs a {NAMESPACE_BYTES}-byte namespace and a {DIGEST_BYTES}-byte "
                             f"digest, got {len(self.namespace)} and {len(self.digest)}")

    def __hash__(self) -> int:
        # Kept by dataclass (frozen, eq): the generated one builds a tuple per call, and a tier's
        # books hash each key ~8 times per store and load. bytes cache their own hashes.
        return hash(self.digest) ^ hash(self.namespace)

    def hex(self) -> str:
        return f"{self.namespace.hex()}:{self.digest.hex()}"

    @classmethod
    def from_hex(cls, text: str) -> PageKey:
        ns, _, digest = text.partition(":")
        return cls(bytes.fromhex(ns), bytes.fromhex(digest))

    def wire(self) -> list[str | int]:
        """The key as JSON-able items for messages between nodes, its place included when known."""
        out: list[str | int] = [self.namespace.hex(), self.digest.hex()]
        if self.place is not None:
            out += [self.place.position, self.place.head.hex()]
        return out

    @classmethod
    def from_wire(cls, items: Sequence[object]) -> PageKey:
        """The inverse of :meth:`wire`; raises ``ValueError`` for anything else (a peer's message
        is not trusted)."""
        if len(items) not in (2, 4) or not all(isinstance(x, str) for x in (items[0], items[1], *items[3:])):
            raise ValueError("a page key on the wire is [namespace hex, digest hex[, position, head hex]]")
        place = None
        if len(items) == 4:
            pos = items[2]
            if not isinstance(pos, int) or isinstance(pos, bool) or pos < 0:
                raise ValueError("a page key's position must be a non-negative integer")
            head = bytes.fromhex(str(items[3]))
            if len(head) != DIGEST_BYTES:
                raise ValueError(f"a page key's head must be {DIGEST_BYTES} bytes")
            place = ChainPlace(pos, head)
        return cls(bytes.fromhex(str(items[0])), bytes.fromhex(str(items[1])), place)


@dataclass(frozen=True, slots=True)
class Namespace:
    """What makes KV bytes of the same tokens differ; its :attr:`digest` prefixes every key.

    ``layout`` names the canonical page layout (e.g. ``"mha:kv_heads=2:head_dim=64"``).
    ``spec``: the geometry of the pages stored under it, required: a page header is checked
    against kind, layers, segment bytes and page tokens on every load, so two engines that differ
    in any of them must never share keys (else one's lookups promise pages its loads refuse).
    ``tp_rank``/``tp_size`` keep ranks that hold different heads apart; MLA writers whose
    latent is the same on every rank pass ``tp_rank=0, tp_size=1``. ``pp_rank``/``pp_size``
    keep pipeline stages apart (each holds other layers); with ``pp_size=1`` they are left out
    of the digest, so a single-stage engine's namespace is the same in every adapter.
    """

    model: str
    kv_dtype: str
    layout: str
    spec: PageSpec
    tp_rank: int = 0
    tp_size: int = 1
    extra: str = ""
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        from pof_connector.pages.layout import PageSpec

        if not isinstance(self.spec, PageSpec):
            raise TypeError(f"Namespace needs the page geometry (a PageSpec), got {self.spec!r}")

    @property
    def digest(self) -> bytes:
        s = self.spec
        # v2: v1 had page_tokens alone where the whole geometry now is.
        fields: list[object] = ["pof-namespace-v2", self.model, self.kv_dtype, self.layout, s.kind, s.num_layers,
                                s.segment_bytes, s.page_tokens, self.tp_rank, self.tp_size, self.extra]
        if self.pp_size != 1:
            fields += ["pp", self.pp_rank, self.pp_size]
        canonical = json.dumps(fields, separators=(",", ":")).encode()
        return hashlib.sha256(canonical).digest()[:NAMESPACE_BYTES]


def storage_seed(extra_key: str | None = None, cache_salt: str | None = None) -> bytes | None:
    """SGLang's ``storage_namespace_seed`` as raw bytes; ``None`` when both parts are absent."""
    if extra_key is None and cache_salt is None:
        return None
    h = hashlib.sha256(_SEED_TAG)
    for part in (extra_key, cache_salt):
        if part is None:
            h.update(b"\x00")
            continue
        encoded = part.encode("utf-8")
        h.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return h.digest()


_ARRAY_U32 = array.array("I").itemsize == 4
"""Whether ``array``'s ``"I"`` is a uint32 (every platform CPython builds on today)."""


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """The token ids as little-endian uint32s; ``ValueError`` for an id outside that range."""
    if isinstance(tokens, np.ndarray) or not _ARRAY_U32:
        arr = np.asarray(tokens)
        if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
            raise ValueError("token ids must fit in uint32")
        return arr.astype("<u4", copy=False).tobytes()
    # An engine's ids come as a list: array checks the range as it converts, 4x faster than numpy
    # here (50 against 210 us for a 6,000-token prompt, on each scheduler lookup).
    try:
        words = array.array("I", tokens)
    except OverflowError as e:
        raise ValueError(f"token ids must fit in uint32: {e}") from None
    if sys.byteorder == "big":
        words.byteswap()
    return words.tobytes()


def chain_digests(
    tokens: Sequence[int] | np.ndarray,
    page_tokens: int,
    seed: bytes | None = None,
    *,
    partial: bool = False,
) -> list[bytes]:
    """The chain digest of each page of ``tokens``.

    Only full pages are hashed unless ``partial`` is set (SGLang also hashes a trailing partial
    page; the pool never stores one). ``seed`` is the prior digest of page 0 (see
    :func:`storage_seed`); ``None`` means page 0 has no prior.
    """
    if page_tokens <= 0:
        raise ValueError(f"page_tokens must be positive, got {page_tokens}")
    data = _token_bytes(tokens)
    count = len(data) // 4
    n_full = count // page_tokens
    n = n_full + (1 if partial and count % page_tokens else 0)
    stride = 4 * page_tokens
    out: list[bytes] = []
    prior = seed
    for i in range(n):
        h = hashlib.sha256(prior) if prior is not None else hashlib.sha256()
        h.update(data[i * stride:(i + 1) * stride])
        prior = h.digest()
        out.append(prior)
    return out


@dataclass(frozen=True, slots=True)
class ChainSeeds:
    """What a request's chain starts from: ``seed`` for page 0 and, with two salts, the page
    ``switch`` where the user's part begins, re-seeded with ``user_seed`` (the rule: module
    docstring)."""

    seed: bytes | None
    switch: int | None = None
    user_seed: bytes | None = None

    @classmethod
    def of(cls, page_tokens: int, *, cache_salt: str | None = None, extra_key: str | None = None,
           shared_salt: str | None = None, shared_tokens: int = 0) -> ChainSeeds:
        """The seeds of a request with ``cache_salt`` (the user's), and, when ``shared_salt`` is
        given, its first ``shared_tokens`` under it."""
        if shared_salt is None:
            return cls(storage_seed(extra_key, cache_salt))
        if shared_tokens < 0:
            raise ValueError(f"shared_tokens must be >= 0, got {shared_tokens}")
        user = None if cache_salt is None else storage_seed(extra_key, cache_salt)
        return cls(storage_seed(extra_key, shared_salt), shared_tokens // page_tokens if user else None, user)

    def prior(self, page: int, previous: bytes | None) -> bytes | None:
        """The prior digest of page ``page``, given ``previous`` (page ``page - 1``'s digest)."""
        if page == self.switch and self.user_seed is not None:
            return hashlib.sha256(_TWO_SALTS_TAG + (previous or b"") + self.user_seed).digest()
        return previous if page else self.seed

    def digests(self, tokens: Sequence[int] | np.ndarray, page_tokens: int, start: int = 0,
                previous: bytes | None = None) -> list[bytes]:
        """Chain digests of the full pages of ``tokens``, which begin at page ``start`` (after the
        page whose digest is ``previous``)."""
        n = len(tokens) // page_tokens
        if self.switch is None or not start <= self.switch < start + n:
            return chain_digests(tokens, page_tokens, self.prior(start, previous))
        cut = (self.switch - start) * page_tokens
        head = chain_digests(tokens[:cut], page_tokens, self.prior(start, previous))
        last = head[-1] if head else previous
        return head + chain_digests(tokens[cut:n * page_tokens], page_tokens, self.prior(self.switch, last))


SHARED_SALT_PARAM, SHARED_TOKENS_PARAM = "pof_shared_salt", "pof_shared_tokens"
"""The two-salt fields of a request's ``kv_transfer_params`` (vLLM's per-request connector
parameters), read alike by the vLLM adapter, the locality API and ``pof router``."""


def shared_salt_of(params: object) -> tuple[str | None, int]:
    """The organisation's salt and how many leading tokens it covers, from a request's
    ``kv_transfer_params`` (``(None, 0)``: one salt). Malformed values are ignored: the request
    then keeps to its own salt, which shares nothing it should not."""
    if not isinstance(params, dict):
        return None, 0
    salt, tokens = params.get(SHARED_SALT_PARAM), params.get(SHARED_TOKENS_PARAM)
    if not isinstance(salt, str) or not salt or isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        return None, 0
    return salt, tokens


def page_keys(
    namespace: bytes,
    tokens: Sequence[int] | np.ndarray,
    page_tokens: int,
    *,
    cache_salt: str | None = None,
    extra_key: str | None = None,
    shared_salt: str | None = None,
    shared_tokens: int = 0,
) -> list[PageKey]:
    """Keys of the full pages of ``tokens`` under ``namespace`` (a :attr:`Namespace.digest`);
    ``shared_salt``: the first ``shared_tokens`` are under it (see :class:`ChainSeeds`)."""
    seeds = ChainSeeds.of(page_tokens, cache_salt=cache_salt, extra_key=extra_key, shared_salt=shared_salt,
                          shared_tokens=shared_tokens)
    return chain_keys(namespace, [], seeds.digests(tokens, page_tokens))


def chain_keys(namespace: bytes, before: Sequence[PageKey], digests: Sequence[bytes]) -> list[PageKey]:
    """Keys, with their places, of the pages whose chain digests ``digests`` continue the chain of
    ``before`` (the keys of the pages before them, from page 0, with their places; empty: the
    chain starts here)."""
    start = len(before)
    h = start - start % SEGMENT_PAGES
    return _placed(namespace, start, before[h].digest if h < start else None, digests)


def _placed(namespace: bytes, start: int, head: bytes | None, digests: Sequence[bytes]) -> list[PageKey]:
    """Keys of ``digests`` placed from position ``start`` on; ``head``: the digest of the segment
    head before ``start`` when ``start`` is inside a segment (else unused)."""
    out: list[PageKey] = []
    for j, d in enumerate(digests):
        pos = start + j
        if pos % SEGMENT_PAGES == 0:
            head = d
        assert head is not None
        out.append(PageKey(namespace, d, ChainPlace(pos, head)))
    return out


def keys_from_hex(namespace: bytes, hex_digests: Sequence[str], prefix: Sequence[str] | None = None) -> list[PageKey]:
    """Keys for digests an engine computed itself (SGLang passes hex strings).

    ``prefix``: the hex digests of the chain's pages before these, from page 0 (SGLang's
    ``HiCacheStorageExtraInfo.prefix_keys``; empty: the chain starts at the first digest): the
    keys then know their places. ``None``: they do not (the index keeps them in per-page fields)."""
    digests = [bytes.fromhex(h) for h in hex_digests]
    if prefix is None:
        return [PageKey(namespace, d) for d in digests]
    start = len(prefix)
    h = start - start % SEGMENT_PAGES
    return _placed(namespace, start, bytes.fromhex(prefix[h]) if h < start else None, digests)
