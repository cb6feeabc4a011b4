"""vLLM's own prefix-cache block hashes, computed from tokens (the vLLM-compatible mode).

vLLM chains `digest_i = H((digest_{i-1} or NONE_HASH, tuple(block_i_tokens), extra_keys_i or
None))` with the full 32-byte parent digest, where H is
- `sha256`: sha256 of `pickle.dumps(x, protocol=5)` (vLLM's default), or
- `sha256_cbor`: sha256 of `cbor2.dumps(x, canonical=True)`,
and `NONE_HASH = H(seed)` with seed = the engine's PYTHONHASHSEED value when it is set, else
the string "vllm-none-hash". The seed is a parameter here; this module never reads the
environment. The KV events carry `int.from_bytes(digest[-8:], "big")` (unsigned); use
`indexer.batch.to_sfixed64` to put it into the index's key space.

Extra keys: a request's cache salt enters the first block's hash input as the pair
`("cache_salt", salt)` (verified on the real vLLM 0.32.0 capture), although the BlockStored
event's `extra_keys` shows only the bare salt (`["tenant-A"]`): a consumer that rebuilds a hash
from an event must turn that back into the pair. Before the salt, vLLM puts the LoRA name and,
per block, one `(item id, item offset - block start)` pair for each multimodal item overlapping
the block (`block_hashes(lora_name=, mm_items=)` builds them so). The capture has neither LoRA
nor multimodal requests, so those two follow vLLM's published source, not a capture.
"""

from __future__ import annotations

import enum
import hashlib
import pickle
from collections.abc import Sequence
from typing import Any

import cbor2

from indexer.multimodal import MultimodalItem, block_items

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


class VllmHashAlgo(enum.StrEnum):
    SHA256 = "sha256"
    SHA256_CBOR = "sha256_cbor"


def unseeded_problem(
    hash_seed: str | None, algo: VllmHashAlgo | None, seed_setting: str, algo_setting: str
) -> str | None:
    """Why a hash seed given without the vLLM algorithm it seeds is refused (None: it is not):
    kvplane's canonical keys have no seed, so it would be ignored, and a keying declared or
    asked with it would not be the one in use. The settings are named as their config has
    them."""
    if hash_seed is None or algo is not None:
        return None
    algos = " or ".join(a.value for a in VllmHashAlgo)
    return (
        f"{seed_setting} needs {algo_setting} {algos} (the vLLM algorithm it seeds): "
        "kvplane's canonical keys have no seed"
    )


def digest(algo: VllmHashAlgo, value: Any) -> bytes:
    """H(value): 32 bytes."""
    if algo is VllmHashAlgo.SHA256:
        return hashlib.sha256(pickle.dumps(value, protocol=5)).digest()
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def none_hash(algo: VllmHashAlgo, python_hash_seed: str | None = None) -> bytes:
    """The root parent digest: H(PYTHONHASHSEED value) if given, else H("vllm-none-hash")."""
    seed = DEFAULT_NONE_HASH_SEED if python_hash_seed is None else python_hash_seed
    return digest(algo, seed)


def digest_to_int(value: bytes) -> int:
    """The integer form vLLM publishes: the last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(value[-8:], "big")


def block_digests(
    token_ids: Sequence[int],
    block_size: int,
    *,
    algo: VllmHashAlgo = VllmHashAlgo.SHA256,
    python_hash_seed: str | None = None,
    cache_salt: str | None = None,
    extra_keys: Sequence[tuple[Any, ...] | None] | None = None,
    parent: bytes | None = None,
) -> list[bytes]:
    """vLLM's 32-byte digests of the full blocks of `token_ids`.

    `extra_keys[i]` (when given) is block i's extra-key tuple before the salt (LoRA name,
    multimodal hashes, as the engine builds them); the salt is appended to block 0's keys
    when `parent` is None (a continuation never repeats it). `parent` continues a chain from
    a known 32-byte digest.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    prev = parent if parent is not None else none_hash(algo, python_hash_seed)
    out: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        keys: tuple[Any, ...] = ()
        if extra_keys is not None and i < len(extra_keys) and extra_keys[i]:
            keys = tuple(extra_keys[i] or ())
        if i == 0 and parent is None and cache_salt:
            keys += (("cache_salt", cache_salt),)
        block = tuple(token_ids[i * block_size : (i + 1) * block_size])
        prev = digest(algo, (prev, block, keys or None))
        out.append(prev)
    return out


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    algo: VllmHashAlgo = VllmHashAlgo.SHA256,
    python_hash_seed: str | None = None,
    cache_salt: str | None = None,
    lora_name: str | None = None,
    mm_items: Sequence[MultimodalItem] = (),
) -> list[int]:
    """vLLM's published (unsigned 64-bit) block hashes of the full blocks of `token_ids`, for a
    request with that LoRA adapter, cache salt and multimodal items ("" means none)."""
    num_blocks = len(token_ids) // block_size if block_size > 0 else 0
    per_block = block_items(mm_items, num_blocks, block_size) if mm_items else [None] * num_blocks
    lora: tuple[Any, ...] = (lora_name,) if lora_name else ()
    extra_keys = [lora + (items or ()) or None for items in per_block]
    return [
        digest_to_int(d)
        for d in block_digests(
            token_ids,
            block_size,
            algo=algo,
            python_hash_seed=python_hash_seed,
            cache_salt=cache_salt or None,
            extra_keys=extra_keys,
        )
    ]
