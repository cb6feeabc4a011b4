"""Engine KV events in one normalised form, whatever carried them (vLLM/SGLang ZMQ msgpack,
OpenEngine `SubscribeKvEvents` protobuf).

These mirror vLLM's `BlockStored` / `BlockRemoved` / `AllBlocksCleared`: block hashes stay as
the engine sent them (unsigned or signed ints, or byte digests); `indexer.translate` turns them
into index batches for one worker. Frozen, slotted, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

EngineHash = int | bytes  # as the engine sent it: uint64, int64 or a byte digest


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[EngineHash, ...]
    # Parent of block_hashes[0]; each later block's parent is the one before it.
    parent_block_hash: EngineHash | None = None
    # Flat, `len(block_hashes) * block_size` long when the engine sent tokens; () when not.
    token_ids: tuple[int, ...] = ()
    block_size: int | None = None
    # "GPU", "CPU", "CPU_PINNED", "DISK", "STORAGE", "EXTERNAL", ... upper-cased; None = unset.
    medium: str | None = None
    lora_name: str | None = None
    # vLLM's deprecated adapter id, the only LoRA identity older vLLM sends (no lora_name):
    # a block with it is a LoRA's, whose canonical key its tokens alone cannot give. (An int
    # from vLLM; SGLang's adapter ids are strings, which its events may carry one day.)
    lora_id: int | str | None = None
    # One entry per block (None or a tuple of hashable keys), or () when the engine sent none.
    extra_keys: tuple[tuple[object, ...] | None, ...] = ()
    # SGLang sends the salt as a field; vLLM puts it in extra_keys of the first block.
    cache_salt: str | None = None
    group_idx: int = 0
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    # Newer senders may scope a clear to one medium; None = every medium.
    medium: str | None = None


EngineEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One engine batch (vLLM `KVEventBatch`), as decoded; bad events already skipped."""

    ts: float
    events: tuple[EngineEvent, ...]
    data_parallel_rank: int | None = None
    # Events dropped while decoding: malformed ones, and tags this decoder does not know.
    num_bad_events: int = 0
    num_unknown_events: int = 0
    # The unknown events' tags, each once, in the order seen (what a newer engine sends).
    unknown_types: tuple[str, ...] = ()
