"""The engine's KV event log: numbered batches in a bounded ring, snapshots, fan-out.

Every non-empty list of KV events the core records in one step becomes one batch with the
next sequence number. Numbering starts at a per-process base, by default the wall-clock time
in microseconds when the log is created, not at 1. The OpenEngine stream has no field that
names the publishing process, so a subscriber resumes after a broken stream with the last
number it applied + 1 without knowing whether the engine behind the same address restarted.
Were every process to count from 1, a restarted engine that had already published that many
batches would replay its own batches as the continuation of the old process's stream: the
old process's blocks would stay in the index and the new one's first batches would be lost.
With the base, a later process's numbers are all above an earlier one's (a process
publishes at most one batch per engine step, far fewer than one a microsecond; this holds
unless the wall clock steps back across the restart), so the old process's last + 1 is never
buffered by the new one and the subscriber gets a snapshot, whose number is not the one it
expects, and rebuilds. Numbers are at least 1, so
`SubscribeKvEventsRequest.start_sequence_number = 0` (the proto3 default) still means "no
replay". The ZMQ publisher numbers the same batches from 0 (seq - base), as vLLM does.

Subscriptions (`subscribe`) are checked before acceptance, so a bad request is a plain
error the servicer turns into a non-OK status:

- `include_snapshot`: first one batch that describes the whole cached set as of the latest
  sequence number N (AllBlocksCleared, then one BlockStored per cached block, parents before
  children), carrying sequence number N (base - 1 before the first batch); then live batches
  N+1, ...
- `start_sequence_number = S > 0` without a snapshot: replay S, S+1, ... from the ring, then
  live. S older than the ring (no longer covered) or beyond N+1 raises ReplayNotCoveredError;
  the client resubscribes with `include_snapshot`. With a snapshot, S is served from the ring
  when covered and otherwise the snapshot stands in for it.

A subscriber that falls behind the ring after acceptance ends with SubscriberOverrunError
(the servicer's terminal EngineError). The log also mirrors the cached set from the events
it carries, so a snapshot is always consistent with its sequence number without asking the
engine thread.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from engine.core.api import AllBlocksCleared, BlockKey, BlockRemoved, BlockStored, KvEvent, Medium
from kvplane.errors import KvplaneError


class ReplayNotCoveredError(KvplaneError):
    """The requested start sequence number is no longer (or not yet) in the buffer."""


class SubscriberOverrunError(KvplaneError):
    """A subscriber fell so far behind that batches it has not read left the buffer."""


@dataclass(frozen=True, slots=True)
class KvEventBatchRecord:
    sequence_number: int
    timestamp_unix_ns: int
    events: tuple[KvEvent, ...]


@dataclass(slots=True)
class _CachedBlock:
    parent_key: BlockKey | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: Medium
    lora_name: str | None
    extra_key: tuple[str, ...] | None
    copies: int = 1


class CachedBlockMirror:
    """The cached set implied by the events so far (a key may be live in several copies)."""

    def __init__(self) -> None:
        # Insertion-ordered: a parent stored before its child comes first.
        self._blocks: dict[BlockKey, _CachedBlock] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def apply(self, event: KvEvent) -> None:
        if isinstance(event, BlockStored):
            self._store(event)
        elif isinstance(event, BlockRemoved):
            for key in event.block_keys:
                block = self._blocks.get(key)
                if block is None:
                    continue
                block.copies -= 1
                if block.copies <= 0:
                    del self._blocks[key]
        elif isinstance(event, AllBlocksCleared):
            self._blocks.clear()

    def _store(self, event: BlockStored) -> None:
        parent = event.parent_key
        size = event.block_size
        for i, key in enumerate(event.block_keys):
            existing = self._blocks.get(key)
            if existing is not None:
                existing.copies += 1
            else:
                extra = event.extra_keys[i] if i < len(event.extra_keys) else None
                self._blocks[key] = _CachedBlock(
                    parent_key=parent,
                    token_ids=tuple(event.token_ids[i * size : (i + 1) * size]),
                    block_size=size,
                    medium=event.medium,
                    lora_name=event.lora_name,
                    extra_key=extra,
                )
            parent = key

    def snapshot(self) -> list[KvEvent]:
        """AllBlocksCleared, then one BlockStored per cached block, parents before children."""
        events: list[KvEvent] = [AllBlocksCleared()]
        emitted: set[BlockKey] = set()
        for key in self._blocks:
            # Walk up to the first ancestor not yet emitted, then emit downwards.
            chain: list[BlockKey] = []
            cursor: BlockKey | None = key
            while (
                cursor is not None
                and cursor not in emitted
                and cursor in self._blocks
                and cursor not in chain  # keys are chained hashes; never loop on a bad one
            ):
                chain.append(cursor)
                cursor = self._blocks[cursor].parent_key
            for chained in reversed(chain):
                emitted.add(chained)
                block = self._blocks[chained]
                events.append(
                    BlockStored(
                        block_keys=(chained,),
                        parent_key=block.parent_key,
                        token_ids=block.token_ids,
                        block_size=block.block_size,
                        medium=block.medium,
                        lora_name=block.lora_name,
                        extra_keys=(block.extra_key,),
                    )
                )
        return events


BatchListener = Callable[[KvEventBatchRecord], None]

# Sequence numbers are uint64 on the wire; a base below 2**63 leaves room for any process.
_MAX_FIRST_SEQUENCE_NUMBER = 2**63


class KvEventLog:
    """Numbers batches, keeps the last `buffer_steps` of them, and fans them out."""

    def __init__(
        self,
        buffer_steps: int,
        clock_ns: Callable[[], int] = time.time_ns,
        *,
        first_sequence_number: int | None = None,
    ) -> None:
        """`first_sequence_number`: the first batch's number; None: the wall-clock time in
        microseconds now (see the module docstring)."""
        if buffer_steps < 1:
            raise ValueError("buffer_steps must be >= 1")
        if first_sequence_number is None:
            first_sequence_number = time.time_ns() // 1000
        if not 1 <= first_sequence_number < _MAX_FIRST_SEQUENCE_NUMBER:
            raise ValueError(
                f"first_sequence_number must be in 1..{_MAX_FIRST_SEQUENCE_NUMBER - 1}"
            )
        self._ring: deque[KvEventBatchRecord] = deque(maxlen=buffer_steps)
        self._clock_ns = clock_ns
        self.first_sequence_number = first_sequence_number
        self._last_seq = first_sequence_number - 1
        self._mirror = CachedBlockMirror()
        self._listeners: list[BatchListener] = []
        self._appended = asyncio.Event()
        self._closed = False
        self.buffer_steps = buffer_steps

    @property
    def last_sequence_number(self) -> int:
        """The newest batch's number; first_sequence_number - 1 before the first batch."""
        return self._last_seq

    @property
    def oldest_sequence_number(self) -> int:
        """The oldest batch still buffered; last + 1 when the buffer is empty."""
        return self._ring[0].sequence_number if self._ring else self._last_seq + 1

    @property
    def num_cached_blocks(self) -> int:
        return len(self._mirror)

    def add_listener(self, listener: BatchListener) -> None:
        """Call `listener` synchronously with every new batch (it must not block)."""
        self._listeners.append(listener)

    def append(self, events: Iterable[KvEvent]) -> KvEventBatchRecord | None:
        """Record one step's events as a batch (nothing for an empty step)."""
        recorded = tuple(events)
        if not recorded or self._closed:
            return None
        self._last_seq += 1
        batch = KvEventBatchRecord(self._last_seq, self._clock_ns(), recorded)
        for event in recorded:
            self._mirror.apply(event)
        self._ring.append(batch)
        for listener in self._listeners:
            listener(batch)
        appended, self._appended = self._appended, asyncio.Event()
        appended.set()
        return batch

    def snapshot(self) -> KvEventBatchRecord:
        """The cached set as one batch numbered with the latest sequence number (base - 1
        before the first batch)."""
        return KvEventBatchRecord(self._last_seq, self._clock_ns(), tuple(self._mirror.snapshot()))

    def close(self) -> None:
        """End every subscription (after what it has already been given)."""
        self._closed = True
        self._appended.set()

    def subscribe(
        self, *, start_sequence_number: int = 0, include_snapshot: bool = False
    ) -> AsyncIterator[KvEventBatchRecord]:
        """Check the request now (raising ReplayNotCoveredError) and return the stream."""
        first: list[KvEventBatchRecord] = []
        start = start_sequence_number
        covered = self.oldest_sequence_number <= start <= self._last_seq + 1
        if start > 0 and covered:
            next_seq = start
        elif include_snapshot:
            first.append(self.snapshot())
            next_seq = self._last_seq + 1
        elif start > 0:
            raise ReplayNotCoveredError(
                f"start_sequence_number {start} is not buffered (buffered: "
                f"{self.oldest_sequence_number}..{self._last_seq}); "
                "resubscribe with include_snapshot"
            )
        else:
            next_seq = self._last_seq + 1
        return self._stream(first, next_seq)

    async def _stream(
        self, first: list[KvEventBatchRecord], next_seq: int
    ) -> AsyncIterator[KvEventBatchRecord]:
        for batch in first:
            yield batch
        while True:
            if next_seq <= self._last_seq:
                oldest = self.oldest_sequence_number
                if next_seq < oldest:
                    raise SubscriberOverrunError(
                        f"subscriber fell behind: batch {next_seq} left the buffer "
                        f"(oldest now {oldest}); resubscribe with include_snapshot"
                    )
                batch = self._ring[next_seq - oldest]
                next_seq += 1
                yield batch
                continue
            if self._closed:
                return
            await self._appended.wait()
