"""kvplane's canonical block keys: one chained 64-bit key per full block of tokens.

`key(block i) = xxh3_64(tokens of block i [+ its extra ids], seed = key(block i - 1))`, the
first block seeded by the sequence's namespace (LoRA name and cache salt) or by `parent` when
continuing a known chain. Because each key folds in its parent, a key names its whole prefix:
equal keys mean equal token prefixes under the same LoRA and salt (up to 64-bit collisions).
The router hashes prompts with this function and the ingestion hashes BlockStored `token_ids`
with it, so token-level routing works whatever hash an engine uses internally.

Keys are returned in the seed's signed sfixed64 space. Token ids must lie in [0, 2**32).
Blocks are hashed from the packed token array (4 bytes per token, little-endian), so the cost
is one xxh3 call per block, not a Python loop per token.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

from indexer.batch import BlockKey

_U64 = 1 << 64
_I64_MAX = (1 << 63) - 1
# Tags keep the namespace encodings and the per-block extra ids unambiguous.
_ROOT_TAG = b"kvplane.block-key.v1\x00"
_EXTRA_TAG = b"\xffmm\x00"
_BIG_ENDIAN = sys.byteorder == "big"


def _encode_text(value: str | None) -> bytes:
    # Length-prefixed so ("ab", "c") and ("a", "bc") differ; None differs from "".
    if value is None:
        return b"\x00"
    raw = value.encode()
    return b"\x01" + len(raw).to_bytes(4, "little") + raw


def root_seed(lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """The unsigned seed of a sequence's first block: its namespace (LoRA, cache salt). An
    empty name or salt is none at all (engines and the wire use "" for unset), so "" and None
    give the same keys."""
    return xxhash.xxh3_64_intdigest(
        _ROOT_TAG + _encode_text(lora_name or None) + _encode_text(cache_salt or None)
    )


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    try:
        packed = array("I", token_ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
    if packed.itemsize != 4:  # pragma: no cover - every platform kvplane targets has 4
        packed = array("L", token_ids)
    if _BIG_ENDIAN:  # pragma: no cover - keys must not depend on the host's byte order
        packed.byteswap()
    return packed.tobytes()


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    mm_hashes: Sequence[Sequence[str] | None] | None = None,
    parent: BlockKey | None = None,
) -> list[BlockKey]:
    """Canonical keys of the full blocks of `token_ids` (a trailing partial block has none).

    `mm_hashes[i]`, when given, lists the multimodal item ids whose placeholder tokens overlap
    block i (`indexer.multimodal.block_item_ids`); they enter that block's key. `parent`
    continues an existing chain: the first block is then seeded by `parent` and the namespace
    (`lora_name`, `cache_salt`) is not applied again, since the parent key already carries it.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_blocks = len(token_ids) // block_size
    if num_blocks == 0:
        return []
    num_tokens = num_blocks * block_size
    head = token_ids if len(token_ids) == num_tokens else token_ids[:num_tokens]
    data = memoryview(_pack_tokens(head))
    seed = root_seed(lora_name, cache_salt) if parent is None else parent % _U64
    step = block_size * 4
    digest = xxhash.xxh3_64_intdigest
    seeds: list[int] = []
    append = seeds.append
    if mm_hashes is None:
        for start in range(0, num_tokens * 4, step):
            seed = digest(data[start : start + step], seed)
            append(seed)
    else:
        for i, start in enumerate(range(0, num_tokens * 4, step)):
            extra = mm_hashes[i] if i < len(mm_hashes) else None
            if extra:
                payload = bytes(data[start : start + step]) + _EXTRA_TAG
                seed = digest(payload + b"".join(_encode_text(x) for x in extra), seed)
            else:
                seed = digest(data[start : start + step], seed)
            append(seed)
    return [v - _U64 if v > _I64_MAX else v for v in seeds]
