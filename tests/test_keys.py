from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys

import numpy as np
import pytest

from pof_connector.keys import Namespace, PageKey, chain_digests, page_keys, storage_seed


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
    code = ("import json,sys; from pof_connector.keys import page_keys; "
            f"print(json.dumps([k.hex() for k in page_keys(bytes.fromhex('{namespace.hex()}'), "
            f"{tokens}, 16, cache_salt='s')]))")
    env = {"PYTHONHASHSEED": "12345"}   # a different hash seed must not matter
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert json.loads(out.stdout) == [k.hex() for k in page_keys(namespace, tokens, 16, cache_salt="s")]


def test_namespaces_and_salts_are_disjoint() -> None:
    tokens = list(range(64))
    ns_a = Namespace("m", "bfloat16", "mha", 16).digest
    variants = [
        ns_a,
        Namespace("m2", "bfloat16", "mha", 16).digest,
        Namespace("m", "float16", "mha", 16).digest,
        Namespace("m", "bfloat16", "mha", 16, tp_rank=1, tp_size=2).digest,
        Namespace("m", "bfloat16", "mha", 16, extra="tenant").digest,
    ]
    assert len(set(variants)) == len(variants)
    sets = [set(page_keys(ns, tokens, 16)) for ns in variants]
    sets += [set(page_keys(ns_a, tokens, 16, cache_salt=s)) for s in ("a", "b", "")]
    for i in range(len(sets)):
        for j in range(i + 1, len(sets)):
            assert not sets[i] & sets[j]


def test_pipeline_stages_get_their_own_namespace() -> None:
    """PP stages with equal layer counts hold different layers' KV for the same tokens (issue 20, item 4)."""
    stages = {Namespace("m", "bfloat16", "mha", 16, pp_rank=r, pp_size=2).digest for r in range(2)}
    stages |= {Namespace("m", "bfloat16", "mha", 16, pp_rank=r, pp_size=4).digest for r in range(4)}
    assert len(stages) == 6
    assert Namespace("m", "bfloat16", "mha", 16).digest not in stages
    with_tp = {Namespace("m", "bfloat16", "mha", 16, tp_rank=t, tp_size=2, pp_rank=p, pp_size=2).digest
               for t in range(2) for p in range(2)}
    assert len(with_tp) == 4


def test_namespace_digest_without_pp_is_unchanged() -> None:
    """pp_size 1 keeps the digest every deployed node (and the vLLM adapter) computes: pinned values."""
    assert Namespace("m", "bfloat16", "mha", 16).digest.hex() == "efdce9fcc9696de095628e62f97d4562"
    assert Namespace("m", "bfloat16", "mha", 16, pp_rank=0, pp_size=1).digest.hex() == \
        "efdce9fcc9696de095628e62f97d4562"
    assert Namespace("m", "bfloat16", "mha", 16, 1, 2, "x").digest.hex() == "1fc649d4e1dab8d2f5b6c3f489fa73b1"


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
