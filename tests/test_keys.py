from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
import subprocess
import sys

import numpy as np
import pytest

from pof_connector.pages.keys import Namespace, PageKey, chain_digests, page_keys, storage_seed
from pof_connector.pages.layout import KIND_MHA, KIND_MLA, PageError, PageHeader, PageSpec, encode_header

SPEC = PageSpec(num_layers=4, segment_bytes=4096, page_tokens=16)


def sglang_reference(tokens: list[int], page_size: int, extra_key: str | None, cache_salt: str | None) -> list[str]:
    """SGLang's get_storage_hash_str(key, None, page_size), written out from its documented
    definition (mem_cache/utils.py: storage_namespace_seed + get_hash_str), independently of pof."""
    prior: str | None = None
    if extra_key is not None or cache_salt is not None:
        d = hashlib.sha256(b"sglang-cache-namespace-v1")
        for part in (extra_key, cache_salt):
            if part is None:
                d.update(b"\x00")
            else:
                b = part.encode("utf-8")
                d.update(b"\x01" + len(b).to_bytes(8, "little") + b)
        prior = d.hexdigest()
    out = []
    for start in range(0, len(tokens), page_size):
        h = hashlib.sha256()
        if prior is not None:
            h.update(bytes.fromhex(prior))
        for t in tokens[start:start + page_size]:
            h.update(struct.pack("<I", t))
        prior = h.hexdigest()
        out.append(prior)
    return out


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("extra_key,cache_salt", [(None, None), (None, "tenant-a"), ("lora-1", None),
                                                  ("x", ""), ("", "x")])
def test_chain_equals_sglang(page_size: int, extra_key: str | None, cache_salt: str | None) -> None:
    tokens = list(np.random.default_rng(page_size).integers(0, 2**32 - 1, size=page_size * 7 + 3, dtype=np.int64))
    tokens = [int(t) for t in tokens]
    ours = chain_digests(tokens, page_size, storage_seed(extra_key, cache_salt), partial=True)
    assert [d.hex() for d in ours] == sglang_reference(tokens, page_size, extra_key, cache_salt)
    full = chain_digests(tokens, page_size, storage_seed(extra_key, cache_salt))
    assert len(full) == len(tokens) // page_size and full == ours[:len(full)]


def test_same_keys_in_another_process(namespace: bytes) -> None:
    tokens = list(range(1000, 1000 + 16 * 10))
    code = ("import json,sys; from pof_connector.pages.keys import page_keys; "
            f"print(json.dumps([k.hex() for k in page_keys(bytes.fromhex('{namespace.hex()}'), "
            f"{tokens}, 16, cache_salt='s')]))")
    env = {"PYTHONHASHSEED": "12345"}   # a different hash seed must not matter
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert json.loads(out.stdout) == [k.hex() for k in page_keys(namespace, tokens, 16, cache_salt="s")]


def test_namespaces_and_salts_are_disjoint() -> None:
    tokens = list(range(64))
    ns_a = Namespace("m", "bfloat16", "mha", SPEC).digest
    variants = [
        ns_a,
        Namespace("m2", "bfloat16", "mha", SPEC).digest,
        Namespace("m", "float16", "mha", SPEC).digest,
        Namespace("m", "bfloat16", "mha", SPEC, tp_rank=1, tp_size=2).digest,
        Namespace("m", "bfloat16", "mha", SPEC, extra="tenant").digest,
    ]
    assert len(set(variants)) == len(variants)
    sets = [set(page_keys(ns, tokens, 16)) for ns in variants]
    sets += [set(page_keys(ns_a, tokens, 16, cache_salt=s)) for s in ("a", "b", "")]
    for i in range(len(sets)):
        for j in range(i + 1, len(sets)):
            assert not sets[i] & sets[j]


def test_every_field_a_page_header_is_checked_against_is_in_the_namespace() -> None:
    """Issue 39, finding 6: a reader refuses a page whose header differs from its spec in any
    geometry field (``PageHeader.expect``). Were one of them outside the key, an engine would find
    another's pages by lookup and fail every load (LMCache's namespace had no layer count: a full
    lookup hit, no load). Each such field alone gives another namespace, and a namespace cannot be
    built without them."""
    key = PageKey(bytes(16), bytes(32))
    header = PageHeader.parse(encode_header(SPEC, key, 1, [0] * SPEC.num_layers, 1))
    base = Namespace("m", "bfloat16", "mha", SPEC).digest
    changes = {"num_layers": 5, "segment_bytes": 8192, "page_tokens": 32, "kind": KIND_MLA}
    assert SPEC.kind == KIND_MHA
    assert set(changes) == {f.name for f in dataclasses.fields(PageSpec)}     # a new field joins this test
    for name, value in changes.items():
        other = dataclasses.replace(SPEC, **{name: value})
        with pytest.raises(PageError, match="geometry"):
            header.expect(other, key, 1)                 # a reader of `other` pages refuses this one ...
        assert Namespace("m", "bfloat16", "mha", other).digest != base, name     # ... so never finds it
    with pytest.raises(TypeError, match="PageSpec"):
        Namespace("m", "bfloat16", "mha", 16)  # type: ignore[arg-type]


def test_pipeline_stages_get_their_own_namespace() -> None:
    """PP stages with equal layer counts hold different layers' KV for the same tokens (issue 20, item 4)."""
    stages = {Namespace("m", "bfloat16", "mha", SPEC, pp_rank=r, pp_size=2).digest for r in range(2)}
    stages |= {Namespace("m", "bfloat16", "mha", SPEC, pp_rank=r, pp_size=4).digest for r in range(4)}
    assert len(stages) == 6
    assert Namespace("m", "bfloat16", "mha", SPEC).digest not in stages
    with_tp = {Namespace("m", "bfloat16", "mha", SPEC, tp_rank=t, tp_size=2, pp_rank=p, pp_size=2).digest
               for t in range(2) for p in range(2)}
    assert len(with_tp) == 4


def test_namespace_digest_is_pinned() -> None:
    """Every process and host computes the same digest (pinned values); ``pp_size`` 1 leaves the
    stage out, so a single-stage engine's namespace is the same in every adapter. The values
    changed once, when the page geometry joined the digest (``pof-namespace-v2``): pages stored
    under a v1 namespace are misses after an upgrade, never loaded."""
    assert Namespace("m", "bfloat16", "mha", SPEC).digest.hex() == "7e9154d681eb78e133b133956ea0e9d1"
    assert Namespace("m", "bfloat16", "mha", SPEC, pp_rank=0, pp_size=1).digest.hex() == \
        "7e9154d681eb78e133b133956ea0e9d1"
    assert Namespace("m", "bfloat16", "mha", SPEC, 1, 2, "x").digest.hex() == "0c261646290215f70f314d41f2ecab9c"


def test_prefix_property() -> None:
    a = chain_digests(list(range(100)), 10)
    b = chain_digests([*range(50), 7, *range(51, 100)], 10)
    assert a[:5] == b[:5] and not set(a[5:]) & set(b[5:])


def test_key_validation_and_hex() -> None:
    k = PageKey(bytes(16), bytes(range(32)))
    assert PageKey.from_hex(k.hex()) == k
    with pytest.raises(ValueError):
        PageKey(b"short", bytes(32))
    with pytest.raises(ValueError):
        chain_digests([-1], 1)
