"""Pool announcements: which pages this engine's pool can load, told to routers as KV events.

Per chain of pages known from KV events the index is asked (:class:`Locator`) how far this pool
node can load it. Two claims follow: the run it loads from its own (or shared) memory, as
``BlockStored`` medium ``"CPU"`` (vllm-router: host memory); and, when the fabric extends that
run, the whole loadable run once more with ``ownership`` :data:`FAR_OWNER` (an external tier).
A page the pool can no longer load is withdrawn (``BlockRemoved``). Announcements always start at
the prompt's first block (parent ``None``): a router drops a store whose parent it has not seen.
"""

from __future__ import annotations

import hashlib
import logging

from pof_connector.index import IndexUnavailable
from pof_connector.index.guarded import LogOnce
from pof_connector.locality.locator import Locator, UnknownModel
from pof_connector.relay.chains import Page, PageChains
from pof_connector.relay.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVEvent

POOL_MEDIUM = MEDIUM_CPU
FAR_OWNER = "pof"
"""``ownership`` of pool pages that only the fabric reaches: vllm-router credits them as an external
tier (``--kv-penalty-external``, 0.6) and files them under this cache owner, which the engine's
``AllBlocksCleared`` leaves alone and a relay restart (its seq starts over) clears."""
FAR_LOCALITY = "REMOTE"

Space = tuple[bytes, int]
"""(namespace, page_tokens) of the pool node."""


class PoolAnnouncer:
    """What routers were told about ``pool_node``'s pool, and the events that bring it up to date."""

    def __init__(self, pool_node: str, locator: Locator, log_once: LogOnce) -> None:
        self.pool_node = pool_node
        self.locator = locator
        self._log_once = log_once
        self._announced: set[bytes] = set()                 # page digests announced to routers as pool
        self._announced_far: set[bytes] = set()             # ... as external pool copies (over the fabric)

    def reset(self) -> None:
        """Forget what was announced (the key space changed: those pages are not ours any more)."""
        self._announced.clear()
        self._announced_far.clear()

    def sync(self, chains: PageChains, block_size: int, space: Space, model: str,
             force: bool = False) -> list[KVEvent]:
        """Events that bring routers' view of the pool to what the index says now; with
        ``force``, every loadable chain again (after a clear, and for late routers)."""
        if space[1] % block_size:
            self._log_once("block-size", logging.ERROR, "pof relay: page_tokens %d is not a multiple of the "
                           "engine's block size %d; pool residency is not announced", space[1], block_size)
            return []
        near_ok: dict[bytes, bool] = {}
        far_ok: dict[bytes, bool] = {}
        stores: list[tuple[list[Page], bool]] = []
        for leaf in chains.leaves():
            chain = chains.chain(leaf)
            if not chain:
                continue
            tokens = [t for p in chain for t in p.token_list()]
            try:
                me = self.locator.locate(tokens, model).nodes.get(self.pool_node)
            except UnknownModel:      # no live pool stores the model any more: nothing is loadable
                me = None
            except IndexUnavailable as e:
                self._log_once("locate", logging.WARNING, "pof relay: cannot look the pool up (%s); keeping "
                               "what routers were told", e)
                return []
            near = me.near_tokens // space[1] if me is not None else 0
            n = me.usable_tokens // space[1] if me is not None else 0
            far = n if n > near else 0
            for i, p in enumerate(chain):
                near_ok[p.digest] = near_ok.get(p.digest, False) or i < near
                far_ok[p.digest] = far_ok.get(p.digest, False) or i < far
            if near and (force or any(p.digest not in self._announced for p in chain[:near])):
                stores.append((chain[:near], False))
            if far and (force or any(p.digest not in self._announced_far for p in chain[:far])):
                stores.append((chain[:far], True))
        out: list[KVEvent] = []
        for announced, ok, far_claim in ((self._announced, near_ok, False), (self._announced_far, far_ok, True)):
            gone = [d for d in announced if not ok.get(d, False)]
            if gone:
                out.append(BlockRemoved(block_hashes=[h for d in gone for h in _block_ids(d, space, block_size,
                                                                                          far_claim)],
                                        medium=POOL_MEDIUM, ownership=FAR_OWNER if far_claim else None,
                                        locality=FAR_LOCALITY if far_claim else None))
                announced.difference_update(gone)
        for chain, far_claim in stores:
            out.append(BlockStored(block_hashes=[h for p in chain for h in _block_ids(p.digest, space, block_size,
                                                                                      far_claim)],
                                   parent_block_hash=None, token_ids=[t for p in chain for t in p.token_list()],
                                   block_size=block_size, lora_id=None, medium=POOL_MEDIUM, lora_name=None,
                                   ownership=FAR_OWNER if far_claim else None,
                                   locality=FAR_LOCALITY if far_claim else None))
            (self._announced_far if far_claim else self._announced).update(p.digest for p in chain)
        return out


def _block_ids(digest: bytes, space: Space, block_size: int, far: bool = False) -> list[int]:
    """Router block ids of a pool page: derived from its pof digest, so they are the same after a
    relay restart and never collide with the engine's own (another hash of other bytes); the
    external claim (``far``) gets ids of its own."""
    salt = b"pof-relay-far" if far else b"pof-relay"
    return [int.from_bytes(hashlib.sha256(salt + digest + j.to_bytes(4, "big")).digest()[:8], "big")
            for j in range(space[1] // block_size)]
