"""What the tests of a Redis that answers but refuses the index's writes (at its maxmemory,
unable to persist) send and read: single-action batches, the blocks queries show, and why
a query is refused."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest

from indexer.batch import Action, ActionType, Batch, BlockKey, Tier
from indexer.redis_backend import IndexUnavailableError, RedisBackend, open_redis_backend
from tests.redis_servers import RedisServer

WORKER = "w0"


def batch(kind: ActionType, keys: tuple[BlockKey, ...], worker: str = WORKER) -> Batch:
    return Batch(worker, (Action(kind, Tier.HBM, keys),), f"addr-{worker}")


async def held(backend: RedisBackend, keys: list[BlockKey]) -> list[tuple[str, tuple[int, ...]]]:
    """The queried blocks each worker holds at HBM."""
    return [(w.worker_id, w.by_tier[0].hashes) for w in await backend.match(keys, False)]


async def why_unavailable(backend: RedisBackend) -> str:
    """The error of a query (MatchExternalKv and MatchExternalKvPrefix) of `backend`."""
    with pytest.raises(IndexUnavailableError) as match_error:
        await backend.match([1, 2, 3], False)
    with pytest.raises(IndexUnavailableError) as prefix_error:
        await backend.match_prefix([1, 2, 3], 0)
    assert str(prefix_error.value) == str(match_error.value)
    return str(match_error.value)


async def refuses_saying(backend: RedisBackend, text: str) -> bool:
    """Whether a query of `backend` is refused with an error that says `text` (a process that
    only reads stops answering at its next maintenance call)."""
    try:
        await backend.match([1], False)
    except IndexUnavailableError as exc:
        return text in str(exc)
    return False


@contextlib.asynccontextmanager
async def writer_and_reader(
    server: RedisServer,
) -> AsyncIterator[tuple[RedisBackend, RedisBackend]]:
    """Two processes on one partition of `server`, both answering: one writes, one only
    reads (a router replica holding no engine's writer lease); w0 holds blocks 1, 2, 3 and
    w1 blocks 11, 12. Both closed, and `server` stopped, at the end."""
    writer = await open_redis_backend(server.url, buckets=16, maintenance_interval_s=0.05)
    reader = await open_redis_backend(server.url, buckets=16, maintenance_interval_s=0.05)
    try:
        await writer.apply(batch(ActionType.REPORT, (1, 2, 3)))
        await writer.apply(batch(ActionType.REPORT, (11, 12), "w1"))
        assert await held(reader, [1, 2, 3]) == [(WORKER, (1, 2, 3))]
        yield writer, reader
    finally:
        await writer.close()
        await reader.close()
        server.stop()
