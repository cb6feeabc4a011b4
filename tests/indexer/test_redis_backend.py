"""The Redis backend beyond the shared conformance suite (which runs it on one node and on a
3-node cluster): answers identical to the memory backend on random histories, failure
behaviour with a redis-server killed and restarted, and several processes sharing one index."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis_servers import RedisServer

from indexer.backend import IndexBackend
from indexer.batch import Action, ActionType, Batch, CacheSpec, Tier
from indexer.memory_backend import MemoryBackend
from indexer.redis_backend import IndexUnavailableError, RedisBackend, open_redis_backend

WORKERS = ("w0", "w1", "w2")
SPECS = (
    None,
    CacheSpec(1, 1, 0, 0b110, 0, 0),
    CacheSpec(0, 3, 32, 0b110, 0b010, 0),
    CacheSpec(1, 5, 0, 0b110, 0, 0b100),
    CacheSpec(2, 1, 0, 0b110, 0, 0),
)
keys = st.integers(-3, 5).map(lambda k: k * 0x0101_0101_0101_0101)
tiers = st.sampled_from(list(Tier))


@st.composite
def actions(draw: st.DrawFn) -> Action:
    kind = draw(st.sampled_from(list(ActionType)))
    tier = draw(tiers)
    if kind == ActionType.CLEAR_ALL_AT_TIER:
        return Action(kind, tier)
    hashes = tuple(draw(st.lists(keys, min_size=1, max_size=5)))
    copies = draw(st.booleans())
    if kind == ActionType.REVOKE:
        return Action(kind, tier, hashes, copies=copies)
    n = len(hashes)
    masks = draw(
        st.one_of(st.just(()), st.lists(st.sampled_from([0, 1, 3, 7]), min_size=n, max_size=n))
    )
    sizes = draw(
        st.one_of(st.just(()), st.lists(st.sampled_from([0, 16, 32]), min_size=n, max_size=n))
    )
    parent = draw(st.one_of(st.none(), keys))
    return Action(kind, tier, hashes, tuple(masks), tuple(sizes), parent, copies)


@st.composite
def operations(draw: st.DrawFn) -> tuple[object, ...]:
    what = draw(st.sampled_from(["apply", "apply", "apply", "apply", "remove", "hit"]))
    worker = draw(st.sampled_from(WORKERS))
    if what == "remove":
        return ("remove", worker)
    if what == "hit":
        return ("hit", tuple(draw(st.lists(keys, min_size=1, max_size=6))))
    batch = Batch(
        worker,
        tuple(draw(st.lists(actions(), max_size=4))),
        draw(st.sampled_from(["", f"addr-{worker}"])),
        cache_spec=draw(st.sampled_from(SPECS)),
    )
    return ("apply", batch)


async def _observe(backend: IndexBackend, queries: Sequence[Sequence[int]]) -> list[object]:
    """Everything a client can read (stats without the backend's name)."""
    seen: list[object] = [dataclasses.replace(await backend.stats(), backend="-")]
    for hashes in queries:
        seen.append(await backend.match(hashes, False))
        for max_blocks in (0, 2):
            seen.append(await backend.match_prefix(hashes, max_blocks))
            seen.append(await backend.match_prefix_by_tier(hashes, max_blocks))
        seen.append(await backend.hit_counts(hashes))
    # Snapshots order independent roots differently (memory: by insertion); compare the
    # actions each worker's batches carry.
    snapshot = [batch async for batch in backend.snapshot()]
    seen.append(
        sorted(
            (b.worker_id, b.worker_address, b.cache_spec, sorted(b.actions, key=repr))
            for b in snapshot
        )
    )
    return seen


@pytest.mark.timeout(300)
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ops=st.lists(operations(), max_size=12),
    queries=st.lists(st.lists(keys, min_size=1, max_size=6), min_size=1, max_size=3),
)
def test_redis_answers_like_memory(
    redis_server: RedisServer, ops: list[tuple[object, ...]], queries: list[list[int]]
) -> None:
    async def run() -> tuple[list[object], list[object]]:
        redis_server.flushall()
        memory = MemoryBackend()
        shared = await open_redis_backend(redis_server.url, buckets=8)
        try:
            for op in ops:
                for backend in (memory, shared):
                    if op[0] == "apply":
                        assert isinstance(op[1], Batch)
                        await backend.apply(op[1])
                    elif op[0] == "remove":
                        assert isinstance(op[1], str)
                        await backend.remove_worker(op[1])
                    else:
                        assert isinstance(op[1], tuple)
                        await backend.match(op[1], True)
            return await _observe(memory, queries), await _observe(shared, queries)
        finally:
            await shared.close()

    expected, actual = asyncio.run(run())
    assert actual == expected
