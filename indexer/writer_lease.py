"""Which replica writes an engine's KV events into a shared index: its writer lease.

Several replicas sharing one Redis index (controller replicas, each polling every engine, or
`kvplane indexer serve` replicas with the same `sources:`) each could follow every engine,
but each engine's KV events are followed into the index by one replica at a time: the holder
of the engine's writer lease, a key in the index's partition that Redis expires
(`RedisBackend.hold_lease`). Were every replica to follow every engine, each would write
every batch (the Redis write load times the replicas), and one replica's clear of an
engine's worker (a restart it noticed, a removal through its admin API, its own start with a
replay buffer that no longer holds everything) would wipe what the others keep writing
incrementally: an engine removed through one replica only lost its indexed blocks for good
while another replica still routed to it.

A replica takes the lease of an engine whose events it would follow (for a controller: its
identity read) when nobody holds it, keeps it every third of its term (the controller's
`index.writer_lease_s`, the indexer's `writer_lease_s`), and follows the engine's events
while it holds it. Taking it over (the holder stopped, crashed, or lost Redis for a whole
term) always starts a fresh subscription, whose snapshot or replay clears and rebuilds the
engine's worker: what happened meanwhile, written by nobody, is in it. Every write of a
replica's sources is fenced by the lease inside Redis (`RedisBackend.fence_writes`), so a
holder paused past the expiry, which cannot know it lost the lease, has its late writes
refused instead of putting stale blocks back; the refusal stops its subscription at once
(`on_lost`). The KVIndexer API's applies (seed 004) are never fenced.

Leases are named after the engine (`engine_worker_id` of its workers: an OpenEngine
engine's address, a rank's worker `<engine>/dp<r>` under its engine's), so a controller
and an indexer following the same engine into one partition share its lease too.

A holder that reaches Redis but not its engine (a network partition between the two, a
firewall rule) would keep the lease, and nobody would write the engine's events, while
another replica that reaches the engine would follow it. So a holder whose following of the
engine's events has been down (`reachable()` false: never connected since it took the lease,
or lost since) for a whole term gives the lease up, and does not take it again for two
renewal intervals (two thirds of a term): every other replica that wants the lease renews
within one, so a replica that reaches the engine takes it meanwhile, and a lone replica
follows an engine that comes back without waiting a whole term more. When none does, the
lease moves from one replica to the next, each keeping it a term and taking it at most once
per 1.67 terms; whoever holds it writes nothing it cannot reach, as before.

A memory index is each replica's own: there is no lease, and every replica follows every
engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, runtime_checkable

from indexer.batch import Batch
from indexer.redis_backend import LeaseLostError, LeaseState
from indexer.redis_client import stop_if_cancelled
from kvplane.config import parse_host_port
from kvplane.errors import KvplaneError

log = logging.getLogger(__name__)

# Renewed this many times per term: a renewal that Redis misses (a slow call, a reconnection)
# leaves two more before the lease runs out.
RENEWALS_PER_TERM = 3


def lease_holder(replica_name: str | None, listen: str, incarnation: str) -> str:
    """This process's id in the writer leases: `<replica>/<incarnation>`. A process whose
    replica is the holder's (the same replica restarted) takes a lease over at once
    (`kvp_lease`), and the fence, which compares the whole id, refuses the previous
    process's writes. The replica is `replica_name`, else the host name and `listen` when it
    has a port (a restarted process listens there again), else the process's own id (no
    other process is this replica)."""
    if replica_name is None and parse_host_port(listen)[1] != 0:
        replica_name = f"{socket.gethostname()}:{listen}".replace("/", "_")
    return f"{replica_name or incarnation}/{incarnation}"


@runtime_checkable
class LeasingIndex(Protocol):
    """A shared index with writer leases (the Redis backend)."""

    def fence_writes(self, holder: str, lease_of: Callable[[str], str | None]) -> None: ...

    async def hold_lease(self, name: str, holder: str, ttl_s: float) -> LeaseState: ...

    async def ask_resync(
        self, name: str, holder: str, ttl_s: float, *, only_if_stream_lost: bool
    ) -> tuple[LeaseState, str]: ...

    async def release_lease(self, name: str, holder: str) -> None: ...

    async def apply(self, batch: Batch) -> None: ...


class WriterLease:
    """This replica's view of one engine's writer lease, kept by `run()`.

    `wanted()`: whether the replica follows the engine now (its identity read, KV events
    on); only then is the lease taken. `on_taken(resync)` runs when it is taken (or taken
    back after a fenced write was refused), `on_lost()` when another replica holds it or a
    write was refused: the first starts a fresh subscription, the second stops it.
    `on_resync(only_if_stream_lost)` runs when a renewal finds a resync of the engine that
    another replica was asked and handed to this one (`ask_resync`); by default
    `on_taken(True)` (a fresh subscription rebuilds the engine's workers from a snapshot).
    `resync` is the one rule of what a replica counts as a resync of the engine (the
    controller's `kv_event_resyncs_total`, the indexer's `resyncs`): True when the fresh
    subscription replaces this replica's own (the lease found taken anew while held: its
    key expired under it, or Redis lost it; a resync handed over), False for a take-over
    from another replica or from nobody, which is a start.
    `reachable()`: whether the engine's events reach this replica now (its subscription
    connected); while held, a whole term without them gives the lease up. None: always."""

    def __init__(
        self,
        index: LeasingIndex,
        engine: str,
        holder: str,
        term_s: float,
        *,
        wanted: Callable[[], bool],
        on_taken: Callable[[bool], Awaitable[None]],
        on_lost: Callable[[], None],
        on_resync: Callable[[bool], Awaitable[None]] | None = None,
        reachable: Callable[[], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._index = index
        self.engine = engine
        self._holder = holder
        self._term_s = term_s
        self._wanted = wanted
        self._on_taken = on_taken
        self._on_lost = on_lost
        self._on_resync = on_resync
        self._reachable = reachable
        self._clock = clock
        # Since when the engine's events have not reached this replica while it holds the
        # lease (None: they do, or it is not held), and until when it leaves the lease to
        # the others after giving it up for that.
        self._unreachable_since: float | None = None
        self._stand_aside_until = 0.0
        self.held = False
        # The last renewal found another replica holding it (that replica follows the engine).
        self.held_elsewhere = False
        self._wake = asyncio.Event()
        # One call to Redis about the lease at a time (the renewals and `ask_resync`): a
        # take-over's `on_taken` runs once.
        self._calls = asyncio.Lock()

    async def run(self) -> None:
        """Take, keep or watch the lease every third of a term (at once after a refusal)."""
        while True:
            stop_if_cancelled()
            if self._wanted() or self.held:
                await self._renew()
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._term_s / RENEWALS_PER_TERM):
                    await self._wake.wait()

    def wake(self) -> None:
        """Ask for the lease now (the engine's events are wanted since a moment)."""
        self._wake.set()

    async def ask_resync(self, only_if_stream_lost: bool) -> str | None:
        """A resync of the engine asked of this replica (ResyncEngine): None when this
        replica holds the lease (taken now if nobody held it), so that it resyncs the engine
        itself; else the id of the replica that holds it, to which the resync was handed
        (its next renewal finds it). A KvplaneError when Redis cannot answer."""
        async with self._calls:
            state, holder = await self._index.ask_resync(
                self.engine, self._holder, self._term_s, only_if_stream_lost=only_if_stream_lost
            )
            await self._found(state)
        return holder if state is LeaseState.HELD_ELSEWHERE else None

    async def _renew(self) -> None:
        if await self._gave_up_unreachable() or self._clock() < self._stand_aside_until:
            return
        async with self._calls:
            try:
                state = await self._index.hold_lease(self.engine, self._holder, self._term_s)
            except KvplaneError as exc:
                # Redis cannot answer: the lease runs out by itself, and every write is fenced.
                log.debug("engine %s: writer lease not renewed: %s", self.engine, exc)
                return
            was_held = self.held
            await self._found(state)
        # (Not held before: `on_taken` just started afresh, which rebuilds everything.)
        resync = (LeaseState.KEPT_RESYNC_ASKED, LeaseState.KEPT_RESYNC_IF_STREAM_LOST)
        if was_held and state in resync:
            log.info("engine %s: resync handed over by another replica", self.engine)
            only_if_stream_lost = state is LeaseState.KEPT_RESYNC_IF_STREAM_LOST
            try:
                if self._on_resync is None:
                    await self._on_taken(True)
                else:
                    await self._on_resync(only_if_stream_lost)
            except asyncio.CancelledError:
                raise
            except Exception:  # (Redis went away meanwhile): the engine is not rebuilt now
                log.exception("engine %s: the resync handed over failed", self.engine)

    async def _gave_up_unreachable(self) -> bool:
        """Give the lease up when the engine's events have not reached this replica for a
        whole term since it holds it (another replica may reach them); whether it did."""
        if not self.held or self._reachable is None or self._reachable():
            self._unreachable_since = None
            return False
        now = self._clock()
        if self._unreachable_since is None:
            self._unreachable_since = now
        if now - self._unreachable_since < self._term_s:
            return False
        log.warning("engine %s: its KV events have not reached this replica for %gs: writer "
                    "lease given up for another replica to take (not taken back for %gs)",
                    self.engine, now - self._unreachable_since,
                    2 * self._term_s / RENEWALS_PER_TERM)  # fmt: skip
        self._unreachable_since = None
        self._stand_aside_until = now + 2 * self._term_s / RENEWALS_PER_TERM
        self._on_lost()
        await self.release()
        return True

    async def _found(self, state: LeaseState) -> None:
        """What a call about the lease found: follow the engine, or stop following it."""
        self.held_elsewhere = state is LeaseState.HELD_ELSEWHERE
        if state is LeaseState.HELD_ELSEWHERE:
            if self.held:
                log.info("engine %s: another replica writes its KV events now", self.engine)
                self.lost()
            return
        # Taken, even by a replica that believed it held it (its key had expired, or Redis
        # lost it with its data): writes refused or lost meanwhile are unknown to it.
        if state is LeaseState.TAKEN or not self.held:
            log.info("engine %s: this replica writes its KV events into the shared index "
                     "(resubscribing from a snapshot)", self.engine)  # fmt: skip
            taken_anew, self.held = self.held, True
            try:
                await self._on_taken(taken_anew)
            except asyncio.CancelledError:
                raise
            except Exception:  # (the engine's ZMQ sources could not be read): next time
                log.exception("engine %s: its KV events not followed", self.engine)
                await self.release()

    def lost(self) -> None:
        """The lease is someone else's (or nobody's): stop writing now."""
        self.held = False
        self._on_lost()
        self._wake.set()  # take it again if nobody holds it

    async def release(self) -> None:
        """Give the lease up (this replica stops following the engine), so another takes it
        at its next renewal instead of after the expiry."""
        if not self.held:
            return
        self.held = False
        try:
            await self._index.release_lease(self.engine, self._holder)
        except KvplaneError as exc:
            log.info("engine %s: writer lease not released (it expires): %s", self.engine, exc)


class LeasedSink:
    """The index as an engine's KV-event source writes it under a writer lease: a write
    refused by the lease's fence ends the source's subscription at once (`WriterLease.lost`),
    instead of its retrying, refused again, until the next renewal."""

    def __init__(self, index: LeasingIndex, lease: WriterLease) -> None:
        self._index = index
        self._lease = lease

    async def apply(self, batch: Batch) -> None:
        try:
            await self._index.apply(batch._replace(under_lease=True))
        except LeaseLostError:
            self._lease.lost()  # cancels the source's task ...
            await asyncio.sleep(0)  # ... which ends here, unless the source is a child task
            raise
