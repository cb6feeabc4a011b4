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
sequence's blocks pays for, and that gather is the memory-bound part of a CPU decode step.
Padded query rows are given position 0 so that their softmax is never empty; their outputs are
discarded. Invariant: every slot written in a step belongs to a block the caller owns, and a
block table covers every position of its sequence up to the end of the step's chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.torch_runner.errors import KvCacheError

# A group is split when its padded score matrix exceeds this multiple of the useful one.
_MAX_PADDING_FACTOR = 1.5


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


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    groups: tuple[AttentionGroup, ...]
    num_tokens: int

    @classmethod
    def build(
        cls,
        chunks: Sequence[SequenceChunk],
        *,
        block_size: int,
        num_blocks: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> AttentionMetadata:
        if not chunks:
            raise KvCacheError("a step must compute at least one sequence")
        starts: list[int] = []
        offsets: list[int] = []
        total = 0
        for chunk in chunks:
            if chunk.num_tokens <= 0 or chunk.start < 0:
                raise KvCacheError(f"bad chunk: start {chunk.start}, num_tokens {chunk.num_tokens}")
            end = chunk.start + chunk.num_tokens
            if len(chunk.block_table) * block_size < end:
                raise KvCacheError(
                    f"block table of {len(chunk.block_table)} blocks cannot hold {end} tokens"
                )
            starts.append(chunk.start)
            offsets.append(total)
            total += chunk.num_tokens
        max_table = max(len(c.block_table) for c in chunks)
        tables_list = [list(c.block_table) + [0] * (max_table - len(c.block_table)) for c in chunks]
        tables = torch.tensor(tables_list, dtype=torch.int64)
        if int(tables.min()) < 0 or int(tables.max()) >= num_blocks:
            raise KvCacheError(f"a block table refers to a block outside [0, {num_blocks})")
        counts = torch.tensor([c.num_tokens for c in chunks], dtype=torch.int64)
        seq_of_token = torch.repeat_interleave(torch.arange(len(chunks)), counts)
        offset_of_token = torch.tensor(offsets, dtype=torch.int64)[seq_of_token]
        start_of_token = torch.tensor(starts, dtype=torch.int64)[seq_of_token]
        positions = start_of_token + (torch.arange(total) - offset_of_token)
        blocks = tables[seq_of_token, positions // block_size]
        slot_mapping = blocks * block_size + positions % block_size
        groups = tuple(
            _build_group(
                chunks,
                members,
                offsets=offsets,
                tables=tables,
                block_size=block_size,
                total_tokens=total,
                device=device,
                dtype=dtype,
            )
            for members in _partition(chunks)
        )
        return cls(
            positions=positions.to(device),
            slot_mapping=slot_mapping.to(device),
            groups=groups,
            num_tokens=total,
        )


def _partition(chunks: Sequence[SequenceChunk]) -> list[list[int]]:
    """Split sequence indices into groups whose padded attention stays near the useful work."""
    order = sorted(range(len(chunks)), key=lambda i: (chunks[i].num_tokens, chunks[i].start))
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
        if current and new_padded > _MAX_PADDING_FACTOR * new_useful:
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
    tables: torch.Tensor,
    block_size: int,
    total_tokens: int,
    device: torch.device,
    dtype: torch.dtype,
) -> AttentionGroup:
    max_q = max(chunks[i].num_tokens for i in members)
    max_kv = max(chunks[i].start + chunks[i].num_tokens for i in members)
    num_group_blocks = -(-max_kv // block_size)
    q_arange = torch.arange(max_q)
    counts = torch.tensor([chunks[i].num_tokens for i in members], dtype=torch.int64)
    starts = torch.tensor([chunks[i].start for i in members], dtype=torch.int64)
    group_offsets = torch.tensor([offsets[i] for i in members], dtype=torch.int64)
    valid = q_arange[None, :] < counts[:, None]  # [B, max_q]
    token_index = torch.where(valid, group_offsets[:, None] + q_arange[None, :], 0)
    q_positions = torch.where(valid, starts[:, None] + q_arange[None, :], 0)
    key_positions = torch.arange(num_group_blocks * block_size)
    visible = (key_positions[None, None, :] <= q_positions[:, :, None]).unsqueeze(1)
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
    valid_rows = valid.reshape(-1).nonzero().squeeze(1)
    flat_tokens = token_index.reshape(-1)[valid_rows]
    # The whole step, no padding, in flat order (members are sorted): rows need no scatter.
    is_identity = len(members) == len(chunks) and max_q * len(members) == total_tokens
    return AttentionGroup(
        token_index=token_index.to(device),
        block_ids=tables[members, :num_group_blocks].reshape(-1).to(device),
        mask=mask.to(device),
        valid_rows=valid_rows.to(device),
        flat_tokens=flat_tokens.to(device),
        is_identity=is_identity,
    )


def _resident(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device).zero_()


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

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        element_bytes = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element_bytes


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """query [T, H, D], key/value [T, KVH, D] -> attention output [T, H, D].

    Writes key/value into the caches first, so each token also attends to itself and to the
    earlier tokens of its own chunk.
    """
    num_kv_heads, head_dim = key_cache.shape[2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, value)
    num_heads = query.shape[1]
    key_rows = key_cache.view(key_cache.shape[0], -1)
    value_rows = value_cache.view(value_cache.shape[0], -1)
    output: torch.Tensor | None = None
    for group in metadata.groups:
        batch, max_q = group.token_index.shape
        context_shape = (batch, -1, num_kv_heads, head_dim)
        q = query.index_select(0, group.token_index.view(-1)).view(batch, max_q, num_heads, -1)
        q = q.transpose(1, 2)  # [B, H, max_q, D]
        # Gather whole blocks as rows of a 2-D view: a plain row copy, ~4x faster than
        # index_select on the 4-D tensor.
        k = key_rows.index_select(0, group.block_ids).view(context_shape).transpose(1, 2)
        v = value_rows.index_select(0, group.block_ids).view(context_shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=group.mask, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
        rows = out.transpose(1, 2).reshape(batch * max_q, num_heads, head_dim)
        if group.is_identity:
            return rows
        if output is None:
            output = query.new_empty(query.shape)
        output.index_copy_(0, group.flat_tokens, rows.index_select(0, group.valid_rows))
    assert output is not None  # metadata always has at least one group
    return output
