"""Routes an index backend's resync requests to the sources that feed the workers.

A backend that can drop or lose a worker's entries (the Redis backend: a buffer overflow while
Redis is down, Redis restarted without its data) asks for the worker to be rebuilt through
`add_resync_listener(callback)`; `connect_resync` sends each request to the source feeding
that worker, which clears and rebuilds it (a ZMQ source from its publisher's replay, an
OpenEngine source from a snapshot). A data-parallel rank's worker (`<engine>/dp<r>`, see
`indexer.sources.openengine`) is fed by its engine's source, which rebuilds that rank.
Backends that never lose entries (memory) have no such hook, and nothing is connected.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol, runtime_checkable

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
