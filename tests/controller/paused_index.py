"""The embedded index with one call held on demand: `pause(name)` makes the next call of
`match_prefix_by_tier` or `remove_worker` say `paused` and wait for `resume`. It pins the time
a shared or remote index takes to answer, so that a change of the fleet lands in it in every
run, not only on a slow one."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Literal

from indexer.backend import TokenPrefixMatch
from indexer.batch import BlockKey
from indexer.memory_backend import MemoryBackend

PausableCall = Literal["match_prefix_by_tier", "remove_worker"]


class PausedIndex(MemoryBackend):
    def __init__(self) -> None:
        super().__init__()
        self.paused = asyncio.Event()
        self.resume = asyncio.Event()
        self._pausing: PausableCall | None = None

    def pause(self, call: PausableCall) -> None:
        self._pausing = call

    async def _hold(self, call: PausableCall) -> None:
        if self._pausing == call:
            self._pausing = None
            self.paused.set()
            await self.resume.wait()

    async def match_prefix_by_tier(
        self, hashes: Sequence[BlockKey], max_blocks: int
    ) -> list[TokenPrefixMatch]:
        await self._hold("match_prefix_by_tier")
        return await super().match_prefix_by_tier(hashes, max_blocks)

    async def remove_worker(self, worker_id: str) -> int:
        await self._hold("remove_worker")
        return await super().remove_worker(worker_id)
