"""Everything a client can read from an index backend, in one comparable value: the
differential tests compare the Redis backend's answers with the memory backend's through it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from indexer.backend import IndexBackend
from indexer.batch import ActionType
from indexer.memory_backend import MemoryBackend


async def worker_keys(backend: IndexBackend, worker_id: str) -> set[int]:
    """The block keys the index places on the worker (at any tier)."""
    keys: set[int] = set()
    async for batch in backend.snapshot(worker_id):
        for action in batch.actions:
            if action.type is ActionType.REPORT:
                keys.update(action.hashes)
    return keys


async def observe(backend: IndexBackend, queries: Sequence[Sequence[int]]) -> list[object]:
    """Stats (without the backend's name), every query kind for each of `queries`, and what
    the snapshot rebuilds."""
    seen: list[object] = [dataclasses.replace(await backend.stats(), backend="-")]
    for hashes in queries:
        seen.append(await backend.match(hashes, False))
        for max_blocks in (0, 2):
            seen.append(await backend.match_prefix(hashes, max_blocks))
            seen.append(await backend.match_prefix_by_tier(hashes, max_blocks))
        seen.append(await backend.hit_counts(hashes))
    # Snapshots may order independent chains differently: compare what they rebuild.
    rebuilt = MemoryBackend()
    async for batch in backend.snapshot():
        await rebuilt.apply(batch)
    index = rebuilt.index
    seen.append(
        (
            list(index.placements()),
            [(p.key, index.block_size(p.key)) for p in index.placements()],
            [(w, index.worker_info(w)) for w in index.worker_ids()],
        )
    )
    return seen
