"""Salted engine blocks are not relayed: a router subscribing to the relay learns no tenant's tokens.

vLLM's KV events carry each stored block's token ids, and a salted prompt's first block carries
its ``cache_salt`` in clear in ``extra_keys``; every later block of that prompt chains from it
(its hash covers the salt), with no key of its own. Relaying them would hand any subscriber a
tenant's prompts and salt, which is what the salt keeps from other tenants. :class:`PrivateBlocks`
recognises them (a salt in a block's ``extra_keys``, or a parent that is private) and cuts them
out of the events the relay forwards; their removals are dropped too (nobody was told of them).
A router gives salted requests no prefix credit then, which is also what it can do right: it
cannot tell one tenant's blocks from another's by their tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec

from pof_connector.relay.kv_events import BlockRemoved, BlockStored, ExternalBlockHash, KVEvent


def salted(keys: tuple[Any, ...] | None, lora_name: str | None) -> bool:
    """Whether a block's event ``extra_keys`` hold a cache salt. vLLM publishes them untagged: a
    LoRA name and a salt as bare strings, multimodal features as ``(identifier, offset)`` pairs;
    a string besides the event's LoRA name is a salt (or another key pof cannot read: private)."""
    strings = [k for k in keys or () if isinstance(k, (str, bytes))]
    if lora_name is not None and lora_name in strings:
        strings.remove(lora_name)
    return bool(strings)


class PrivateBlocks:
    """The engine blocks of salted prompts seen so far (a bounded LRU: a forgotten block whose
    children come later lets those children through, tokens without their salted beginning)."""

    def __init__(self, max_blocks: int = 1 << 18) -> None:
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[ExternalBlockHash, None] = OrderedDict()
        self.dropped = 0
        """Blocks cut out of forwarded events."""

    def redact(self, event: KVEvent) -> KVEvent | None:
        """``event`` without its private blocks; ``None`` when nothing is left to forward."""
        if isinstance(event, BlockStored):
            return self._stored(event)
        if isinstance(event, BlockRemoved):
            public = [h for h in event.block_hashes if h not in self._blocks]
            if len(public) == len(event.block_hashes):
                return event
            self.dropped += len(event.block_hashes) - len(public)
            return msgspec.structs.replace(event, block_hashes=public) if public else None
        return event

    def _stored(self, ev: BlockStored) -> BlockStored | None:
        first: int | None = 0 if ev.parent_block_hash is not None and ev.parent_block_hash in self._blocks else None
        if first is None:
            keys = ev.extra_keys or []
            first = next((i for i, k in enumerate(keys) if salted(k, ev.lora_name)), None)
        if first is None:
            return ev
        for h in ev.block_hashes[first:]:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)
        self.dropped += len(ev.block_hashes) - first
        if first == 0:
            return None
        return msgspec.structs.replace(ev, block_hashes=ev.block_hashes[:first],
                                       token_ids=ev.token_ids[:first * ev.block_size],
                                       extra_keys=ev.extra_keys[:first] if ev.extra_keys else None)
