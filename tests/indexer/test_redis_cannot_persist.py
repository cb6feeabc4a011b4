"""The shared index on a real redis-server that cannot persist to disk (docs/redis.md,
"Failure behaviour", "Redis that cannot persist").

A failed RDB snapshot under `stop-writes-on-bgsave-error yes` (Redis's default) makes Redis
refuse every write (`MISCONF Redis is configured to save RDB snapshots, but it's currently
unable to persist to disk ...`) while it still answers reads. That is an outage, as at its
maxmemory: the writing process buffers its batches (a removal behind a report included), no
process answers a query (each says why and what to do), and both answer exactly again, with
no restart, once a save succeeds.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from indexer.batch import ActionType
from indexer.redis_backend import IndexUnavailableError, open_redis_backend
from tests.indexer.backend_views import worker_keys
from tests.indexer.redis_refusals import (
    WORKER,
    batch,
    held,
    refuses_saying,
    why_unavailable,
    writer_and_reader,
)
from tests.polling import eventually
from tests.redis_servers import RedisServer

pytestmark = pytest.mark.timeout(60)
CANNOT_PERSIST = "cannot persist to disk and refuses writes (MISCONF"
WHAT_TO_DO = "fix what its log says (disk space, permissions of its dir) and run BGSAVE"


async def test_a_redis_that_cannot_persist_fails_closed_and_recovers_by_itself(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="indexer.redis_backend")
    server = RedisServer(tmp_path / "redis")
    server.start()
    async with writer_and_reader(server) as (writer, reader):
        server.break_saves()

        # The engine stored block 4, then evicted block 1; w1 went away. Acknowledged and
        # buffered in order, so no process may answer with block 1 any more.
        await writer.apply(batch(ActionType.REPORT, (4,)))
        await writer.apply(batch(ActionType.REVOKE, (1,)))
        with pytest.raises(IndexUnavailableError):
            await writer.remove_worker("w1")  # queued
        assert not writer.healthy and writer.num_buffered_batches == 2
        said = await why_unavailable(writer)
        assert CANNOT_PERSIST in said and WHAT_TO_DO in said, said
        with pytest.raises(IndexUnavailableError):  # a lease is a write too
            await writer.hold_lease("e0", "a/1", 30.0)

        await eventually(
            lambda: refuses_saying(reader, CANNOT_PERSIST),
            30,
            "the reading process to stop answering",
        )
        assert CANNOT_PERSIST in await why_unavailable(reader)
        assert reader.unavailable is not None and CANNOT_PERSIST in reader.unavailable
        # Nothing was written meanwhile (Redis refuses removals as well).
        assert await worker_keys(reader, WORKER) == {1, 2, 3}
        assert await worker_keys(reader, "w1") == {11, 12}
        assert writer.num_buffered_batches == 2

        server.mend_saves()  # the operator fixes the disk and saves

        async def recovered() -> bool:  # (the reader finds out at its next maintenance call)
            return writer.healthy and reader.unavailable is None

        await eventually(recovered, 30, "the writing process to replay its buffer")
        assert await held(writer, [1, 2, 3, 4, 11, 12]) == [(WORKER, (2, 3, 4))]
        assert await held(reader, [1, 2, 3, 4, 11, 12]) == [(WORKER, (2, 3, 4))]
        assert reader.unavailable is None and writer.unavailable is None
        messages = [r.getMessage() for r in caplog.records]
        warned = [m for m in messages if "cannot persist to disk and refuses the index's" in m]
        assert len(warned) == 2  # once per process, not once per refused call
        assert WHAT_TO_DO in warned[0]
        assert sum("takes the index's writes again" in m for m in messages) == 2


async def test_a_process_started_while_redis_cannot_persist_serves_once_it_can(
    tmp_path: Path,
) -> None:
    """FUNCTION LOAD and the partition's claim are writes: a process opened now is not ready,
    says why, buffers its applies, and serves them once a save succeeds."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    server.break_saves()
    backend = await open_redis_backend(server.url, buckets=16, maintenance_interval_s=0.05)
    try:
        said = await why_unavailable(backend)
        assert CANNOT_PERSIST in said and WHAT_TO_DO in said, said
        await backend.apply(batch(ActionType.REPORT, (1, 2)))
        assert backend.num_buffered_batches == 1
        server.mend_saves()

        async def recovered() -> bool:
            return backend.healthy and backend.unavailable is None

        await eventually(recovered, 30, "the process to replay its buffer")
        assert await held(backend, [1, 2]) == [(WORKER, (1, 2))]
    finally:
        await backend.close()
        server.stop()
