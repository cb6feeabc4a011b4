"""Multimodal items of a prompt and the blocks they fall in.

A multimodal item (an image, an audio clip) occupies a run of placeholder tokens in the prompt;
every placeholder looks the same, so a block's tokens alone cannot tell two images apart. Both
key spaces therefore fold the ids of the items overlapping a block into that block's key:
kvplane's canonical keys (`indexer.keys`, the ids) and vLLM's own hashes (`indexer.vllm_hash`,
`(id, item offset - block start)` pairs, the offset negative when the item began in an earlier
block). This module computes that overlap once for both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class MultimodalItem(NamedTuple):
    """An item's id and its placeholder token range `[offset, offset + length)`."""

    id: str
    offset: int
    length: int


# Per block: (item id, item offset relative to the block's first token) for each item that
# overlaps the block, in prompt order; None when no item does.
BlockItems = list[tuple[tuple[str, int], ...] | None]


def block_items(items: Sequence[MultimodalItem], num_blocks: int, block_size: int) -> BlockItems:
    """Which items overlap each of the first `num_blocks` blocks. Raises ValueError for an
    empty item, a negative offset, or items out of prompt order."""
    previous_offset = 0
    for item in items:
        if item.length <= 0 or item.offset < 0:
            raise ValueError(f"multimodal item {item.id!r}: needs offset >= 0 and length > 0")
        if item.offset < previous_offset:
            raise ValueError("multimodal items must be in prompt order (ascending offset)")
        previous_offset = item.offset
    out: BlockItems = []
    for i in range(num_blocks):
        start, end = i * block_size, (i + 1) * block_size
        overlapping = tuple(
            (item.id, item.offset - start)
            for item in items
            if item.offset < end and item.offset + item.length > start
        )
        out.append(overlapping or None)
    return out


def block_item_ids(per_block: BlockItems) -> list[list[str] | None]:
    """The ids alone (the canonical keys' form)."""
    return [None if b is None else [item_id for item_id, _ in b] for b in per_block]
