"""A request's page keys as the vLLM adapter computes them (scheduler side)."""

from __future__ import annotations

import json
from typing import Any

from pof_connector.keys import PageKey, chain_digests, chain_keys, storage_seed
from pof_connector.tenant_config import DEFAULT_TENANT


class Chain:
    """A request's page keys, extended as its tokens grow.

    Every input that changes a request's KV besides its token ids is in the key or keeps the
    request out of the pool, as vLLM's own block hashes do (``generate_block_hash_extra_keys``):
    ``cache_salt`` and the LoRA adapter (name and path) seed the chain; pages that reach a
    multimodal placeholder (whose KV depends on the image, not on the placeholder ids) or any
    token of a prompt given as embeddings are neither loaded nor stored. Pages before the first
    placeholder are plain text KV and are shared.
    """

    def __init__(self, namespace: bytes, request: Any, tenant: str = DEFAULT_TENANT) -> None:
        self.namespace = namespace
        self.seed = storage_seed(lora_extra_key(request), request.cache_salt)
        self.tenant = tenant
        """Whose pages these are (``Pool.tenant_of`` the salt), for the tiers' quotas."""
        self.limit = token_limit(request)
        self.keys: list[PageKey] = []

    def upto(self, tokens: list[int], pages: int, page_tokens: int) -> list[PageKey]:
        """Keys of the first ``pages`` pages, fewer when the request's :attr:`limit` stops them."""
        pages = min(pages, self.limit // page_tokens)
        have = len(self.keys)
        if pages > have:
            prior = self.keys[-1].digest if self.keys else self.seed
            more = chain_digests(tokens[have * page_tokens:pages * page_tokens], page_tokens, prior)
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
