"""Pages: what a page is, what it is called, and how its bytes are checked.

* :mod:`.keys` — page keys: the chained prefix hash (SGLang HiCache's) and a namespace;
* :mod:`.layout` — the canonical page: a header and one contiguous segment per layer;
* :mod:`.page_sum` — format v3's per-layer segment checksum, fused with the copy that moves the
  bytes (numpy, the native kernel :mod:`._pagesum` built from ``_pagesum.c``, torch ops, and
  :mod:`.page_sum_triton` for pages already on a GPU).

May import: nothing else of ``pof_connector`` (numpy and xxhash; torch and Triton only when the
caller's pages are torch tensors). Every other package builds on this one.

This module re-exports the names of :mod:`.keys` and :mod:`.layout` that other packages use, so
``from pof_connector.pages import PageKey, PageSpec`` is the public face; ``page_sum`` is imported
as ``from pof_connector.pages import page_sum``.
"""

from pof_connector.pages import page_sum
from pof_connector.pages.keys import (
    DIGEST_BYTES,
    NAMESPACE_BYTES,
    SEGMENT_PAGES,
    ChainPlace,
    ChainSeeds,
    Namespace,
    PageKey,
    chain_digests,
    chain_keys,
    keys_from_hex,
    page_keys,
    shared_salt_of,
    storage_seed,
)
from pof_connector.pages.layout import (
    GENERATION_AT,
    KIND_MHA,
    KIND_MLA,
    VERSION,
    PageError,
    PageHeader,
    PageSpec,
    as_array,
    encode_header,
    expect_checksums,
    header_bytes_for,
    header_template,
    pack_page,
    verify_page,
    verify_segment,
)

__all__ = ["DIGEST_BYTES", "GENERATION_AT", "KIND_MHA", "KIND_MLA", "NAMESPACE_BYTES", "SEGMENT_PAGES", "VERSION",
           "ChainPlace", "ChainSeeds", "Namespace", "PageError", "PageHeader", "PageKey", "PageSpec", "as_array",
           "chain_digests", "chain_keys", "encode_header", "expect_checksums", "header_bytes_for", "header_template",
           "keys_from_hex", "pack_page", "page_keys", "page_sum", "shared_salt_of", "storage_seed", "verify_page",
           "verify_segment"]
