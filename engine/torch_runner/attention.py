"""Attention over a paged KV cache.

Layout. Each layer owns one key and one value tensor of shape
`[num_blocks, block_size, num_kv_heads, head_dim]`. A sequence's token at position `p` lives in
slot `block_table[p // block_size] * block_size + p % block_size` of the flattened cache:

    block_table = [7, 2]          block_size = 4
    position:   0  1  2  3 | 4  5  6  7
    slot:      28 29 30 31 | 8  9 10 11

One step computes a flat batch of tokens (each scheduled sequence's new tokens, one after the
other). `AttentionMetadata.build` turns the per-sequence (start position, number of new tokens,
block table) into tensors once per step; every layer then:

1. writes the step's keys and values into their slots (`index_copy_`), then
2. for each group of sequences, gathers each sequence's blocks (`cache[block_tables]`), pads the
   queries of the group to `[B, max_q]`, and runs `scaled_dot_product_attention` with a mask
   that lets the query at position `p` see exactly the keys at positions `<= p` of its own
   sequence: causal within the new chunk, full over the cached context, nothing past the end.

Groups keep padding bounded: sequences sorted by (new tokens, context) are packed together
while the padded score matrix stays within 1.5x the useful work, so decodes of similar context
share one group and a long prefill chunk gets its own. Padding is what the gather of each
sequence's blocks pays for, and that gather is the memory-bound part of a CPU decode step. On
a GPU the launches of each group cost more than padding does, so groups may pad up to 8x.
Padded query rows are given position 0 so that their softmax is never empty; their outputs are
discarded. On CUDA, SDPA runs without its cuDNN backend (`sdpa_backends`): cuDNN builds an
execution plan for every new shape, and a serving step's shapes change all the time (the
context grows a block at a time, groups come and go).

With the native kernel (`native.py`, metadata built with `kernel_rows`) decodes and prefill
chunks ending within 512 keys skip the groups: each of their tokens is one row of the kernel,
which reads its sequence's blocks in place through the block table (no copy, no padding, no
mask): a decode attends to its context, the token at position p of a prefill chunk to
positions 0 .. p (causal within the chunk, full over the cached context); one call per layer.
Longer chunks, where SDPA's tiles beat the kernel's pass per query, still go through the
groups. Block tables are validated here first and again by the kernel's wrapper.

A fresh prefill chunk (from position 0: nothing cached before it) that would go to the groups
attends only to the step's own keys, causally: it is computed by SDPA with `is_causal` straight
on its rows of the step's queries, keys and values (`FreshPrefill`), with no gather and no mask,
and SDPA skips the key tiles past each query tile (for a cold 1,024-token prompt on CPU, 2/3 of
the masked group's SDPA time with the same output bits, and no mask to build). Its keys and
values are still written to the cache for the steps after it.

Invariant: every slot written in a step belongs to a block the caller owns, and a block table
covers every position of its sequence up to the end of the step's chunk.
"""

from __future__ import annotations

import array
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.torch_runner.errors import KvCacheError
from engine.torch_runner.native import NativeKernels

