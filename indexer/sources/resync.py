"""Routes an index backend's resync requests to the sources that feed the workers.

A backend that can drop or lose a worker's entries (the Redis backend: a buffer overflow while
Redis is down, Redis restarted without its data) asks for the worker to be rebuilt through
`add_resync_listener(callback)`; `connect_resync` sends each request to the source feeding
that worker, which clears and rebuilds it (a ZMQ source from its publisher's replay, an
OpenEngine source from a snapshot). A data-parallel rank's worker (`<engine>/dp<r>`, see
`indexer.sources.openengine`) is fed by its engine's source, which rebuilds that rank.
Backends that never lose entries (memory) have no such hook, and nothing is connected.

A router that sees a new process of an engine (a restart) has the engine's entries dropped at
once and its sources resubscribed (`resync_engine`; the controller on its own index, a
`kvplane indexer` through KvIndex.ResyncEngine): the old process's blocks must not attract
traffic while a source still waits out its reconnect backoff.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from indexer.backend import IndexBackend
from indexer.sources.openengine import engine_worker_id

log = logging.getLogger(__name__)


class Resyncable(Protocol):
    """A source that can rebuild its worker on request (ZmqSource, OpenEngineSource)."""

    def request_resync(self, worker_id: str | None = None) -> None: ...


@runtime_checkable
class ResyncingBackend(Protocol):
    """An index backend that asks for workers to be rebuilt (the Redis backend)."""

    def add_resync_listener(self, callback: Callable[[str], None]) -> None: ...


def connect_resync(backend: object, source_of: Callable[[str], Resyncable | None]) -> bool:
    """Send `backend`'s resync requests to `source_of(worker_id)`, looked up when a request
    comes (sources may be replaced). False when the backend never asks (memory)."""
    if not isinstance(backend, ResyncingBackend):
        return False

    def on_resync(worker_id: str) -> None:
        source = source_of(worker_id) or source_of(engine_worker_id(worker_id))
        if source is None:
            # Fed through ApplyExternalKvBatch: its client resends what the worker holds.
            log.warning(
                "worker %s must be resynced, but no source of this process feeds it", worker_id
            )
            return
        source.request_resync(worker_id)

    backend.add_resync_listener(on_resync)
    return True


def feeds(worker_id: str, worker_address: str, engine: str) -> bool:
    """Whether the worker holds `engine`'s entries: named after it, addressed as it, or one
    of its data-parallel ranks (`<engine>/dp<r>`)."""
    return engine in (worker_id, worker_address, engine_worker_id(worker_id))


async def drop_engine(backend: IndexBackend, engine: str) -> list[str]:
    """Remove every entry of `engine` (each worker that `feeds` it); returns the workers the
    index listed. A backend that cannot list its workers (a Redis that is down) still has the
    worker named `engine` removed (the Redis backend queues it) before the error."""
    try:
        stats = await backend.stats()
    except Exception:
        await backend.remove_worker(engine)
        raise
    workers = [w.worker_id for w in stats.workers if feeds(w.worker_id, w.worker_address, engine)]
    for worker_id in dict.fromkeys([engine, *workers]):
        await backend.remove_worker(worker_id)
    return workers


async def resync_engine(
    backend: IndexBackend,
    engine: str,
    source_of: Callable[[str], Resyncable | None],
) -> tuple[list[str], int]:
    """A new process of `engine`: drop its entries now, then have each source that follows it
    resubscribe now, from a snapshot (not after its reconnect backoff). Returns the workers
    dropped and how many sources were asked."""
    dropped = await drop_engine(backend, engine)
    asked: dict[int, Resyncable] = {}
    for worker_id in dict.fromkeys([engine, *dropped]):
        source = source_of(worker_id) or source_of(engine_worker_id(worker_id))
        if source is not None and id(source) not in asked:
            asked[id(source)] = source
            source.request_resync(None)  # every rank it follows: all of them were dropped
    return dropped, len(asked)
