"""Which engine blocks the relay keeps to itself (salted prompts'), event by event."""

from __future__ import annotations

from pof_connector.relay.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, ExternalBlockHash
from pof_connector.relay.private import PrivateBlocks, salted


def stored(hashes: list[int], parent: int | None = None, keys: list[tuple[object, ...] | None] | None = None,
           lora: str | None = None) -> BlockStored:
    ids: list[ExternalBlockHash] = list(hashes)
    return BlockStored(block_hashes=ids, parent_block_hash=parent, token_ids=list(range(4 * len(hashes))),
                       block_size=4, lora_id=1 if lora else None, medium="GPU", lora_name=lora, extra_keys=keys)


def test_salts_are_told_from_lora_names_and_multimodal_keys() -> None:
    assert salted(("tenant-a",), None)
    assert salted(("my-lora", "tenant-a"), "my-lora")
    assert not salted(("my-lora",), "my-lora")
    assert not salted((("img-digest", 0),), None) and not salted(None, None) and not salted((), None)


def test_salted_chains_are_cut_out_and_the_rest_passes() -> None:
    p = PrivateBlocks()
    public = stored([1, 2])
    assert p.redact(public) is public
    assert p.redact(stored([10, 11], keys=[("salt",), None])) is None        # the salted prompt's start
    assert p.redact(stored([12], parent=11)) is None                         # ... and what chains after it
    assert p.redact(stored([3], parent=2)) == stored([3], parent=2)          # a public chain goes on
    cut = p.redact(stored([4, 13], parent=3, keys=[None, ("salt",)]))
    assert isinstance(cut, BlockStored) and cut.block_hashes == [4] and cut.token_ids == [0, 1, 2, 3]
    assert cut.extra_keys == [None]
    assert p.redact(BlockRemoved(block_hashes=[10, 12], medium="GPU")) is None
    assert p.redact(BlockRemoved(block_hashes=[1, 11], medium="GPU")) == BlockRemoved(block_hashes=[1], medium="GPU")
    assert p.redact(AllBlocksCleared()) == AllBlocksCleared()
    assert p.dropped == 7                                                    # 4 stored, 3 removed


def test_the_private_set_is_bounded() -> None:
    p = PrivateBlocks(max_blocks=4)
    for h in range(10):
        p.redact(stored([100 + h], keys=[("salt",)]))
    assert p.redact(BlockRemoved(block_hashes=[100], medium="GPU")) is not None   # forgotten: its removal passes
    assert p.redact(BlockRemoved(block_hashes=[109], medium="GPU")) is None