# write_blocks stages this many bytes of blocks (at least one block) before scattering them.
_STAGING_BYTES = 16 << 20
# A group is split when its padded score matrix exceeds this multiple of the useful one.
_MAX_PADDING_FACTOR = 1.5
# ... on a GPU, where each group's dozen kernel launches cost more than its padded arithmetic:
# a decode step of 32 sequences split into groups of one or two spent ~75 ms of launches per
# step on an 886 M-parameter model (H200, docs/benchmarks/engine.md "On a GPU").
_MAX_PADDING_FACTOR_GPU = 8.0
# ... and when the keys and values it gathers would exceed this many bytes: a group's gathered
# blocks are then still in the core's cache when attention reads them (measured on a 1 MiB L2
# core: decode steps of 32 sequences 1.3-2x faster than one big group read back from L3/DRAM).
_MAX_GROUP_GATHER_BYTES = 2 << 20
# With the native kernel, a prefill chunk is computed by it while it ends within this many keys
# (decodes always are); longer ones go to the groups, whose SDPA then wins: the kernel makes one
# pass over the keys per query row. Measured on random-8x512 (1,024 / 640 / 384-token prompt,
# cold and prefix-cached): SDPA 10-25% / 4-9% faster / even; at <= 256 keys the kernel is faster
# on both benchmark models.
_MAX_KERNEL_CHUNK_KEYS = 512
# Fresh prefill chunks of at least this many tokens get their own causal SDPA call; shorter
# ones stay in the groups, where many short prompts share one call. On CPU (one thread, tiny-
# llama's heads, metadata included) the causal call was faster from 64 tokens on: alone 0.09 vs
# 0.25 ms, eight in one step 0.63 vs 0.68 ms, 1,024 tokens 5.1 vs 8.9 ms.
_MIN_FRESH_PREFILL_TOKENS = 64
# SDPA's backends on CUDA: all but cuDNN. For bfloat16 with a mask SDPA prefers cuDNN, which
# plans each new shape anew (hundreds of ms for a prefill step's); at 32 requests in flight the
# engine made 1,038 tokens/s with it and 1,877 without (16 x 2048 model, H200,
# docs/benchmarks/engine.md "On a GPU").
_CUDA_SDPA_BACKENDS = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


