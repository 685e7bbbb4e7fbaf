"""Engine blocks → pof pages: what a relay learns from KV events.

An engine names a block by its own hash and announces its tokens once (``BlockStored``); pof
names a page by its chain digest over every token before it (:mod:`pof_connector.pages.keys`). The
:class:`PageChains` turns the first into the second: per engine block it keeps the pof chain
state (the digest of the last full page before it, and the tokens of the page it belongs to so
far), so a child block announced later continues the chain from its parent. The pages it
completes are kept with their tokens, because the pool may still hold a page long after the
engine dropped it, and a router can only be told about a page with its tokens.

Both maps are bounded LRUs: a forgotten block only means its children are not recognised; a
forgotten page is not announced any more.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

from pof_connector.pages.keys import SEGMENT_PAGES, ChainPlace
from pof_connector.relay.kv_events import BlockStored, ExternalBlockHash

BlockId = tuple[Hashable, ExternalBlockHash]
"""(event source, engine block hash): engines may hash differently (e.g. PYTHONHASHSEED)."""


@dataclass(slots=True)
class _Block:
    prior: bytes | None
    """Chain digest of the last full page before this block's page (``None``: none, no seed)."""
    pending: bytes
    """The tokens (little-endian uint32) of this block's page up to and including this block."""
    members: tuple[BlockId, ...]
    """The blocks of this block's page up to and including this block."""
    page: bytes | None = None
    """Digest of the page that this block completes."""
    position: int = 0
    """Position in its chain of this block's page."""
    head: bytes | None = None
    """Digest of that page's segment head, when the head is an earlier page."""


@dataclass(slots=True)
class Page:
    digest: bytes
    parent: bytes | None
    """Digest of the page before it; ``None`` for the first page of a prompt."""
    tokens: bytes
    """Its ``page_tokens`` token ids as little-endian uint32."""
    children: int = 0
    blocks: tuple[BlockId, ...] = field(default=())
    """The engine blocks it was made of (in the source that announced it last)."""
    place: ChainPlace | None = None
    """Where it sits in its chain (every page made from events knows it)."""

    def token_list(self) -> list[int]:
        return np.frombuffer(self.tokens, dtype="<u4").tolist()  # type: ignore[no-any-return]


class PageChains:
    """Recognises pof pages in engines' ``BlockStored`` events; not thread-safe."""

    def __init__(self, page_tokens: int, *, max_blocks: int = 1 << 18, max_pages: int = 1 << 16) -> None:
        if page_tokens <= 0:
            raise ValueError(f"page_tokens must be positive, got {page_tokens}")
        self.page_tokens = page_tokens
        self.max_blocks = max_blocks
        self.max_pages = max_pages
        self._blocks: OrderedDict[BlockId, _Block] = OrderedDict()
        self._pages: OrderedDict[bytes, Page] = OrderedDict()
        self._page_of: dict[BlockId, bytes] = {}
        self.skipped = 0
        """Events not turned into pages: salted, LoRA or multimodal blocks, unknown parents,
        block sizes that do not divide the page."""

    def stored(self, source: Hashable, event: BlockStored) -> list[Page]:
        """Record ``event``'s blocks; returns the pages they complete, in chain order."""
        if (event.lora_name is not None or event.lora_id is not None
                or any(k for k in (event.extra_keys or ()) if k)):
            # Salted / LoRA / multimodal blocks have keys pof cannot derive from tokens alone.
            self.skipped += 1
            return []
        bs = event.block_size
        if bs <= 0 or self.page_tokens % bs or len(event.token_ids) != bs * len(event.block_hashes):
            self.skipped += 1
            return []
        prior: bytes | None = None
        pending = b""
        members: tuple[BlockId, ...] = ()
        position, head = 0, None
        if event.parent_block_hash is not None:
            parent = self._blocks.get((source, event.parent_block_hash))
            if parent is None:
                self.skipped += 1
                return []
            self._blocks.move_to_end((source, event.parent_block_hash))
            if parent.page is not None:
                prior = parent.page
                position, head = _next_place(parent.page, parent.position, parent.head)
            else:
                prior, pending, members = parent.prior, parent.pending, parent.members
                position, head = parent.position, parent.head
        data = np.asarray(event.token_ids, dtype="<u4").tobytes()
        done: list[Page] = []
        for i, h in enumerate(event.block_hashes):
            bid = (source, h)
            pending += data[i * bs * 4:(i + 1) * bs * 4]
            members += (bid,)
            block = _Block(prior, pending, members, position=position, head=head)
            if len(pending) == 4 * self.page_tokens:
                digest = hashlib.sha256((prior or b"") + pending).digest()
                block.page = digest
                done.append(self._add_page(digest, prior, pending, members, ChainPlace(position, head or digest)))
                prior, pending, members = digest, b"", ()
                position, head = _next_place(digest, position, head)
            self._blocks[bid] = block
            self._blocks.move_to_end(bid)
        while len(self._blocks) > self.max_blocks:
            bid, _ = self._blocks.popitem(last=False)
            self._page_of.pop(bid, None)
        return done

    def _add_page(self, digest: bytes, parent: bytes | None, tokens: bytes, blocks: tuple[BlockId, ...],
                  place: ChainPlace) -> Page:
        page = self._pages.get(digest)
        if page is None:
            page = Page(digest, parent, tokens, blocks=blocks, place=place)
            self._pages[digest] = page
            if parent is not None and (up := self._pages.get(parent)) is not None:
                up.children += 1
            while len(self._pages) > self.max_pages:
                self._drop_oldest()
        else:
            page.blocks = blocks
        self._pages.move_to_end(digest)
        for bid in blocks:
            self._page_of[bid] = digest
        return page

    def _drop_oldest(self) -> None:
        _, old = self._pages.popitem(last=False)
        if old.parent is not None and (up := self._pages.get(old.parent)) is not None:
            up.children -= 1

    def page_of(self, block: BlockId) -> bytes | None:
        """Digest of the page that ``block`` is part of, when that page is known."""
        return self._page_of.get(block)

    def page(self, digest: bytes) -> Page | None:
        return self._pages.get(digest)

    def leaves(self) -> list[bytes]:
        """Pages no known page continues: each names one chain to look up."""
        return [d for d, p in self._pages.items() if p.children == 0]

    def chain(self, digest: bytes) -> list[Page] | None:
        """The pages from the prompt's first page to ``digest``; ``None`` when one was forgotten."""
        out: list[Page] = []
        cur: bytes | None = digest
        while cur is not None:
            page = self._pages.get(cur)
            if page is None:
                return None
            out.append(page)
            cur = page.parent
        out.reverse()
        return out

    def __len__(self) -> int:
        return len(self._pages)


def _next_place(digest: bytes, position: int, head: bytes | None) -> tuple[int, bytes | None]:
    """The position and (earlier) segment head of the page after the page ``digest`` at ``position``
    whose segment head is ``head`` (``None``: ``digest`` itself)."""
    after = position + 1
    return after, None if after % SEGMENT_PAGES == 0 else (head or digest)
