"""The shared index on a real redis-server that reaches its `maxmemory` (docs/redis.md,
"Failure behaviour" and "Redis configuration").

Under `noeviction` (Redis's default) Redis refuses every write function at its start, a
batch of removals as much as one of reports: no process may then answer from the index as if
the removal had landed. The writing process buffers it and its queries wait; a process that
only reads stops answering once its maintenance call is refused; both say that Redis is out
of memory, and both answer exactly again, without a restart, once Redis takes writes. A
policy that lets Redis evict the index's own keys (`allkeys-*`) is warned of at start-up;
a Redis that refuses CONFIG (as managed ones often do) is served without a word.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from indexer.batch import Action, ActionType, Batch, BlockKey, Tier
from indexer.redis_backend import IndexUnavailableError, RedisBackend, open_redis_backend
from tests.polling import eventually
from tests.redis_servers import RedisServer

pytestmark = pytest.mark.timeout(60)
WORKER = "w0"
OUT_OF_MEMORY = "is out of memory and refuses writes"
EVICTING = "may evict the index's keys"


def _batch(kind: ActionType, keys: tuple[BlockKey, ...]) -> Batch:
    return Batch(WORKER, (Action(kind, Tier.HBM, keys),), f"addr-{WORKER}")


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
        assert await _held(reader, [1, 2, 3]) == [(WORKER, (1, 2, 3))]
        server.command("CONFIG", "SET", "maxmemory-policy", "noeviction")
        server.command("CONFIG", "SET", "maxmemory", 1)  # far below what Redis uses

        # The engine evicted block 1: Redis refuses the removal, which is acknowledged and
        # buffered, so neither process may show block 1 any more.
        await writer.apply(_batch(ActionType.REVOKE, (1,)))
        assert not writer.healthy and writer.num_buffered_batches == 1
        assert OUT_OF_MEMORY in await _why_unavailable(writer)

        async def reader_refuses() -> bool:
            try:
                await reader.match([1], False)
            except IndexUnavailableError as exc:
                return OUT_OF_MEMORY in str(exc)
            return False

        await eventually(reader_refuses, 30, "the reading process to stop answering")
        assert OUT_OF_MEMORY in await _why_unavailable(reader)
        assert reader.unavailable is not None and OUT_OF_MEMORY in reader.unavailable
        assert writer.num_buffered_batches == 1  # still refused

        server.command("CONFIG", "SET", "maxmemory", 0)  # the operator raises the cap

        async def recovered() -> bool:
            return writer.healthy

        await eventually(recovered, 30, "the writing process to replay its buffer")
        assert await _held(writer, [1, 2, 3]) == [(WORKER, (2, 3))]
        assert await _held(reader, [1, 2, 3]) == [(WORKER, (2, 3))]
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
