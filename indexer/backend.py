"""The interface every index backend implements (`memory`, `redis`), and the result types.

Backends are async because the shared one does I/O; the embedded `memory` backend wraps the
pure core (`indexer.index`) and never awaits anything slow. One conformance suite
(tests/indexer/test_conformance.py) runs against every backend.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

from indexer.batch import Batch, BlockKey, Tier


@dataclass(frozen=True, slots=True)
class TierPlacements:
    """One worker's placements at one tier among the queried hashes (MatchExternalKv)."""

    tier: Tier
    hashes: tuple[BlockKey, ...]
    component_masks: tuple[int, ...]
    block_sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class WorkerPlacements:
    worker_id: str
    address: str
    by_tier: tuple[TierPlacements, ...]  # ascending by tier


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    worker_id: str
    worker_address: str
    matched_prefix_blocks: int


@dataclass(frozen=True, slots=True)
class PrefixResult:
    """MatchExternalKvPrefix: matches sorted by matched_prefix_blocks descending."""

    matches: tuple[PrefixMatch, ...]
    best_prefix_blocks: int
    blocks_read: int


@dataclass(frozen=True, slots=True)
class TierPrefix:
    tier: Tier
    matched_blocks: int
    matched_tokens: int


class TokenPrefixMatch(NamedTuple):
    """Per worker: leading blocks held contiguously on any servable tier (HBM or DRAM), per
    tier, and on any tier at all, disk (SSD) included: `any_tier_blocks` >= `matched_blocks`,
    the blocks past `matched_blocks` being the ones the worker would load from disk. A
    NamedTuple: a query makes one per worker holding its first block (hundreds on a large
    fleet), and a frozen dataclass costs a setattr call per field to make."""

    worker_id: str
    worker_address: str
    matched_blocks: int
    matched_tokens: int
    tiers: tuple[TierPrefix, ...]
    any_tier_blocks: int
    any_tier_tokens: int


@dataclass(frozen=True, slots=True)
class WorkerStats:
    worker_id: str
    worker_address: str
    num_blocks: int
    num_placements: int


@dataclass(frozen=True, slots=True)
class IndexStats:
    backend: str
    num_blocks: int
    num_placements: int
    workers: tuple[WorkerStats, ...]


class IndexBackend(Protocol):
    """The index as the services see it. Queries trust their adapters' checks; `apply`
    validates the batch (WIRE.md section 2, `indexer.validation`) before changing anything
    and is atomic to readers."""

    name: str

    async def apply(self, batch: Batch) -> None: ...

    async def match(
        self, hashes: Sequence[BlockKey], count_as_hit: bool
    ) -> list[WorkerPlacements]: ...

    async def match_prefix(self, hashes: Sequence[BlockKey], max_blocks: int) -> PrefixResult: ...

    async def match_prefix_by_tier(
        self, hashes: Sequence[BlockKey], max_blocks: int
    ) -> list[TokenPrefixMatch]:
        """kvplane's token-level view: per worker, the contiguous prefix on any servable tier,
        per tier, and on any tier with disk (tokens from the blocks' known sizes). Sorted by
        matched_blocks desc."""
        ...

    async def hit_counts(self, hashes: Sequence[BlockKey]) -> list[tuple[BlockKey, int]]: ...

    async def remove_worker(self, worker_id: str) -> int:
        """Drop every placement of `worker_id` (and the worker); returns placements removed."""
        ...

    def snapshot(self, worker_id: str | None = None) -> AsyncIterator[Batch]:
        """Parent-first batches that rebuild the index (or one worker) when applied.
        Implement it as an async generator (`async def` with `yield`); call it without await:
        `async for batch in backend.snapshot(): ...`."""
        ...

    async def stats(self) -> IndexStats: ...

    async def close(self) -> None: ...


@runtime_checkable
class ReachableIndex(Protocol):
    """An index outside the process (a shared Redis, a controller's remote indexer), which may
    not answer: a health check reads these, which ask it nothing."""

    @property
    def described(self) -> str:
        """The index as its errors name it: `Redis at HOST:PORT`, `remote index at HOST:PORT`."""
        ...

    @property
    def unavailable(self) -> str | None:
        """Why it does not answer now, one line naming it, from what its calls last found
        (None: it answers)."""
        ...


def index_answers(index: object) -> bool:
    """Whether `index` answers queries now, from what its client last found (no call): an
    index in the process (the memory backend; None, none yet) always does, a
    `ReachableIndex` while its `unavailable` is None."""
    return not isinstance(index, ReachableIndex) or index.unavailable is None
