"""A writer lease's holder that the engine's KV events do not reach (a partition between the
two while both reach Redis) gives the lease up after a term; when no replica reaches the
engine, the lease moves from one to the next without breaking anything, each holding it at
least a term and taking it at most once per 1.67 terms (a term held, two thirds of one
standing aside), and the first replica the events
reach again keeps it. Real leases on a private redis-server."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from indexer.backends import open_backend
from indexer.writer_lease import WriterLease
from tests.polling import eventually
from tests.redis_servers import RedisServer

pytestmark = pytest.mark.timeout(120)

TERM_S = 1.0


class Replica:
    """One replica's lease of the engine, with what it went through."""

    def __init__(self, index: object, name: str) -> None:
        self.reaches = False
        self.takes: list[float] = []  # when it took the lease (time.monotonic)
        self.holds_s: list[float] = []  # how long each of its holds lasted
        self.lease = WriterLease(
            index,  # type: ignore[arg-type]
            "127.0.0.1:9001",
            f"{name}/process",
            TERM_S,
            wanted=lambda: True,
            on_taken=self._taken,
            on_lost=self._lost,
            reachable=lambda: self.reaches,
        )

    async def _taken(self, _resync: bool) -> None:
        self.takes.append(time.monotonic())

    def _lost(self) -> None:
        self.holds_s.append(time.monotonic() - self.takes[-1])


async def test_a_lease_nobody_reaches_the_engine_for_moves_slowly_and_settles(
    redis: RedisServer,
) -> None:
    index = await open_backend(redis.url)
    a, b = Replica(index, "a"), Replica(index, "b")
    tasks = [asyncio.create_task(r.lease.run()) for r in (a, b)]
    try:
        # Nobody reaches the engine: the lease goes from one replica to the other.
        await eventually(lambda: len(a.takes) >= 3 and len(b.takes) >= 3, 60, "six takes")
        for replica in (a, b):
            gaps = [later - earlier for earlier, later in itertools.pairwise(replica.takes)]
            assert min(gaps) >= 5 / 3 * TERM_S, replica.takes
            assert min(replica.holds_s) >= TERM_S, replica.holds_s
        assert not any(task.done() for task in tasks)

        # The engine's events reach b again: b ends up holding the lease and keeps it.
        b.reaches = True
        await eventually(lambda: b.lease.held and a.lease.held_elsewhere, 20, "b to hold it")
        takes = len(b.takes)
        await eventually(lambda: time.monotonic() - b.takes[-1] > 2 * TERM_S, 20, "two terms")
        assert b.lease.held and a.lease.held_elsewhere and len(b.takes) == takes
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
        await a.lease.release()
        await b.lease.release()
        await index.close()
