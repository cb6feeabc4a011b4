"""An indexer replica's sources on a shared Redis index: each engine's run only under its
writer lease.

Several `kvplane indexer serve` with the same `sources:` on one Redis partition (replicas for
high availability) would each write every batch, and each one's clear of a worker (its own
start, a publisher it saw leave, a replay buffer that no longer holds everything) would wipe
what the others keep writing incrementally. So the sources of one engine (those whose
workers share `engine_worker_id`: a ZMQ source's `worker_id`, an OpenEngine source's worker
and its ranks' `<worker_id>/dp<r>`) run in one replica at a time: the holder of the
engine's writer lease (`indexer.writer_lease`, the controller replicas' machinery). The
other replicas keep them stopped (no SUB socket, no subscription); taking the lease over
starts each from scratch, a fresh source whose start clears its worker and rebuilds it from
the publisher's replay or the engine's snapshot, as a restarted indexer does. Every write of
these sources is fenced by the lease inside Redis; a refused one (this replica was paused
past the expiry) stops them at once. A resync of an engine (ResyncEngine) asked of a replica
that does not hold its lease is handed to the holder through Redis (`WriterLease.ask_resync`),
whose next renewal finds it and resyncs the engine (`on_resync`). A holder none of whose
engine's sources has been up for a whole term (a partition between it and the publisher)
gives the lease up for a replica that reaches the engine (`WriterLease`'s `reachable`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from indexer.sources.link import Link
from indexer.sources.openengine import OpenEngineSource, engine_worker_id
from indexer.sources.zmq import BatchSink, SourceCounters, ZmqSource
from indexer.translate import WorkerTranslator
from indexer.writer_lease import LeasedSink, LeasingIndex, WriterLease

Source = ZmqSource | OpenEngineSource


class LeasedSource:
    """One configured source, run only while this replica holds its engine's lease: each
    take-over builds a fresh one (`build(sink)`), whose counters carry on from the last
    one's (Prometheus counters never go back)."""

    def __init__(self, build: Callable[[BatchSink], Source], index: BatchSink) -> None:
        self._build = build
        self._source = build(index)  # not run: its worker id, translator and counters
        self._running = False
        # Its engine's writer lease (set by its LeasedEngineSources).
        self.lease: WriterLease | None = None

    @property
    def worker_id(self) -> str:
        return self._source.worker_id

    @property
    def translator(self) -> WorkerTranslator:
        return self._source.translator

    @property
    def counters(self) -> SourceCounters:
        return self._source.counters

    @property
    def followed(self) -> bool:
        """Whether this replica follows the source now (holds its engine's lease)."""
        return self._running

    @property
    def link(self) -> Link:
        """The stream's state, as the last source run here says (`Link`)."""
        return self._source.link

    @property
    def reaches_engine(self) -> bool:
        """Whether this replica follows the source and its stream is up (`Link`)."""
        return self._running and self.link.up

    @property
    def stream_lost(self) -> bool:
        """As the running source says; never while another replica follows it (its stream
        is that replica's)."""
        return self._running and self._source.stream_lost

    @property
    def lease_name(self) -> str:
        return lease_name(self.worker_id)

    def request_resync(self, worker_id: str | None = None) -> None:
        """Passed on to the running source; one this replica does not follow is rebuilt by
        the replica that does (its own backend asks it, a ResyncEngine is handed to it:
        `hand_resync`), or from scratch when it is taken over here."""
        if self._running:
            self._source.request_resync(worker_id)

    async def hand_resync(self, only_if_stream_lost: bool) -> str | None:
        """A resync of its engine asked of this replica: None when this replica holds the
        engine's lease (taken now if nobody held it: its sources start afresh) and resyncs
        it itself; else the holder's id, to which it was handed (`WriterLease.ask_resync`)."""
        assert self.lease is not None, "a LeasedSource runs in a LeasedEngineSources"
        return await self.lease.ask_resync(only_if_stream_lost)

    async def run(self, sink: BatchSink) -> None:
        """Follow the engine from scratch (a fresh source) until cancelled."""
        fresh = self._build(sink)
        fresh.counters = self._source.counters
        fresh.translator.counters = self._source.translator.counters
        fresh.translator.root_block = self._source.translator.root_block
        self._source = fresh
        self._running = True
        try:
            await fresh.run()
        finally:
            self._running = False


class LeasedEngineSources:
    """The sources of one engine, run while this replica holds the engine's writer lease
    (`lease_name`). `on_resync(only_if_stream_lost)` resyncs the engine when another replica
    hands this one, the holder, a resync it was asked (ResyncEngine)."""

    def __init__(
        self,
        index: LeasingIndex,
        lease_name: str,
        holder: str,
        term_s: float,
        sources: Sequence[LeasedSource],
        *,
        on_resync: Callable[[bool], Awaitable[None]],
    ) -> None:
        self.sources = tuple(sources)
        self.lease = WriterLease(
            index,
            lease_name,
            holder,
            term_s,
            wanted=lambda: True,
            on_taken=self._taken,
            on_lost=self._stop,
            on_resync=on_resync,
            reachable=lambda: any(source.reaches_engine for source in self.sources),
        )
        for source in self.sources:
            source.lease = self.lease
        self._sink = LeasedSink(index, self.lease)
        self._tasks: list[asyncio.Task[None]] = []
        self._failed: asyncio.Future[None] | None = None

    async def run(self) -> None:
        """Take, keep or watch the lease and run the sources while it is held, until
        cancelled; then give it up, so that another replica takes over at its next renewal
        rather than after the expiry. A source that cannot run at all (an endpoint ZMQ cannot
        parse: ConfigError) ends it with its error, as it ends an unleased indexer."""
        self._failed = asyncio.get_running_loop().create_future()
        lease_task = asyncio.create_task(self.lease.run(), name=f"lease {self.lease.engine}")
        try:
            await self._failed
        finally:
            lease_task.cancel()
            tasks = [lease_task, *self._tasks]
            self._stop()
            await asyncio.wait(tasks)
            await self.lease.release()

    async def _taken(self, resync: bool) -> None:
        """The lease is this replica's: start every source afresh (their starts rebuild the
        workers, whatever another replica or nobody wrote meanwhile), each counting one in
        its `resyncs` when the lease says it is a resync (`WriterLease`'s `on_taken`)."""
        running = self._tasks
        self._stop()
        if running:
            await asyncio.wait(running)
        for source in self.sources:
            if resync:
                source.counters.num_resyncs += 1
            task = asyncio.create_task(source.run(self._sink), name=f"source:{source.worker_id}")
            task.add_done_callback(self._ended)
            self._tasks.append(task)

    def _stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks = []

    def _ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or self._failed is None or self._failed.done():
            return
        error = task.exception()
        if error is not None:
            self._failed.set_exception(error)


def lease_name(worker_id: str) -> str:
    """The writer lease a worker is written under: its engine's (`engine_worker_id`), as the
    controller names it, so that controllers and indexers following one engine into one
    partition share it."""
    return engine_worker_id(worker_id)
