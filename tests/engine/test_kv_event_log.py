"""The KV event log: numbering, the bounded ring, snapshots, replay and overrun."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.api import AllBlocksCleared, BlockKey, BlockRemoved, BlockStored, KvEvent
from engine.server.kv_event_log import (
    CachedBlockMirror,
    KvEventBatchRecord,
    KvEventLog,
    ReplayNotCoveredError,
    SubscriberOverrunError,
)


def _chain(keys: list[int], parent: int | None = None) -> BlockStored:
    return BlockStored(
        block_keys=tuple(BlockKey(k) for k in keys),
        parent_key=None if parent is None else BlockKey(parent),
        token_ids=tuple(t for k in keys for t in (k, k)),
        block_size=2,
    )


async def _take(stream: AsyncIterator[KvEventBatchRecord], n: int) -> list[KvEventBatchRecord]:
    out = []
    for _ in range(n):
        out.append(await asyncio.wait_for(anext(stream), timeout=5))
    return out


def test_numbers_batches_from_the_base_and_skips_empty_steps() -> None:
    log = KvEventLog(buffer_steps=4, first_sequence_number=1000)
    assert log.first_sequence_number == 1000
    assert log.last_sequence_number == 999
    assert log.oldest_sequence_number == 1000  # empty ring: last + 1
    assert log.append([]) is None
    first = log.append([_chain([1])])
    assert first is not None and first.sequence_number == 1000
    second = log.append([_chain([2], parent=1)])
    assert second is not None and second.sequence_number == 1001
    assert (log.oldest_sequence_number, log.last_sequence_number) == (1000, 1001)


def test_the_default_base_is_the_wall_clock_in_microseconds() -> None:
    before = time.time_ns() // 1000
    log = KvEventLog(buffer_steps=4)
    after = time.time_ns() // 1000
    assert before <= log.first_sequence_number <= after
    assert log.last_sequence_number == log.first_sequence_number - 1
    batch = log.append([_chain([1])])
    assert batch is not None and batch.sequence_number == log.first_sequence_number


def test_a_base_below_one_is_refused() -> None:
    # 0 is the proto3 default of start_sequence_number: "no replay", never a batch.
    with pytest.raises(ValueError, match="first_sequence_number"):
        KvEventLog(buffer_steps=4, first_sequence_number=0)
    with pytest.raises(ValueError, match="first_sequence_number"):
        KvEventLog(buffer_steps=4, first_sequence_number=2**63)


async def test_a_snapshot_before_the_first_batch_is_numbered_base_minus_one() -> None:
    log = KvEventLog(buffer_steps=4, first_sequence_number=50)
    stream = log.subscribe(include_snapshot=True)
    (snap,) = await _take(stream, 1)
    assert snap.sequence_number == 49 and snap.events == (AllBlocksCleared(),)
    log.append([_chain([1])])
    (live,) = await _take(stream, 1)
    assert live.sequence_number == 50


async def test_replay_from_a_buffered_sequence_then_live() -> None:
    log = KvEventLog(buffer_steps=4, first_sequence_number=1)
    for k in range(1, 4):
        log.append([_chain([k])])
    stream = log.subscribe(start_sequence_number=2)
    got = await _take(stream, 2)
    assert [b.sequence_number for b in got] == [2, 3]
    log.append([BlockRemoved(block_keys=(BlockKey(1),))])
    (live,) = await _take(stream, 1)
    assert live.sequence_number == 4


async def test_start_outside_the_buffer_is_refused_before_acceptance() -> None:
    log = KvEventLog(buffer_steps=2, first_sequence_number=101)
    for k in range(1, 6):
        log.append([_chain([k])])
    with pytest.raises(ReplayNotCoveredError):
        log.subscribe(start_sequence_number=102)  # evicted: oldest is 104
    with pytest.raises(ReplayNotCoveredError):
        log.subscribe(start_sequence_number=2)  # below the base: another process's number
    with pytest.raises(ReplayNotCoveredError):
        log.subscribe(start_sequence_number=109)  # not yet produced
    # One past the newest is "live from the next batch".
    stream = log.subscribe(start_sequence_number=106)
    log.append([AllBlocksCleared()])
    (batch,) = await _take(stream, 1)
    assert batch.sequence_number == 106


async def test_snapshot_stands_in_for_an_uncovered_start() -> None:
    log = KvEventLog(buffer_steps=2, first_sequence_number=1)
    log.append([_chain([1, 2, 3])])
    log.append([_chain([4], parent=2)])
    log.append([BlockRemoved(block_keys=(BlockKey(3),))])
    stream = log.subscribe(start_sequence_number=1, include_snapshot=True)
    (snap,) = await _take(stream, 1)
    assert snap.sequence_number == 3
    assert isinstance(snap.events[0], AllBlocksCleared)
    stored = [e for e in snap.events[1:] if isinstance(e, BlockStored)]
    assert [e.block_keys[0] for e in stored] == [1, 2, 4]
    assert [e.parent_key for e in stored] == [None, 1, 2]
    assert stored[1].token_ids == (2, 2)
    log.append([AllBlocksCleared()])
    (live,) = await _take(stream, 1)
    assert live.sequence_number == 4


async def test_a_restarted_process_never_replays_its_batches_as_the_old_ones() -> None:
    """A subscriber of an earlier process resumes from its last + 1 with a snapshot on the
    next process, which has meanwhile published more batches than the earlier one: it gets
    the snapshot, numbered otherwise than it expects, never the new process's batches as the
    continuation of the old stream (with numbering from 1 in every process it got those)."""
    # Each process numbers from the wall clock in microseconds (the default, tested above);
    # here the bases are given, a restart 2 ms later, so the test does not read the clock.
    old = KvEventLog(buffer_steps=16, first_sequence_number=1_700_000_000_000_000)
    stream = old.subscribe(include_snapshot=True)
    for k in range(1, 4):
        old.append([_chain([k])])
    got = await _take(stream, 4)
    old.close()
    resume_from = got[-1].sequence_number + 1
    new = KvEventLog(buffer_steps=16, first_sequence_number=old.first_sequence_number + 2000)
    for k in range(100, 110):
        new.append([_chain([k])])
    resumed = new.subscribe(start_sequence_number=resume_from, include_snapshot=True)
    (snap,) = await _take(resumed, 1)
    assert snap.sequence_number == new.last_sequence_number != resume_from
    assert isinstance(snap.events[0], AllBlocksCleared)
    assert {e.block_keys[0] for e in snap.events[1:] if isinstance(e, BlockStored)} == set(
        range(100, 110)
    )
    with pytest.raises(ReplayNotCoveredError):  # and no replay without a snapshot
        new.subscribe(start_sequence_number=resume_from)


async def test_a_slow_subscriber_ends_with_overrun() -> None:
    log = KvEventLog(buffer_steps=2)
    stream = log.subscribe()
    for k in range(1, 5):
        log.append([_chain([k])])
    with pytest.raises(SubscriberOverrunError):
        await _take(stream, 1)


async def test_close_ends_live_subscriptions() -> None:
    log = KvEventLog(buffer_steps=2)
    stream = log.subscribe()
    waiter = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    log.close()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(waiter, timeout=5)


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.integers(0, 15), st.integers(1, 4)),
        st.tuples(st.just("remove"), st.integers(0, 15), st.just(1)),
        st.tuples(st.just("clear"), st.just(0), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(_ops)
def test_snapshot_rebuilds_the_same_cached_set(ops: list[tuple[str, int, int]]) -> None:
    """Applying a snapshot to an empty mirror gives the live mirror's cached set."""
    mirror = CachedBlockMirror()
    naive: dict[int, int] = {}  # key -> copies
    for kind, first, length in ops:
        event: KvEvent
        if kind == "store":
            keys = list(range(first, first + length))
            event = _chain(keys, parent=first - 1 if first > 0 else None)
            for k in keys:
                naive[k] = naive.get(k, 0) + 1
        elif kind == "remove":
            event = BlockRemoved(block_keys=(BlockKey(first),))
            if first in naive:
                naive[first] -= 1
                if naive[first] == 0:
                    del naive[first]
        else:
            event = AllBlocksCleared()
            naive.clear()
        mirror.apply(event)
    snapshot = mirror.snapshot()
    rebuilt = CachedBlockMirror()
    seen: set[int] = set()
    for event in snapshot:
        if isinstance(event, BlockStored):
            # Parents come first whenever the parent is itself cached.
            if event.parent_key is not None and event.parent_key in naive:
                assert event.parent_key in seen
            seen.add(event.block_keys[0])
        rebuilt.apply(event)
    assert seen == set(naive)
    assert len(rebuilt) == len(naive)
