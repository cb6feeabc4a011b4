"""The shared index on a real redis-server that reaches its `maxmemory` (docs/redis.md,
"Failure behaviour" and "Redis configuration").

Under `noeviction` (Redis's default) Redis refuses every function that could grow the index
at its start. The writing process buffers its batches and its queries wait; a process that
only reads stops answering once its maintenance probe is refused (another process may hold a
removal buffered behind a report: no answer may show the block as if it had gone); both say
that Redis is out of memory, and both answer exactly again, without a restart, once Redis
takes writes. The batches that only free memory (removals, CLEAR, a worker removed) are
applied meanwhile, first of their worker's, so that an index that filled Redis shrinks back
under the cap by itself and the buffered reports follow. A policy that lets Redis evict the
index's own keys (`allkeys-*`) is warned of at start-up; a Redis that refuses CONFIG (as
managed ones often do) is served without a word.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from indexer.batch import Action, ActionType, Batch, BlockKey, Tier
from indexer.memory_backend import MemoryBackend
from indexer.redis_backend import IndexUnavailableError, RedisBackend, open_redis_backend
from tests.indexer.backend_views import observe, worker_keys
from tests.polling import eventually
from tests.redis_servers import RedisServer

pytestmark = pytest.mark.timeout(60)
WORKER = "w0"
OUT_OF_MEMORY = "is out of memory and refuses writes"
EVICTING = "may evict the index's keys"


def _batch(kind: ActionType, keys: tuple[BlockKey, ...], worker: str = WORKER) -> Batch:
    return Batch(worker, (Action(kind, Tier.HBM, keys),), f"addr-{worker}")


async def _held(backend: RedisBackend, keys: list[BlockKey]) -> list[tuple[str, tuple[int, ...]]]:
    """The queried blocks each worker holds at HBM."""
    return [(w.worker_id, w.by_tier[0].hashes) for w in await backend.match(keys, False)]


async def _why_unavailable(backend: RedisBackend) -> str:
    """The error of a query (MatchExternalKv and MatchExternalKvPrefix) of `backend`."""
    with pytest.raises(IndexUnavailableError) as match_error:
        await backend.match([1, 2, 3], False)
    with pytest.raises(IndexUnavailableError) as prefix_error:
        await backend.match_prefix([1, 2, 3], 0)
    assert str(prefix_error.value) == str(match_error.value)
    return str(match_error.value)


async def test_redis_out_of_memory_fails_closed_and_recovers_by_itself(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="indexer.redis_backend")
    server = RedisServer(tmp_path / "redis")
    server.start()
    # Two processes on one partition: one writes, one only reads (a router replica holding
    # no engine's writer lease).
    writer = await open_redis_backend(server.url, buckets=16, maintenance_interval_s=0.05)
    reader = await open_redis_backend(server.url, buckets=16, maintenance_interval_s=0.05)
    try:
        await writer.apply(_batch(ActionType.REPORT, (1, 2, 3)))
        await writer.apply(_batch(ActionType.REPORT, (11, 12), "w1"))
        assert await _held(reader, [1, 2, 3]) == [(WORKER, (1, 2, 3))]
        server.command("CONFIG", "SET", "maxmemory-policy", "noeviction")
        server.command("CONFIG", "SET", "maxmemory", 1)  # far below what Redis uses

        # The engine stored block 4, then evicted block 1: Redis refuses the report, and the
        # removal waits behind it (in order), acknowledged and buffered, so neither process
        # may show block 1 any more.
        await writer.apply(_batch(ActionType.REPORT, (4,)))
        await writer.apply(_batch(ActionType.REVOKE, (1,)))
        assert not writer.healthy and writer.num_buffered_batches == 2
        assert OUT_OF_MEMORY in await _why_unavailable(writer)
        # Another worker's removal, with nothing of its worker buffered, is applied even now.
        await writer.apply(_batch(ActionType.REVOKE, (11,), "w1"))

        async def released() -> bool:
            return await worker_keys(reader, "w1") == {12}

        await eventually(released, 30, "w1's removal to be applied at maxmemory")
        assert writer.num_buffered_batches == 2
        assert await worker_keys(reader, WORKER) == {1, 2, 3}  # w0's removal still waits

        async def reader_refuses() -> bool:
            try:
                await reader.match([1], False)
            except IndexUnavailableError as exc:
                return OUT_OF_MEMORY in str(exc)
            return False

        await eventually(reader_refuses, 30, "the reading process to stop answering")
        assert OUT_OF_MEMORY in await _why_unavailable(reader)
        assert reader.unavailable is not None and OUT_OF_MEMORY in reader.unavailable
        assert writer.num_buffered_batches == 2  # still refused

        server.command("CONFIG", "SET", "maxmemory", 0)  # the operator raises the cap

        async def recovered() -> bool:  # (the reader finds out at its next maintenance call)
            return writer.healthy and reader.unavailable is None

        await eventually(recovered, 30, "the writing process to replay its buffer")
        assert await _held(writer, [1, 2, 3, 4]) == [(WORKER, (2, 3, 4))]
        assert await _held(reader, [1, 2, 3, 4, 11, 12]) == [(WORKER, (2, 3, 4)), ("w1", (12,))]
        assert reader.unavailable is None and writer.unavailable is None
        messages = [r.getMessage() for r in caplog.records]
        said = [m for m in messages if "is out of memory and refuses the index's writes" in m]
        assert len(said) == 2  # once per process, not once per refused call
        assert "raise its maxmemory or free memory" in said[0]
        assert sum("takes the index's writes again" in m for m in messages) == 2
    finally:
        await writer.close()
        await reader.close()
        server.stop()


async def test_removals_shrink_a_full_redis_and_the_buffered_reports_follow(
    tmp_path: Path,
) -> None:
    """Redis fills up under the index (`noeviction`): a report is refused and buffered; then
    the engines evict blocks, clear a tier and a worker goes, through this process and
    through one started while Redis is full. Those apply at maxmemory and free memory, the
    index falls back under the cap by itself and the buffered report follows: the index
    then holds what the memory backend given the same batches holds, with no operator."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    writer = await open_redis_backend(server.url, buckets=256, maintenance_interval_s=0.05)
    expected = MemoryBackend()
    late: RedisBackend | None = None

    async def apply(backend: RedisBackend, batch: Batch) -> None:
        await backend.apply(batch)
        await expected.apply(batch)

    try:
        for first in range(1, 20_001, 500):  # w0: 20,000 blocks, the bulk of the index
            await apply(writer, _batch(ActionType.REPORT, tuple(range(first, first + 500))))
        for worker in ("w2", "w3"):
            await apply(writer, _batch(ActionType.REPORT, tuple(range(30_001, 32_001)), worker))
        await apply(writer, _batch(ActionType.REPORT, (40_001, 40_002), "w4"))
        used = await writer.used_memory_bytes()
        cap = used - 200_000
        server.command("CONFIG", "SET", "maxmemory-policy", "noeviction")
        server.command("CONFIG", "SET", "maxmemory", cap)

        await apply(writer, _batch(ActionType.REPORT, (50_001, 50_002, 50_003), "w1"))
        assert writer.num_buffered_batches == 1  # refused: it would grow the index
        assert OUT_OF_MEMORY in await _why_unavailable(writer)

        # A process started now (FUNCTION LOAD refused) clears w2's tier; this one evicts
        # w0's blocks but the first 100, and removes w3.
        late = await open_redis_backend(server.url, buckets=256, maintenance_interval_s=0.05)
        assert OUT_OF_MEMORY in await _why_unavailable(late)
        await apply(
            late, Batch("w2", (Action(ActionType.CLEAR_ALL_AT_TIER, Tier.HBM, ()),), "addr-w2")
        )
        for first in range(101, 20_001, 500):
            keys = tuple(range(first, min(first + 500, 20_001)))
            await apply(writer, _batch(ActionType.REVOKE, keys))
        await writer.remove_worker("w3")
        await expected.remove_worker("w3")

        async def recovered() -> bool:
            return writer.healthy and writer.unavailable is None and late.unavailable is None

        await eventually(recovered, 30, "the index to shrink under the cap and recover")
        freed = used - await writer.used_memory_bytes()
        assert freed > 200_000, f"{freed} bytes freed"
        queries = [[1, 2, 3], [101], [30_001, 30_002], [40_001, 40_002], [50_001, 50_002, 50_003]]
        assert await observe(writer, queries) == await observe(expected, queries)
        assert await observe(late, queries) == await observe(expected, queries)
    finally:
        await writer.close()
        if late is not None:
            await late.close()
        server.stop()


