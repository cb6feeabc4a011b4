"""`PagedKvCache.read_blocks` / `write_blocks`: whole blocks as bytes (KV transfer), through
the staging buffer, in batches, from views into larger messages."""

from __future__ import annotations

import pytest
import torch

from engine.torch_runner import attention
from engine.torch_runner.attention import PagedKvCache


def _cache() -> PagedKvCache:
    return PagedKvCache(
        num_layers=3,
        num_blocks=16,
        block_size=4,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def test_blocks_written_from_views_in_several_staged_batches_read_back_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source, target = _cache(), _cache()
    generator = torch.Generator().manual_seed(0)
    for tensor in (*source.keys, *source.values):
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    read_ids, write_ids = [9, 2, 3, 14, 0], [1, 7, 8, 4, 12]
    data = source.read_blocks(read_ids)
    assert len(data) == len(read_ids) * source.block_bytes
    # A staging buffer of two blocks: three batches. The blocks are views into one message.
    monkeypatch.setattr(attention, "_STAGING_BYTES", 2 * source.block_bytes)
    view, size = memoryview(data), source.block_bytes
    target.write_blocks(write_ids, [view[i * size : (i + 1) * size] for i in range(5)])
    assert target.read_blocks(write_ids) == data
    for layer in range(3):
        assert torch.equal(target.keys[layer][write_ids], source.keys[layer][read_ids])
        assert torch.equal(target.values[layer][write_ids], source.values[layer][read_ids])
    untouched = [i for i in range(16) if i not in write_ids]
    assert not target.keys[0][untouched].any()


def test_a_wrong_count_or_size_writes_nothing() -> None:
    cache = _cache()
    block = bytes(range(256)) * (cache.block_bytes // 256)
    with pytest.raises(ValueError, match="2 blocks of data for 1 block ids"):
        cache.write_blocks([3], [block, block])
    with pytest.raises(ValueError, match="got sizes"):
        cache.write_blocks([3, 4], [block, block[:-4]])
    assert cache.read_blocks([3, 4]) == bytes(2 * cache.block_bytes)
