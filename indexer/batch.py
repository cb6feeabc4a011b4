"""The normalised form of KV placement changes that every event source produces and every
index backend applies: kv_indexer.v1's ordered batch of REPORT / REVOKE / CLEAR_ALL_AT_TIER
actions, as immutable named tuples and frozen dataclasses (proto types stop at the adapters).

Block keys are signed 64-bit integers (the seed's `sfixed64` space); `to_sfixed64` maps the
engines' unsigned ints and byte digests into it (WIRE.md section 1).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

BlockKey = int  # a signed 64-bit block key


class Tier(enum.IntEnum):
    """Storage tiers, numbered as kv_indexer.v1.TierType."""

    HBM = 1
    DRAM = 2
    SSD = 3


class ActionType(enum.IntEnum):
    """kv_indexer.v1.ExternalKvActionType."""

    REPORT = 1
    REVOKE = 2
    CLEAR_ALL_AT_TIER = 3


class Component(enum.IntFlag):
    FULL = 1
    SWA = 2
    MAMBA = 4


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """kv_indexer.v1.WorkerCacheSpec. Tier masks are bitmasks of (1 << Tier)."""

    version: int = 0
    components: int = 0
    swa_window_tokens: int = 0
    full_tier_mask: int = 0
    swa_tier_mask: int = 0
    mamba_tier_mask: int = 0


class Action(NamedTuple):
    """One action of a batch. An immutable, slotted named tuple rather than a frozen dataclass:
    wire decoding builds one per action, and a tuple is built several times faster (use
    `action._replace(...)` for an altered copy)."""

    type: ActionType
    tier: Tier
    hashes: tuple[BlockKey, ...] = ()
    # REPORT only (each empty or aligned with `hashes` there); ignored, unchecked, elsewhere.
    component_masks: tuple[int, ...] = ()
    block_sizes: tuple[int, ...] = ()
    # REPORT only: parent of hashes[0]; None = root.
    parent: BlockKey | None = None
    # Physical-copy counting (kvplane extension, never set by the kv_indexer.v1 wire): a source
    # whose engine can hold one block in several physical copies on one worker sets this on
    # REPORTs of new copies (each adds one copy) and on REVOKEs (each drops one; the placement
    # leaves with its last copy). False: the seed's plain REPORT (a replace, never a new copy)
    # and REVOKE (removes the placement whatever its copy count).
    copies: bool = False


class Batch(NamedTuple):
    """One ordered, atomic batch of actions from one worker (an immutable named tuple, as
    `Action` is, for the same reason)."""

    worker_id: str
    actions: tuple[Action, ...]
    worker_address: str = ""
    seq: int = 0
    # None = legacy / full-only worker.
    cache_spec: CacheSpec | None = None
    # Written by a source under its engine's writer lease (`indexer.writer_lease.LeasedSink`):
    # a shared backend makes it only while this process holds the lease. False: an
    # unconditional write (the KVIndexer API's applies, seed 004).
    under_lease: bool = False


_U64 = 1 << 64
_I64_MAX = (1 << 63) - 1


def to_sfixed64(engine_hash: int | bytes) -> BlockKey:
    """An engine's block hash in the seed's sfixed64 space.

    bytes -> the last 8 bytes, big-endian, signed (shorter strings are zero-padded on the
    left); unsigned ints -> two's complement (2**64 - 1 -> -1, 2**63 -> -2**63); signed ints
    pass through. Raises ValueError for other types or ints outside [-2**63, 2**64).
    """
    if isinstance(engine_hash, bytes | bytearray):
        return int.from_bytes(bytes(engine_hash[-8:]).rjust(8, b"\0"), "big", signed=True)
    if isinstance(engine_hash, bool) or not isinstance(engine_hash, int):
        raise ValueError(f"block hash must be int or bytes, got {type(engine_hash).__name__}")
    if engine_hash < -(1 << 63) or engine_hash >= _U64:
        raise ValueError(f"block hash {engine_hash} is outside 64 bits")
    return engine_hash - _U64 if engine_hash > _I64_MAX else engine_hash
