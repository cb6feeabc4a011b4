"""The embedded `memory` index backend: `indexer.backend.IndexBackend` over the pure core.

Every call runs the core synchronously inside the event loop, so each `apply` is atomic to
readers by construction (no await between its actions). Validation of wire rules happens in
the core's `apply` too (the adapters validate first; a bad batch changes nothing either way).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from indexer.backend import IndexStats, PrefixResult, TokenPrefixMatch, WorkerPlacements
from indexer.batch import Batch, BlockKey
from indexer.index import PrefixIndex


class MemoryBackend:
    """In-process index; `index` is the core, exposed for views the interface lacks."""

    name = "memory"

    def __init__(self, index: PrefixIndex | None = None) -> None:
        self.index = index if index is not None else PrefixIndex()

    async def apply(self, batch: Batch) -> None:
        self.index.apply(batch)

    async def match(self, hashes: Sequence[BlockKey], count_as_hit: bool) -> list[WorkerPlacements]:
        return self.index.match(hashes, count_as_hit)

    async def match_prefix(self, hashes: Sequence[BlockKey], max_blocks: int) -> PrefixResult:
        return self.index.match_prefix(hashes, max_blocks)

    async def match_prefix_by_tier(
        self, hashes: Sequence[BlockKey], max_blocks: int
    ) -> list[TokenPrefixMatch]:
        return self.index.match_prefix_by_tier(hashes, max_blocks)

    async def hit_counts(self, hashes: Sequence[BlockKey]) -> list[tuple[BlockKey, int]]:
        return self.index.hit_counts(hashes)

    async def remove_worker(self, worker_id: str) -> int:
        return self.index.remove_worker(worker_id)

    async def snapshot(self, worker_id: str | None = None) -> AsyncIterator[Batch]:
        # Materialised first: a consumer awaiting between batches must see one consistent cut.
        for batch in list(self.index.snapshot(worker_id)):
            yield batch

    async def stats(self) -> IndexStats:
        return self.index.stats(self.name)

    async def close(self) -> None:
        return None
