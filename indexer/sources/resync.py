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
traffic while a source still waits out its reconnect backoff. On a shared index with writer
leases (several indexer replicas, `indexer.sources.leased`) only the replica holding the
engine's lease follows it and may drop its workers: a replica asked that does not hold it
hands the resync to the holder through Redis (`LeasedResyncable.hand_resync`), which does it
at its next lease renewal, and says so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple, Protocol, runtime_checkable

from indexer.backend import IndexBackend
from indexer.sources.openengine import engine_worker_id
from kvplane.errors import KvplaneError

log = logging.getLogger(__name__)


class UnknownEngineError(KvplaneError):
    """A resync of an engine the index holds nothing of and no source of this process
    follows (a mistyped name, or an engine fed from outside whose entries are gone): there
    is nothing to drop and nothing to resubscribe (NOT_FOUND)."""


class Resyncable(Protocol):
    """A source that can rebuild its worker on request (ZmqSource, OpenEngineSource)."""

    @property
    def stream_lost(self) -> bool:
        """The source has no live stream from the engine (it waits to reconnect): what its
        worker holds may be an earlier process's."""
        ...

    def request_resync(self, worker_id: str | None = None) -> None: ...


@runtime_checkable
class LeasedResyncable(Resyncable, Protocol):
    """A source that one replica at a time follows: the holder of its engine's writer lease
    (`indexer.sources.leased.LeasedSource`)."""

    @property
    def lease_name(self) -> str: ...

    async def hand_resync(self, only_if_stream_lost: bool) -> str | None:
        """None when this replica holds the lease (taken now if nobody held it) and resyncs
        the engine itself; else the holder's id, to which the resync was handed."""
        ...


class EngineResync(NamedTuple):
    """What `resync_engine` did: the workers it dropped, how many sources of this process it
    asked to resubscribe, and the replicas holding the engine's writer leases that it handed
    the rest to (they drop and resubscribe at their next lease renewal)."""

    dropped: list[str]
    resubscribed: int
    handed_to: list[str]


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


async def engine_workers(backend: IndexBackend, engine: str) -> list[str]:
    """The workers of the index that hold `engine`'s entries (each that `feeds` it)."""
    stats = await backend.stats()
    return [w.worker_id for w in stats.workers if feeds(w.worker_id, w.worker_address, engine)]


async def drop_engine(
    backend: IndexBackend, engine: str, workers: list[str] | None = None
) -> list[str]:
    """Remove every entry of `engine` (each worker that `feeds` it: `workers` when the caller
    just listed them, else listed here); returns those workers. A backend that cannot list
    its workers (a Redis that is down) still has the worker named `engine` removed (the Redis
    backend queues it) before the error."""
    if workers is None:
        try:
            workers = await engine_workers(backend, engine)
        except Exception:
            await backend.remove_worker(engine)
            raise
    for worker_id in dict.fromkeys([engine, *workers]):
        await backend.remove_worker(worker_id)
    return workers


def _sources_of(
    engine: str, workers: list[str], source_of: Callable[[str], Resyncable | None]
) -> list[Resyncable]:
    """The sources that feed `engine`'s workers (or the worker named after it), once each."""
    found: dict[int, Resyncable] = {}
    for worker_id in dict.fromkeys([engine, *workers]):
        source = source_of(worker_id) or source_of(engine_worker_id(worker_id))
        if source is not None:
            found.setdefault(id(source), source)
    return list(found.values())


async def resync_engine(
    backend: IndexBackend,
    engine: str,
    source_of: Callable[[str], Resyncable | None],
    *,
    only_if_stream_lost: bool = False,
) -> EngineResync:
    """A new process of `engine`: drop its entries now, then have each source that follows it
    resubscribe now, from a snapshot (not after its reconnect backoff). A source whose
    engine's writer lease another replica holds is not this replica's to rebuild (its
    workers' removals would be fenced): the resync of its workers is handed to that replica
    instead (`LeasedResyncable.hand_resync`). An UnknownEngineError when no worker holds the
    engine's entries and no source follows it (nothing was dropped). `only_if_stream_lost`:
    only when one of those sources has lost its stream (nothing is done while they all follow
    the live process, nor for an engine unknown here: a first contact asks for any engine);
    a handed resync carries the condition to the holder, which alone knows its stream.
    """
    try:
        listed = await engine_workers(backend, engine)
    except Exception:
        await drop_engine(backend, engine)  # queues the removal of the worker named `engine`
        raise
    sources = _sources_of(engine, listed, source_of)
    handed_to: dict[str, None] = {}
    handed_leases: set[str] = set()
    for leased in [s for s in sources if isinstance(s, LeasedResyncable)]:
        holder = await leased.hand_resync(only_if_stream_lost)
        if holder is not None:
            handed_to[holder] = None
            handed_leases.add(leased.lease_name)
            sources.remove(leased)
    handed = list(handed_to)
    if only_if_stream_lost and not any(source.stream_lost for source in sources):
        return EngineResync([], 0, handed)
    if handed_leases:
        listed = [w for w in listed if engine_worker_id(w) not in handed_leases]
        if not listed and not sources:
            return EngineResync([], 0, handed)
    dropped = await drop_engine(backend, engine, listed)
    if not dropped and not sources:
        raise UnknownEngineError(
            f"engine {engine!r} is unknown to this indexer: no worker holds its entries and "
            "no source of this indexer follows it (give its address or worker id, as "
            "`kvplane admin index stats` lists them)"
        )
    for source in sources:
        source.request_resync(None)  # every rank it follows: all of them were dropped
    return EngineResync(dropped, len(sources), handed)
