"""pof's msgspec mirror of vLLM's KV-event wire format: the layout consumers parse, and (in the vLLM
venv) byte-identical encoding both ways with vLLM 0.32's own classes."""

from __future__ import annotations

import msgspec
import pytest

from pof_connector.relay.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    read_seq,
    seq_frame,
)


def sample() -> KVEventBatch:
    return KVEventBatch(ts=1.5, data_parallel_rank=0, events=[
        BlockStored(block_hashes=[1, 2**64 - 1], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
                    lora_id=None, medium="GPU", lora_name=None),
        BlockStored(block_hashes=[b"x" * 32], parent_block_hash=5, token_ids=[7, 8], block_size=2, lora_id=3,
                    medium="CPU", lora_name="l", extra_keys=[("salt",), None], group_idx=1,
                    kv_cache_spec_kind="full", kv_cache_spec_sliding_window=4, locality="LOCAL", ownership="o",
                    session_id="s"),
        BlockRemoved(block_hashes=[7], medium="GPU"),
        BlockRemoved(block_hashes=[b"y" * 32], medium=None, group_idx=0, locality="REMOTE", ownership="x"),
        AllBlocksCleared(),
    ])


def test_layout_is_what_consumers_parse() -> None:
    raw = msgspec.msgpack.decode(encode_batch(sample()))
    ts, events, rank = raw                                   # a positional array, not a map
    assert ts == 1.5 and rank == 0
    # Fields without a default are always sent (vllm-router requires them), defaults are omitted.
    assert events[0] == {"type": "BlockStored", "block_hashes": [1, 2**64 - 1], "parent_block_hash": None,
                         "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": "GPU",
                         "lora_name": None}
    assert list(events[1]) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                               "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                               "kv_cache_spec_sliding_window", "locality", "ownership", "session_id"]
    assert events[2] == {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}
    assert events[4] == {"type": "AllBlocksCleared"}
    assert msgspec.msgpack.decode(encode_batch(KVEventBatch(ts=2.0, events=[]))) == [2.0, [], None]


def test_round_trip_and_seq_frames() -> None:
    batch = sample()
    assert decode_batch(encode_batch(batch)) == batch
    assert read_seq(seq_frame(41)) == 41 and read_seq(seq_frame(-1)) == -1 and read_seq(b"\x00") == -1
    assert seq_frame(1) == (1).to_bytes(8, "big")
    with pytest.raises(msgspec.DecodeError):
        decode_batch(msgspec.msgpack.encode([1.0, [{"type": "BlockMoved", "block_hashes": [1]}]]))


@pytest.mark.vllm
def test_byte_identical_with_vllm() -> None:
    vllm = pytest.importorskip("vllm.distributed.kv_events")
    theirs = vllm.KVEventBatch(ts=1.5, data_parallel_rank=0, events=[
        vllm.BlockStored(block_hashes=[1, 2**64 - 1], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                         block_size=2, lora_id=None, medium="GPU", lora_name=None),
        vllm.BlockStored(block_hashes=[b"x" * 32], parent_block_hash=5, token_ids=[7, 8], block_size=2, lora_id=3,
                         medium="CPU", lora_name="l", extra_keys=[("salt",), None], group_idx=1,
                         kv_cache_spec_kind="full", kv_cache_spec_sliding_window=4, locality="LOCAL",
                         ownership="o", session_id="s"),
        vllm.BlockRemoved(block_hashes=[7], medium="GPU"),
        vllm.BlockRemoved(block_hashes=[b"y" * 32], medium=None, group_idx=0, locality="REMOTE", ownership="x"),
        vllm.AllBlocksCleared(),
    ])
    raw = msgspec.msgpack.Encoder().encode(theirs)            # what vLLM's ZmqEventPublisher sends
    assert decode_batch(raw) == sample()
    assert encode_batch(sample()) == raw
    assert msgspec.msgpack.Decoder(vllm.KVEventBatch).decode(encode_batch(sample())) == theirs
