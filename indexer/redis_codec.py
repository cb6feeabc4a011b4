"""Byte encodings shared by the Redis backend and its Functions library (redis_functions.lua).

Block keys travel as 8-byte big-endian signed integers (Lua numbers are doubles and cannot hold
them), masks and sizes as big-endian uint32, a cache spec as six uint32 ("" = legacy). Replies
carry placements as fixed-size records. Pure: no I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence

from indexer.batch import Action, ActionType, Batch, BlockKey, CacheSpec

_SPEC = struct.Struct(">6I")
# A placement in a match or dump reply: worker id, tier, component mask, copies.
PLACEMENT = struct.Struct(">HBIH")
# A placement in a prefix-scan reply: worker id, tier, component mask.
SCAN_PLACEMENT = struct.Struct(">HBI")
_U32 = struct.Struct(">I")


def pack_keys(keys: Sequence[BlockKey]) -> bytes:
    return struct.pack(f">{len(keys)}q", *keys)


def pack_key(key: BlockKey) -> bytes:
    return struct.pack(">q", key)


def unpack_key(data: bytes) -> BlockKey:
    key: BlockKey = struct.unpack(">q", data)[0]
    return key


def pack_u32s(values: Sequence[int]) -> bytes:
    return struct.pack(f">{len(values)}I", *values)


def u32(data: bytes) -> int:
    value: int = _U32.unpack_from(data)[0]
    return value


def pack_spec(spec: CacheSpec | None) -> bytes:
    if spec is None:
        return b""
    return _SPEC.pack(
        spec.version,
        spec.components,
        spec.swa_window_tokens,
        spec.full_tier_mask,
        spec.swa_tier_mask,
        spec.mamba_tier_mask,
    )


def unpack_spec(data: bytes) -> CacheSpec | None:
    if not data:
        return None
    return CacheSpec(*_SPEC.unpack(data))


def batch_args(batch: Batch, fence: bytes = b"") -> list[bytes | str | int]:
    """One batch's part of kvp_apply's arguments (which follow the bucket count and the boot
    token, batch after batch): its worker, address, spec, fence (b"": unconditional, else
    `fence_arg`'s) and number of actions, then seven per action."""
    args: list[bytes | str | int] = [
        # Encoded here (strictly), so that a string Redis cannot take fails this batch alone.
        batch.worker_id.encode(),
        batch.worker_address.encode(),
        pack_spec(batch.cache_spec),
        fence,
        len(batch.actions),
    ]
    for action in batch.actions:
        args += _action_args(action)
    return args


def fence_arg(holder: str, engine: str) -> bytes:
    """A write allowed only while `holder` holds `engine`'s writer lease (check_fence in
    redis_functions.lua)."""
    return f"{holder} {engine}".encode()


def _action_args(action: Action) -> list[bytes | str | int]:
    if action.type == ActionType.CLEAR_ALL_AT_TIER:
        return [int(action.type), int(action.tier), b"", b"", b"", b"", b"0"]
    report = action.type == ActionType.REPORT
    return [
        int(action.type),
        int(action.tier),
        pack_keys(action.hashes),
        pack_u32s(action.component_masks) if report else b"",
        pack_u32s(action.block_sizes) if report else b"",
        pack_key(action.parent) if report and action.parent is not None else b"",
        b"1" if action.copies else b"0",
    ]


def iter_placements(data: bytes, offset: int = 0) -> Iterator[tuple[int, int, int, int]]:
    """(worker id, tier, mask, copies) records of a reply item from `offset`."""
    return PLACEMENT.iter_unpack(memoryview(data)[offset:])


def iter_scan_placements(data: bytes) -> Iterator[tuple[int, int, int]]:
    """(worker id, tier, mask) records of a prefix-scan block item (after its token count)."""
    return SCAN_PLACEMENT.iter_unpack(memoryview(data)[4:])
