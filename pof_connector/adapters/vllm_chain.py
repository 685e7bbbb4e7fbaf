"""A request's page keys as the vLLM adapter computes them (scheduler side)."""

from __future__ import annotations

import json
from typing import Any

from pof_connector.pages import ChainSeeds, PageKey, chain_keys, shared_salt_of


class Chain:
    """A request's page keys, extended as its tokens grow.

    Every input that changes a request's KV besides its token ids is in the key or keeps the
    request out of the pool, as vLLM's own block hashes do (``generate_block_hash_extra_keys``):
    ``cache_salt`` and the LoRA adapter (name and path) seed the chain; pages that reach a
    multimodal placeholder (whose KV depends on the image, not on the placeholder ids) or any
    token of a prompt given as embeddings are neither loaded nor stored. Pages before the first
    placeholder are plain text KV and are shared.

    Two salts: ``kv_transfer_params`` ``{"pof_shared_salt": ORG_SALT, "pof_shared_tokens": K}``
    puts the first ``K`` tokens under the organisation's salt and the rest under the request's
    ``cache_salt`` (the rule: :mod:`pof_connector.pages.keys`).
    """

    def __init__(self, namespace: bytes, request: Any, tenant: str, page_tokens: int) -> None:
        self.namespace = namespace
        shared_salt, shared_tokens = shared_part(request)
        self.seeds = ChainSeeds.of(page_tokens, cache_salt=request.cache_salt, extra_key=lora_extra_key(request),
                                   shared_salt=shared_salt, shared_tokens=shared_tokens)
        self.tenant = tenant
        """Whose pages these are (``Pool.tenant_of`` the salt), for the tiers' quotas."""
        self.limit = token_limit(request)
        self.keys: list[PageKey] = []

    def upto(self, tokens: list[int], pages: int, page_tokens: int) -> list[PageKey]:
        """Keys of the first ``pages`` pages, fewer when the request's :attr:`limit` stops them."""
        pages = min(pages, self.limit // page_tokens)
        have = len(self.keys)
        if pages > have:
            previous = self.keys[-1].digest if self.keys else None
            more = self.seeds.digests(tokens[have * page_tokens:pages * page_tokens], page_tokens, have, previous)
            self.keys += chain_keys(self.namespace, self.keys, more)
        return self.keys[:pages]


def lora_extra_key(request: Any) -> str | None:
    """The LoRA adapter as a chain seed part (``None``: the base model)."""
    lora = getattr(request, "lora_request", None)
    if not lora:
        return None
    return json.dumps(["vllm-lora", str(lora.lora_name), str(lora.lora_path)], separators=(",", ":"))


def token_limit(request: Any) -> int:
    """How many leading tokens have KV that only token ids (and the chain's seed) determine."""
    if getattr(request, "prompt_embeds", None) is not None:
        return 0
    offsets = [f.mm_position.offset for f in getattr(request, "mm_features", None) or ()]
    return min(offsets, default=1 << 62)


def shared_part(request: Any) -> tuple[str | None, int]:
    """The organisation's salt and how many leading tokens it covers, from the request's
    ``kv_transfer_params`` (``(None, 0)``: one salt). Malformed values are ignored: the request
    then keeps to its own salt, which shares nothing it should not."""
    return shared_salt_of(getattr(request, "kv_transfer_params", None))
