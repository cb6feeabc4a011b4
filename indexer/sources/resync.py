"""Routes an index backend's resync requests to the sources that feed the workers.

A backend that can drop or lose a worker's entries (the Redis backend: a buffer overflow while
Redis is down, Redis restarted without its data) asks for the worker to be rebuilt through
`add_resync_listener(callback)`; `connect_resync` sends each request to the source feeding
that worker, which clears and rebuilds it (a ZMQ source from its publisher's replay, an
OpenEngine source from a snapshot). A data-parallel rank's worker (`<engine>/dp<r>`, see
`indexer.sources.openengine`) is fed by its engine's source, which rebuilds that rank.
Backends that never lose entries (memory) have no such hook, and nothing is connected.

A worker that no source of this process feeds is fed through ApplyExternalKvBatch (the bridge,
SGLang's bridge): its client must resend what the worker holds, and only it can. Such a worker
is marked in `LostExternalWorkers`; until a batch that clears it (`batch.clears_worker`, what a
rebuild sends first) is applied, every other batch of it is refused (WorkerLostError, ABORTED)
and changes nothing, so its client learns of the loss on its next apply and rebuilds. (A batch
whose own write is what found the loss, Redis emptied under it, was applied into the emptied
index before the loss was known; when its worker had blocks written before, it is refused all
the same, and the rebuild's clear drops it.)

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
from indexer.batch import Batch, clears_worker
from indexer.sources.openengine import engine_worker_id
from kvplane.errors import KvplaneError

log = logging.getLogger(__name__)


class UnknownEngineError(KvplaneError):
    """A resync of an engine the index holds nothing of and no source of this process
    follows (a mistyped name, or an engine fed from outside whose entries are gone): there
    is nothing to drop and nothing to resubscribe (NOT_FOUND)."""


class WorkerLostError(KvplaneError):
    """A batch of a worker whose blocks the index lost, that does not clear the worker first:
    refused (ABORTED), unapplied unless its own write found the loss, since taking it would
    leave the older blocks missing for good; the client must resend them from a clear."""


class LostExternalWorkers:
    """The workers fed through ApplyExternalKvBatch whose blocks the index lost and whose
    client has not resent them from a clear yet.

    The servicer brackets each apply: `admit` before (refuses a batch that does not clear a
    lost worker), `applied` after (a clearing batch ends the loss it was admitted under; a
    loss noticed while the batch was being applied, e.g. by its own write finding Redis
    emptied, refuses it too, as it may have been written before the loss). Each loss is
    numbered, so a clear admitted before a newer loss never ends that one."""

    def __init__(self) -> None:
        self._loss_of: dict[str, int] = {}  # worker -> number of its latest unrepaired loss
        self._num_losses = 0

    def mark_lost(self, worker_id: str) -> None:
        self._num_losses += 1
        self._loss_of[worker_id] = self._num_losses

    def admit(self, batch: Batch) -> int | None:
        """The loss `batch` is admitted under (None: its worker is not lost); raises
        WorkerLostError for a lost worker's batch that does not clear it."""
        loss = self._loss_of.get(batch.worker_id)
        if loss is not None and not clears_worker(batch):
            raise self._refusal(batch.worker_id)
        return loss

    def applied(self, batch: Batch, admitted_under: int | None) -> None:
        """`batch` was applied; raises WorkerLostError when its worker was lost meanwhile."""
        loss = self._loss_of.get(batch.worker_id)
        if loss is None:
            return
        if loss == admitted_under and clears_worker(batch):
            del self._loss_of[batch.worker_id]
            log.info("worker %s: its client resent it from a clear", batch.worker_id)
            return
        raise self._refusal(batch.worker_id)

    @staticmethod
    def _refusal(worker_id: str) -> WorkerLostError:
        return WorkerLostError(
            f"the index lost this worker's blocks (worker {worker_id!r}: its store lost its "
            "data, or dropped them in an outage); resend them from a clear: a batch that "
            "starts with CLEAR_ALL_AT_TIER at every tier, then the worker's blocks"
        )


class Resyncable(Protocol):
    """A source that can rebuild its worker on request (ZmqSource, OpenEngineSource)."""

    @property
    def stream_lost(self) -> bool:
        """The source has no live stream from the engine (it waits to reconnect): what its
        worker holds may be an earlier process's."""
        ...

    def request_resync(self, worker_id: str | None = None) -> None: ...


@runtime_checkable
class ResyncingBackend(Protocol):
    """An index backend that asks for workers to be rebuilt (the Redis backend)."""

    def add_resync_listener(self, callback: Callable[[str], None]) -> None: ...


def connect_resync(
    backend: object,
    source_of: Callable[[str], Resyncable | None],
    lost_workers: LostExternalWorkers | None = None,
) -> bool:
    """Send `backend`'s resync requests to `source_of(worker_id)`, looked up when a request
    comes (sources may be replaced); a worker no source feeds is marked in `lost_workers`
    (the process serving ApplyExternalKvBatch passes the one its servicer checks). False when
    the backend never asks (memory)."""
    if not isinstance(backend, ResyncingBackend):
        return False

    def on_resync(worker_id: str) -> None:
        source = source_of(worker_id) or source_of(engine_worker_id(worker_id))
        if source is not None:
            source.request_resync(worker_id)
        elif lost_workers is not None:
            lost_workers.mark_lost(worker_id)
            log.warning(
                "worker %s lost its blocks and no source of this process feeds it: its "
                "ApplyExternalKvBatch calls are refused (ABORTED) until one clears the worker",
                worker_id,
            )
        else:
            log.warning(
                "worker %s must be resynced, but no source of this process feeds it", worker_id
            )

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
) -> tuple[list[str], int]:
    """A new process of `engine`: drop its entries now, then have each source that follows it
    resubscribe now, from a snapshot (not after its reconnect backoff). Returns the workers
    dropped and how many sources were asked; an UnknownEngineError when no worker holds the
    engine's entries and no source follows it (nothing was dropped). `only_if_stream_lost`:
    only when one of those sources has lost its stream (nothing is done while they all follow
    the live process, nor for an engine unknown here: a first contact asks for any engine).
    """
    listed = None
    if only_if_stream_lost:
        listed = await engine_workers(backend, engine)
        if not any(source.stream_lost for source in _sources_of(engine, listed, source_of)):
            return [], 0
    dropped = await drop_engine(backend, engine, listed)
    sources = _sources_of(engine, dropped, source_of)
    if not dropped and not sources:
        raise UnknownEngineError(
            f"engine {engine!r} is unknown to this indexer: no worker holds its entries and "
            "no source of this indexer follows it (give its address or worker id, as "
            "`kvplane admin index stats` lists them)"
        )
    for source in sources:
        source.request_resync(None)  # every rank it follows: all of them were dropped
    return dropped, len(sources)
