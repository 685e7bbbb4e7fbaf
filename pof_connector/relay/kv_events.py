"""vLLM's KV-cache events on the wire, without importing vLLM.

A vLLM server started with ``--kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq",...}'``
publishes ZMQ multipart messages ``[topic, seq, payload]``: ``seq`` is a big-endian signed 8-byte
counter, ``payload`` a msgspec-msgpack :class:`KVEventBatch` — an array ``[ts, events,
data_parallel_rank]`` whose events are maps tagged ``"type": "BlockStored" | "BlockRemoved" |
"AllBlocksCleared"``. The structs below mirror ``vllm/distributed/kv_events.py`` of vLLM 0.32
field for field and option for option (field order is the map order on the wire), so a batch
encodes to the same bytes as vLLM's and vLLM decodes ours. Consumers such as ``vllm-router``
reject a whole batch with an unknown key: never add a field here.

Replay (vLLM's ``ZmqEventPublisher``): a ROUTER socket receives ``[client_id, b"", start_seq]``
and answers every buffered batch with ``seq >= start_seq`` as ``[client_id, b"", topic, seq,
payload]``, then ``[client_id, b"", b"", END_SEQ, b""]``.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeAlias

import msgspec

ExternalBlockHash: TypeAlias = bytes | int
"""vLLM's block id on the wire: a 64-bit int by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``),
else the 32-byte digest."""

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The seq frame that ends a replay answer."""

TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]
"""A token id as pof keys hash it (uint32): anything else is refused when decoding."""
BlockSize = Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base of the three events; the tag is the class name under ``"type"``."""


class BlockStored(KVCacheEvent):
    """Blocks ``block_hashes`` (a chain: block ``i``'s parent is block ``i - 1``, block 0's is
    ``parent_block_hash``, ``None`` at the root) now hold ``token_ids`` (``block_size`` per block)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[TokenId]
    block_size: BlockSize
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[KVEvent]  # type: ignore[assignment]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_loose = msgspec.msgpack.Decoder(EventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Raises ``msgspec.DecodeError`` (a ``ValueError``) on bytes that are not a batch."""
    return _decoder.decode(payload)


def decode_events(payload: bytes) -> tuple[KVEventBatch, int]:
    """Decode a batch keeping the events that decode and dropping the others (an unknown event
    type, a field of the wrong type, a token id outside uint32, a block size below 1): returns the
    batch of the good ones and how many were dropped. Raises ``msgspec.DecodeError`` when the
    payload is not a batch at all (not msgpack, not ``[ts, events, rank]``, nested too deeply).

    The strict decoder runs first (one C pass); only a batch it refuses is taken apart event by event."""
    try:
        return _decoder.decode(payload), 0
    except msgspec.ValidationError:
        pass
    except RecursionError:
        raise msgspec.DecodeError("nested too deeply") from None
    try:
        loose = _loose.decode(payload)
    except RecursionError:
        raise msgspec.DecodeError("nested too deeply") from None
    events: list[KVEvent] = []
    for raw in loose.events:
        try:
            events.append(msgspec.convert(raw, KVEvent))   # type: ignore[arg-type]
        except msgspec.ValidationError:
            continue
    return KVEventBatch(ts=loose.ts, events=events, data_parallel_rank=loose.data_parallel_rank), \
        len(loose.events) - len(events)


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def read_seq(frame: bytes) -> int:
    """The seq of a message frame; ``-1`` for a malformed one (what vllm-router reads too)."""
    return int.from_bytes(frame[:8], "big", signed=True) if len(frame) >= 8 else -1