def sdpa_backends(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """The scope of a step's attention calls: on CUDA, SDPA without cuDNN; elsewhere, as is."""
    if device.type == "cuda":
        return sdpa_kernel(_CUDA_SDPA_BACKENDS)
    return contextlib.nullcontext()


@dataclass(frozen=True, slots=True)
class SequenceChunk:
    """What one sequence computes in a step: tokens [start, start + num_tokens)."""

    start: int
    num_tokens: int
    block_table: Sequence[int]


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    # [B, max_q]: index into the step's flat tokens for each padded query (padding -> 0).
    token_index: torch.Tensor
    # [B * num_blocks]: each sequence's blocks, padded with block 0 (masked out), flattened
    # for `index_select` (several times faster than advanced indexing on CPU).
    block_ids: torch.Tensor
    # [B, 1, max_q, num_blocks * block_size]: 0 where the query may attend to the key, -inf
    # elsewhere (an additive float mask is faster than a boolean one in SDPA on CPU).
    mask: torch.Tensor
    # Rows of the flattened [B * max_q] padded output that are real tokens, in flat order ...
    valid_rows: torch.Tensor
    # ... and the flat token index each of them is written back to.
    flat_tokens: torch.Tensor
    # True when the group is the whole step in flat order without padding (no scatter needed).
    is_identity: bool
    # True when no query is padding (decodes: one query each): `valid_rows` is every row.
    all_valid: bool = False


@dataclass(frozen=True, slots=True)
class KernelRows:
    """The step's tokens computed by the native kernel (`native.py`), one row each, reading the
    blocks in place: the token at position p attends to positions 0 .. p of its sequence,
    which covers a decode, a prefill chunk's causal window and the cached context alike."""

    rows: torch.Tensor  # [R] int64: their indices in the step's flat tokens
    block_tables: torch.Tensor  # [S, max_blocks] int64, one per kernel sequence, 0-padded
    table_rows: torch.Tensor  # [R] int64: each token's row of `block_tables`
    lengths: torch.Tensor  # [R] int64: position + 1, the keys the token attends to
    identity: bool  # the rows are the whole step, in flat order


@dataclass(frozen=True, slots=True)
class FreshPrefill:
    """A prefill chunk with nothing before it in its sequence: the token at position p attends
    to the chunk's own tokens 0 .. p, so causal SDPA on the step's rows computes it."""

    first: int  # its first token's index in the step's flat tokens
    num_tokens: int


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    groups: tuple[AttentionGroup, ...]
    num_tokens: int
    # The most blocks any group gathers (sizes the gather workspace once per step).
    max_group_blocks: int = 0
    # With `kernel_rows`: the tokens the native kernel computes (the groups hold the rest).
    kernel_rows: KernelRows | None = None
    # Fresh prefill chunks computed by causal SDPA on the step's own keys (not in the groups).
    fresh_prefills: tuple[FreshPrefill, ...] = ()

    @classmethod
    def build(
        cls,
        chunks: Sequence[SequenceChunk],
        *,
        block_size: int,
        num_blocks: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        key_bytes: int | None = None,
        kernel_rows: bool = False,
        kernel_max_chunk_keys: int = _MAX_KERNEL_CHUNK_KEYS,
        min_fresh_prefill_tokens: int = _MIN_FRESH_PREFILL_TOKENS,
    ) -> AttentionMetadata:
        """`key_bytes`: the bytes of one token's key in one layer (num_kv_heads * head_dim *
        element size); given on CPU, groups are also split to bound the bytes they gather (a
        core's cache); on other devices groups are bounded by padding alone, and a looser one
        (`_MAX_PADDING_FACTOR_GPU`). With
        `kernel_rows`, decodes and the prefill chunks that end within `kernel_max_chunk_keys`
        positions are described in `kernel_rows` instead, for the native kernel; only longer
        chunks go to the groups. Chunks from position 0 of at least `min_fresh_prefill_tokens`
        tokens that would go to the groups are `fresh_prefills` instead.

        Once per step, in plain Python lists (a decode step of 32 sequences would otherwise
        spend longer in dozens of tiny tensor ops than in its attention)."""
        if not chunks:
            raise KvCacheError("a step must compute at least one sequence")
        offsets: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        # With `kernel_rows`: the kernel's tokens, their table rows and lengths, and the used
        # blocks of each kernel sequence; the other chunks go to the groups.
        kernel_tokens: list[int] = []
        table_rows: list[int] = []
        lengths: list[int] = []
        tables: list[Sequence[int]] = []
        grouped: list[int] = []
        fresh: list[FreshPrefill] = []
        total = 0
        for index, chunk in enumerate(chunks):
            start, count, table = chunk.start, chunk.num_tokens, chunk.block_table
            if count <= 0 or start < 0:
                raise KvCacheError(f"bad chunk: start {start}, num_tokens {count}")
            end = start + count
            if len(table) * block_size < end:
                raise KvCacheError(f"block table of {len(table)} blocks cannot hold {end} tokens")
            if min(table) < 0 or max(table) >= num_blocks:
                raise KvCacheError(f"a block table refers to a block outside [0, {num_blocks})")
            offsets.append(total)
            if count == 1:
                positions.append(start)
                slots.append(table[start // block_size] * block_size + start % block_size)
            else:
                span = range(start, end)
                positions.extend(span)
                slots.extend(table[p // block_size] * block_size + p % block_size for p in span)
            if kernel_rows and (count == 1 or end <= kernel_max_chunk_keys):
                table_rows.extend([len(tables)] * count)
                tables.append(table[: -(-end // block_size)])
                kernel_tokens.extend(range(total, total + count))
                lengths.extend(range(start + 1, end + 1))
            elif start == 0 and count >= min_fresh_prefill_tokens:
                fresh.append(FreshPrefill(total, count))
            else:
                grouped.append(index)
            total += count
        # One tensor for every integer vector of the step, then views of it: building a
        # tensor costs more than the few hundred integers it holds.
        flat = positions + slots
        rows = None
        if tables:
            num_rows = len(kernel_tokens)
            width = max(len(t) for t in tables)
            flat += kernel_tokens
            flat += table_rows
            flat += lengths
            for t in tables:
                flat += t
                flat += [0] * (width - len(t))
            packed = int64_tensor(flat, device)
            base = 2 * total
            rows = KernelRows(
                rows=packed[base : base + num_rows],
                block_tables=packed[base + 3 * num_rows :].view(len(tables), width),
                table_rows=packed[base + num_rows : base + 2 * num_rows],
                lengths=packed[base + 2 * num_rows : base + 3 * num_rows],
                identity=num_rows == total,
            )
        else:
            packed = int64_tensor(flat, device)
        on_cpu = device.type == "cpu"
        max_keys = total + 2**62
        if key_bytes and on_cpu:
            max_keys = _MAX_GROUP_GATHER_BYTES // (2 * key_bytes)
        padding = _MAX_PADDING_FACTOR if on_cpu else _MAX_PADDING_FACTOR_GPU
        groups = tuple(
            _build_group(
                chunks,
                group,
                offsets=offsets,
                block_size=block_size,
                total_tokens=total,
                device=device,
                dtype=dtype,
            )
            for group in _partition(chunks, grouped, max_keys, padding)
        )
        return cls(
            positions=packed[:total],
            slot_mapping=packed[total : 2 * total],
            groups=groups,
            num_tokens=total,
            max_group_blocks=max((g.block_ids.numel() for g in groups), default=0),
            kernel_rows=rows,
            fresh_prefills=tuple(fresh),
        )


def int64_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """A 1-D int64 tensor of `values`: through an `array` buffer, ~3x faster than
    `torch.tensor` on a list of ints (which checks every element's type). The tensor keeps the
    buffer alive."""
    if not values:
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64).to(device)


def _partition(
    chunks: Sequence[SequenceChunk], members: Sequence[int], max_keys: int, max_padding: float
) -> list[list[int]]:
    """Split sequence indices (`members`) into groups whose padded attention stays within
    `max_padding` times the useful work and whose padded keys stay within `max_keys`."""
    if not members:
        return []
    order = sorted(members, key=lambda i: (chunks[i].num_tokens, chunks[i].start))
    groups: list[list[int]] = []
    current: list[int] = []
    useful = 0
    max_q = 0
    max_kv = 0
    for i in order:
        q = chunks[i].num_tokens
        kv = chunks[i].start + q
        new_useful = useful + q * kv
        new_padded = (len(current) + 1) * max(max_q, q) * max(max_kv, kv)
        too_big = (len(current) + 1) * max(max_kv, kv) > max_keys
        if current and (new_padded > max_padding * new_useful or too_big):
            groups.append(current)
            current, useful, max_q, max_kv = [], 0, 0, 0
            new_useful = q * kv
        current.append(i)
        useful = new_useful
        max_q = max(max_q, q)
        max_kv = max(max_kv, kv)
    groups.append(current)
    # Keep flat (scheduling) order inside each group so a one-group step needs no scatter.
    return [sorted(g) for g in groups]


def _build_group(
    chunks: Sequence[SequenceChunk],
    members: list[int],
    *,
    offsets: list[int],
    block_size: int,
    total_tokens: int,
    device: torch.device,
    dtype: torch.dtype,
) -> AttentionGroup:
    max_q = max(chunks[i].num_tokens for i in members)
    max_kv = max(chunks[i].start + chunks[i].num_tokens for i in members)
    num_group_blocks = -(-max_kv // block_size)
    block_ids: list[int] = []
    for i in members:
        table = chunks[i].block_table
        used = min(len(table), num_group_blocks)
        block_ids.extend(table[:used])
        block_ids.extend([0] * (num_group_blocks - used))
    key_positions = torch.arange(num_group_blocks * block_size)
    # The whole step, no padding, in flat order (members are sorted): rows need no scatter.
    is_identity = len(members) == len(chunks) and max_q * len(members) == total_tokens
    if max_q == 1:
        # Decodes: one query per sequence at position `start`, no padded queries.
        flat = [offsets[i] for i in members]
        ends = torch.tensor([chunks[i].start for i in members], dtype=torch.int64)
        visible = (key_positions[None, :] <= ends[:, None])[:, None, None, :]
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
        flat_tokens = torch.tensor(flat, dtype=torch.int64)
        return AttentionGroup(
            token_index=flat_tokens.view(-1, 1).to(device),
            block_ids=int64_tensor(block_ids, device),
            mask=mask.to(device),
            valid_rows=torch.arange(len(members)).to(device),
            flat_tokens=flat_tokens.to(device),
            is_identity=is_identity,
            all_valid=True,
        )
    q_arange = torch.arange(max_q)
    counts = torch.tensor([chunks[i].num_tokens for i in members], dtype=torch.int64)
    starts = torch.tensor([chunks[i].start for i in members], dtype=torch.int64)
    group_offsets = torch.tensor([offsets[i] for i in members], dtype=torch.int64)
    valid = q_arange[None, :] < counts[:, None]  # [B, max_q]
    token_index = torch.where(valid, group_offsets[:, None] + q_arange[None, :], 0)
    q_positions = torch.where(valid, starts[:, None] + q_arange[None, :], 0)
    visible = (key_positions[None, None, :] <= q_positions[:, :, None]).unsqueeze(1)
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
    valid_rows = valid.reshape(-1).nonzero().squeeze(1)
    flat_tokens = token_index.reshape(-1)[valid_rows]
    return AttentionGroup(
        token_index=token_index.to(device),
        block_ids=int64_tensor(block_ids, device),
        mask=mask.to(device),
        valid_rows=valid_rows.to(device),
        flat_tokens=flat_tokens.to(device),
        is_identity=is_identity,
        all_valid=bool(valid.all()),
    )


def _resident(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device).zero_()


class GatherWorkspace:
    """Reused buffers that each group's gathered key and value blocks are copied into.

    A fresh multi-megabyte tensor per gather comes from mmap and page-faults on first touch
    (measured: 3-10x slower gathers on CPU); these stay resident and grow only when a step
    gathers more blocks than any before it."""

    def __init__(self, block_elements: int, dtype: torch.dtype, device: torch.device) -> None:
        self._block_elements = block_elements
        self._dtype = dtype
        self._device = device
        self.keys = torch.empty(0)
        self.values = torch.empty(0)

    def reserve(self, num_blocks: int) -> None:
        if num_blocks <= self.keys.shape[0]:
            return
        rows = max(num_blocks, 2 * self.keys.shape[0])
        shape = (rows, self._block_elements)
        self.keys = _resident(shape, self._dtype, self._device)
        self.values = _resident(shape, self._dtype, self._device)


class PagedKvCache:
    """Per-layer key and value block pools; block ids are the block manager's."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise KvCacheError(
                f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}"
            )
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        # empty + zero_ rather than zeros: zeros may come from calloc, whose untouched pages
        # fault in lazily and made every later gather ~3x slower on CPU.
        self.keys = [_resident(shape, dtype, device) for _ in range(num_layers)]
        self.values = [_resident(shape, dtype, device) for _ in range(num_layers)]
        self.workspace = GatherWorkspace(block_size * num_kv_heads * head_dim, dtype, device)
        # write_blocks' staging buffer on the CPU, [blocks, block_bytes] of uint8 (lazy).
        self._staging: torch.Tensor | None = None

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        element_bytes = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element_bytes

    # ---------------------------------------------------------------- whole blocks as bytes
    # A block's bytes (KV transfer between engines): for each layer, its K block then its V
    # block, each `[block_size, num_kv_heads, head_dim]` in the cache's dtype, native byte
    # order; `layout` names all of it, so equal layouts mean interchangeable bytes.

    @property
    def layout(self) -> str:
        _, block_size, num_kv_heads, head_dim = self.keys[0].shape
        dtype = str(self.keys[0].dtype).removeprefix("torch.")
        return (
            f"kvplane-torch-v1:{dtype}:layers={len(self.keys)}:block={block_size}:"
            f"kv_heads={num_kv_heads}:head_dim={head_dim}:layer(k,v)"
        )

    @property
    def block_bytes(self) -> int:
        return 2 * len(self.keys) * self.keys[0][0].numel() * self.keys[0].element_size()

    def read_blocks(self, block_ids: Sequence[int]) -> bytes:
        """A copy of the blocks' K and V as one bytes string (moved to the CPU), each block's
        `block_bytes` in turn. One string for all of them: a `tobytes` per block cost more
        than the gather, and the transfer sends a run of blocks per message anyway."""
        if not block_ids:
            return b""
        self._check_ids(block_ids)
        with torch.inference_mode():
            ids = torch.tensor(list(block_ids), dtype=torch.int64, device=self.keys[0].device)
            # [blocks, layers, 2, block_size, kv_heads, head_dim]
            data = torch.stack(
                [
                    torch.stack((k.index_select(0, ids), v.index_select(0, ids)), dim=1)
                    for k, v in zip(self.keys, self.values, strict=True)
                ],
                dim=1,
            )
            return data.cpu().contiguous().view(torch.uint8).numpy().tobytes()

    def write_blocks(self, block_ids: Sequence[int], blocks: Sequence[bytes | memoryview]) -> None:
        """Overwrite the blocks with bytes as `read_blocks` gives them, one buffer per block
        (its own bytes or a view into a larger message); checks every count and size before
        writing anything (ValueError).

        The blocks are copied into a resident staging buffer, `_STAGING_BYTES` at a time, and
        scattered from there, a dozen or so `index_copy_` per batch: one scatter per block cost
        ~4x more, and joining the blocks into one fresh buffer page-faulted through all of
        it (measured: 65 ms for 191 blocks of 256 KiB; 12 ms staged). The staging buffer is
        allocated on the first write (an engine that never imports KV never pays for it)."""
        if len(blocks) != len(block_ids):
            raise ValueError(f"{len(blocks)} blocks of data for {len(block_ids)} block ids")
        if not block_ids:
            return
        self._check_ids(block_ids)
        expected = self.block_bytes
        sizes = {memoryview(b).nbytes for b in blocks}
        if sizes != {expected}:
            raise ValueError(f"a KV block is {expected} bytes here, got sizes {sorted(sizes)}")
        if self._staging is None:
            num_staged = max(1, min(self.num_blocks, _STAGING_BYTES // expected))
            self._staging = _resident((num_staged, expected), torch.uint8, torch.device("cpu"))
        staging = self._staging
        staged = staging.numpy().data.cast("B")  # a view of the tensor's memory
        key = self.keys[0]
        with torch.inference_mode():
            for start in range(0, len(block_ids), len(staging)):
                batch = blocks[start : start + len(staging)]
                for row, block in enumerate(batch):
                    staged[row * expected : (row + 1) * expected] = block
                data = staging[: len(batch)].view(key.dtype)
                data = data.reshape(len(batch), len(self.keys), 2, *key.shape[1:]).to(key.device)
                ids = torch.tensor(
                    list(block_ids[start : start + len(batch)]),
                    dtype=torch.int64,
                    device=key.device,
                )
                for layer, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
                    k.index_copy_(0, ids, data[:, layer, 0])
                    v.index_copy_(0, ids, data[:, layer, 1])

    def _check_ids(self, block_ids: Sequence[int]) -> None:
        if min(block_ids) < 0 or max(block_ids) >= self.num_blocks:
            raise ValueError(f"a block id is outside [0, {self.num_blocks})")


def write_paged(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    metadata: AttentionMetadata,
) -> None:
    """Write the step's keys and values [T, KVH, D] into their slots of one layer's cache."""
    num_kv_heads, head_dim = key_cache.shape[2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, value)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    *,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    workspace: GatherWorkspace | None = None,
    kernel: NativeKernels | None = None,
    stored: bool = False,
) -> torch.Tensor:
    """query [T, H, D], key/value [T, KVH, D] (the step's own) -> attention output [T, H, D].

    Writes key/value into the caches first (unless `stored`: the caller already has, e.g. with
    `native.NativeKernels.rope_store`), so each token also attends to itself and to the
    earlier tokens of its own chunk. With `stored`, key/value may be None when the metadata
    has no `fresh_prefills` (the only readers of the step's own rows; a decode step then
    builds no views for them). With a `workspace` (reserved for
    `metadata.max_group_blocks`), gathered blocks are copied into it instead of new tensors.
    Metadata built with `kernel_rows` is computed by `kernel` alone, in place; its
    `fresh_prefills` read only the step's own rows of key/value.
    """
    num_kv_heads, head_dim = key_cache.shape[2:]
    if not stored:
        if key is None or value is None:
            raise KvCacheError("the step's own keys and values are needed to write them")
        write_paged(key_cache, value_cache, key, value, metadata)
    output: torch.Tensor | None = None
    kernel_rows = metadata.kernel_rows
    if kernel_rows is not None:
        if kernel is None:
            raise KvCacheError("metadata built with kernel_rows needs the native kernel")
        # The kernel takes strided query rows: the whole step is read in place.
        q = query if kernel_rows.identity else query.index_select(0, kernel_rows.rows)
        computed = kernel.paged_attention(
            q,
            key_cache,
            value_cache,
            block_tables=kernel_rows.block_tables,
            table_rows=kernel_rows.table_rows,
            lengths=kernel_rows.lengths,
            scale=scale,
        )
        if kernel_rows.identity:
            return computed
        output = query.new_empty(query.shape)
        output.index_copy_(0, kernel_rows.rows, computed)
    if metadata.fresh_prefills:
        if key is None or value is None:
            raise KvCacheError("a fresh prefill attends to the step's own keys and values")
        for fresh in metadata.fresh_prefills:
            rows = _fresh_prefill_attention(query, key, value, fresh, scale)
            if fresh.num_tokens == metadata.num_tokens:
                return rows
            if output is None:
                output = query.new_empty(query.shape)
            output[fresh.first : fresh.first + fresh.num_tokens] = rows
    num_heads = query.shape[1]
    key_rows = key_cache.view(key_cache.shape[0], -1)
    value_rows = value_cache.view(value_cache.shape[0], -1)
    for group in metadata.groups:
        batch, max_q = group.token_index.shape
        context_shape = (batch, -1, num_kv_heads, head_dim)
        q = query.index_select(0, group.token_index.view(-1)).view(batch, max_q, num_heads, -1)
        q = q.transpose(1, 2)  # [B, H, max_q, D]
        # Gather whole blocks as rows of a 2-D view: a plain row copy, ~4x faster than
        # index_select on the 4-D tensor.
        if workspace is None:
            k_rows = key_rows.index_select(0, group.block_ids)
            v_rows = value_rows.index_select(0, group.block_ids)
        else:
            n = group.block_ids.shape[0]
            k_rows = torch.index_select(key_rows, 0, group.block_ids, out=workspace.keys[:n])
            v_rows = torch.index_select(value_rows, 0, group.block_ids, out=workspace.values[:n])
        k = k_rows.view(context_shape).transpose(1, 2)
        v = v_rows.view(context_shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=group.mask, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
        rows = out.transpose(1, 2).reshape(batch * max_q, num_heads, head_dim)
        if group.is_identity and output is None:
            return rows
        if output is None:
            output = query.new_empty(query.shape)
        if not group.all_valid:
            rows = rows.index_select(0, group.valid_rows)
        output.index_copy_(0, group.flat_tokens, rows)
    assert output is not None  # metadata has kernel rows or at least one group
    return output


def _fresh_prefill_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, fresh: FreshPrefill, scale: float
) -> torch.Tensor:
    """The chunk's rows [N, H, D] of the attention output: causal SDPA over its own rows of the
    step's queries, keys and values, read in place through strided views."""
    rows = slice(fresh.first, fresh.first + fresh.num_tokens)
    q, k, v = (x[rows].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out[0].transpose(0, 1)
