"""KV event batches on the wire: OpenEngine protobuf and vLLM 0.32's msgpack.

msgpack (the ZMQ publisher), matching the bytes vLLM 0.32.0 emits (checked against the real
capture in `../shared/data/vllm-0.32.0-kv-events/`): an EventBatch is the array
`[ts (float64 seconds), [event, ...], data_parallel_rank]`; each event is a map with "type"
first and the keys in vLLM's order. vLLM 0.32 omits only fields whose default is None
(`kv_cache_spec_sliding_window`); required fields it sends even when nil (`lora_id`,
`lora_name`, `extra_keys` entries). Block keys go out as unsigned 64-bit integers.

protobuf (SubscribeKvEvents): `KvBlockHash{value: 8 bytes big-endian two's complement,
encoding: "int64"}`; one `OpaqueKeyTuple` per block in `extra_keys` (empty for none).

Extra keys on both wires follow vLLM 0.32's capture: a cache salt is the first block's
`[salt]` (the core records it as `("cache_salt", salt)`).
"""

from __future__ import annotations

from typing import Any

import msgpack

from engine.core.api import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, Medium
from engine.server.kv_event_log import KvEventBatchRecord
from openengine.v1 import openengine_pb2 as pb

_U64 = (1 << 64) - 1
_KV_CACHE_SPEC_KIND = "full_attention"
_CACHE_SALT_TAG = "cache_salt"

_PROTO_MEDIUM = {
    Medium.GPU: pb.STORAGE_MEDIUM_GPU,
    Medium.CPU: pb.STORAGE_MEDIUM_CPU_PINNED,
    Medium.DISK: pb.STORAGE_MEDIUM_DISK,
    Medium.EXTERNAL: pb.STORAGE_MEDIUM_EXTERNAL,
}


def unsigned64(key: int) -> int:
    """A 64-bit key as vLLM sends it: unsigned (-1 -> 2**64 - 1)."""
    return key & _U64


def key_bytes(key: int) -> bytes:
    """A 64-bit key as 8 big-endian bytes (two's complement for negative keys)."""
    return (key & _U64).to_bytes(8, "big")


# ------------------------------------------------------------------------------------------
# msgpack (vLLM 0.32)
# ------------------------------------------------------------------------------------------


def _event_map(event: KvEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": [unsigned64(k) for k in event.block_keys],
            "parent_block_hash": None if event.parent_key is None else unsigned64(event.parent_key),
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium.value,
            "lora_name": event.lora_name,
            "extra_keys": _per_block(event.extra_keys, len(event.block_keys)),
            "group_idx": 0,
            "kv_cache_spec_kind": _KV_CACHE_SPEC_KIND,
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": [unsigned64(k) for k in event.block_keys],
            "medium": event.medium.value,
            "group_idx": 0,
        }
    return {"type": "AllBlocksCleared"}


def _per_block(
    extra_keys: tuple[tuple[str, ...] | None, ...], num_blocks: int
) -> list[list[str] | None]:
    """One entry per block, as vLLM 0.32 sends them: the core's `("cache_salt", salt)` goes
    out as the plain `[salt]` (what the real capture shows for a salted prompt)."""
    padded: list[list[str] | None] = [
        None if extra is None else _wire_extra(extra) for extra in extra_keys[:num_blocks]
    ]
    padded.extend([None] * (num_blocks - len(padded)))
    return padded


def _wire_extra(extra: tuple[str, ...]) -> list[str]:
    if len(extra) >= 2 and extra[0] == _CACHE_SALT_TAG:
        return list(extra[1:])
    return list(extra)


def encode_msgpack_batch(batch: KvEventBatchRecord, data_parallel_rank: int) -> bytes:
    """One EventBatch payload exactly as vLLM 0.32 packs it."""
    body = [
        batch.timestamp_unix_ns / 1e9,
        [_event_map(event) for event in batch.events],
        data_parallel_rank,
    ]
    packed = msgpack.packb(body, use_bin_type=True)
    assert isinstance(packed, bytes)
    return packed


# ------------------------------------------------------------------------------------------
# protobuf (OpenEngine SubscribeKvEvents)
# ------------------------------------------------------------------------------------------


def _proto_hash(key: int) -> pb.KvBlockHash:
    return pb.KvBlockHash(value=key_bytes(key), encoding="int64")


def _proto_event(event: KvEvent) -> pb.KvEvent:
    if isinstance(event, BlockStored):
        stored = pb.BlockStored(
            block_hashes=[_proto_hash(k) for k in event.block_keys],
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_name=event.lora_name or "",
            medium=_PROTO_MEDIUM[event.medium],
            extra_keys=[
                pb.OpaqueKeyTuple(values=extra or [])
                for extra in _per_block(event.extra_keys, len(event.block_keys))
            ],
            group_idx=0,
            kv_cache_spec_kind=_KV_CACHE_SPEC_KIND,
        )
        if event.parent_key is not None:
            stored.parent_block_hash.CopyFrom(_proto_hash(event.parent_key))
        return pb.KvEvent(block_stored=stored)
    if isinstance(event, BlockRemoved):
        return pb.KvEvent(
            block_removed=pb.BlockRemoved(
                block_hashes=[_proto_hash(k) for k in event.block_keys],
                medium=_PROTO_MEDIUM[event.medium],
            )
        )
    assert isinstance(event, AllBlocksCleared)
    return pb.KvEvent(all_blocks_cleared=pb.AllBlocksCleared())


def to_proto_batch(batch: KvEventBatchRecord, data_parallel_rank: int) -> pb.KvEventBatch:
    return pb.KvEventBatch(
        sequence_number=batch.sequence_number,
        timestamp_unix_nanos=batch.timestamp_unix_ns,
        data_parallel_rank=data_parallel_rank,
        events=[_proto_event(event) for event in batch.events],
    )