@pytest.mark.parametrize(
    ("policy", "warned"),
    [
        ("allkeys-lru", True),
        ("allkeys-lfu", True),
        ("allkeys-random", True),
        ("noeviction", False),
        ("volatile-lru", False),  # only keys with an expiry: the writer leases
    ],
)
async def test_a_policy_that_evicts_the_index_is_warned_of_at_start(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture, policy: str, warned: bool
) -> None:
    caplog.set_level(logging.WARNING, logger="indexer.redis_backend")
    redis_server.flushall()
    redis_server.command("CONFIG", "SET", "maxmemory-policy", policy)
    try:
        backend = await open_redis_backend(redis_server.url, buckets=16)
        await backend.close()
    finally:
        redis_server.command("CONFIG", "SET", "maxmemory-policy", "noeviction")
    warnings = [r.getMessage() for r in caplog.records if EVICTING in r.getMessage()]
    assert len(warnings) == int(warned)
    if warned:
        assert f"maxmemory-policy {policy}" in warnings[0]
        assert "set maxmemory-policy noeviction" in warnings[0]


async def test_a_redis_that_refuses_config_is_served_without_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="indexer.redis_backend")
    server = RedisServer(
        tmp_path / "redis",
        extra_args=("--maxmemory-policy", "allkeys-lru", "--rename-command", "CONFIG", ""),
    )
    server.start()
    backend = await open_redis_backend(server.url, buckets=16)
    try:
        await backend.apply(_batch(ActionType.REPORT, (1, 2)))
        assert await _held(backend, [1, 2]) == [(WORKER, (1, 2))]
        assert not [r for r in caplog.records if r.levelno >= logging.INFO]
    finally:
        await backend.close()
        server.stop()
