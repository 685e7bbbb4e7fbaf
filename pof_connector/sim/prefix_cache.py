"""An engine's prefix cache as vLLM keeps it: blocks of finished (or running) requests stay cached
while free, and are evicted least-recently-used when an allocation needs them, the tail of a
prefix first (vLLM frees a request's blocks in reverse order, so its leading blocks outlive them).

Entries are whole prefixes by key (``t:<tenant>``: a system prompt, ``s:<session>``: a session's
context so far), block-aligned as the engine caches full blocks only. A session's context starts
with its tenant's system prompt, and in vLLM those leading blocks are the *same* blocks (one hash
chain, shared by reference count): an entry may name a ``base`` of leading blocks that belong to
another entry, which it does not count (as cached room or as used memory) and without which it is
unreachable (a lookup walks the chain from its first block). An entry a running request holds is
*pinned*: its own blocks are that request's (counted in the node's used blocks), so it is never
evicted and does not count against the cache's room.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixCache:
    def __init__(self, block_tokens: int, node: int = 0, holders: dict[str, set[int]] | None = None) -> None:
        self.block_tokens = block_tokens
        self.node = node
        self.holders = holders
        """Shared by the nodes of a run: key -> the nodes whose cache has an entry for it (so a
        lookup visits the nodes that have the prefix, not every node); ``None``: not kept."""
        self._entries: OrderedDict[str, list[int]] = OrderedDict()
        """key -> [tokens, pins, base blocks]"""
        self.free_blocks = 0
        """Own blocks of unpinned entries: free to the allocator, cached until evicted."""

    def tokens(self, key: str) -> int:
        """Cached leading tokens under ``key`` (0: none); touches it."""
        e = self._entries.get(key)
        if e is None:
            return 0
        self._entries.move_to_end(key)
        return e[0]

    def peek(self, key: str) -> int:
        e = self._entries.get(key)
        return 0 if e is None else e[0]

    def pins(self, key: str) -> int:
        """Running requests holding ``key`` (0: none, or no entry)."""
        e = self._entries.get(key)
        return 0 if e is None else e[1]

    def _own(self, e: list[int]) -> int:
        return max(e[0] // self.block_tokens - e[2], 0)

    def pin(self, key: str, tokens: int, base_blocks: int = 0) -> None:
        """A running request holds ``key``'s first ``tokens`` (adds or grows the entry), of which
        the first ``base_blocks`` blocks are another entry's."""
        tokens -= tokens % self.block_tokens
        e = self._entries.get(key)
        if e is None:
            self._entries[key] = [tokens, 1, base_blocks]
            if self.holders is not None:
                self.holders.setdefault(key, set()).add(self.node)
            return
        if e[1] == 0:
            self.free_blocks -= self._own(e)
        e[0] = max(e[0], tokens)
        e[1] += 1
        e[2] = base_blocks
        self._entries.move_to_end(key)

    def unpin(self, key: str, tokens: int = 0) -> None:
        """A request let go of ``key``, whose cached length is now at least ``tokens``."""
        e = self._entries[key]
        e[0] = max(e[0], tokens - tokens % self.block_tokens)
        e[1] -= 1
        if e[1] == 0:
            self.free_blocks += self._own(e)
            self._entries.move_to_end(key)    # freed now: vLLM queues freed blocks at the back

    def shrink(self, room_blocks: int) -> None:
        """Evict least-recently-used unpinned entries until they fit in ``room_blocks``; the last
        one evicted loses only the tail blocks it must give up."""
        if self.free_blocks <= room_blocks:
            return
        victims = []
        free = self.free_blocks
        for key, e in self._entries.items():      # oldest first; stop once enough is found
            if e[1] == 0:
                blocks = self._own(e)
                over = free - room_blocks
                if blocks > over:
                    e[0] -= over * self.block_tokens
                    free -= over
                    break
                victims.append(key)
                free -= blocks
                if free <= room_blocks:
                    break
        for key in victims:
            del self._entries[key]
            if self.holders is not None:
                nodes = self.holders[key]
                nodes.discard(self.node)
                if not nodes:
                    del self.holders[key]
        self.free_blocks = free
