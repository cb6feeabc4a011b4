"""An OpenEngine KV-event source: `SubscribeKvEvents` on one engine, one worker (or the
engine's advertised ZMQ sources, one worker per data-parallel rank).

Resync protocol (seed 000, "KV connector and KV events"): every subscription asks for
`include_snapshot` and, after the first, `start_sequence_number = last + 1` (0 after a batch
numbered 2^64 - 1, which has no next number). The engine then
either replays from there (no batch lost) or, when it no longer buffers that far back (or it
restarted), sends a snapshot batch. A batch whose sequence number is not the next one expected
(a snapshot, an engine restart) clears the worker before it is applied, so the index never
keeps stale entries; a snapshot starts with AllBlocksCleared and lists every cached block. Any
other batch out of sequence (batches went missing from the stream: an adapter that lost
messages of the engine's own feed) is applied after the clear too, and the source then
resubscribes from sequence number 0 with `include_snapshot`, so that what the clear dropped
and what the missing batches held come back: at once, unless no batch in sequence came since
the last such resubscription (an engine whose every stream breaks sequence), then after the
reconnect backoff.

The engine is dialled as `channels` says (insecure by default; TLS from a `ClientTlsConfig`).
A terminal `EngineError` on the stream, a broken stream or an unreachable engine all end in a
resubscription with exponential backoff. When the engine does not implement SubscribeKvEvents
(UNIMPLEMENTED) and `discover_zmq` is set, `GetKvEventSources` is asked for its ZMQ/msgpack
sources and one `ZmqSource` follows each. A target implementing neither (no OpenEngine server)
is logged in one line per attempt and retried with the same backoff: an engine may take its
place. An engine advertises one source per data-parallel rank, and ranks cache and number
their batches independently, so each rank is a worker of its own: with one source the worker
keeps the source's worker id; with several, rank r feeds
`rank_worker_id(worker_id, r)` (`<worker_id>/dp<r>`), every rank with the engine's
router-facing address, and the engine's own worker id, which nothing feeds any more, is
cleared. The counters are the engine's, summed over its ranks.

A resync request (`request_resync`: the index backend dropped or lost this worker's entries,
e.g. Redis restarted empty, or a router saw the engine restart) ends the current subscription,
or the reconnect backoff, at once and resubscribes from
sequence number 0 with `include_snapshot`: the engine answers with a snapshot (or a replay
from its first batch), whose sequence number is not the one expected, so the worker is
cleared and rebuilt.

`link` (`indexer.sources.link`) says whether the engine's events reach the source now: its
SubscribeKvEvents call open on a channel that reached the engine (an engine with nothing to
replay sends nothing until its next event), or every advertised ZMQ rank's publisher
connected.

`on_sequence_break`, when given, is called (synchronously) each time a batch out of sequence
has cleared the worker after earlier batches: the engine may have restarted, and only its
stream says so when it keeps its instance id and returns within one of its owner's polls. The
owner (the controller's fleet) decides what else that means; the source knows nothing of it.
Following advertised ZMQ sources, each rank's source calls it on its own breaks (a seq reset,
a gap its replay does not heal: `ZmqSource`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import grpc

from indexer.engine_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineEvent,
    EngineHash,
)
from indexer.sources.link import Link, weakest
from indexer.sources.zmq import (
    BatchSink,
    BatchTimeObserver,
    SourceCounters,
    ZmqSource,
    ZmqSourceSettings,
)
from indexer.translate import WorkerTranslator
from indexer.zmq_decode import ArrayTail
from kvplane.backoff import Backoff
from kvplane.channels import (
    INSECURE,
    ClientChannels,
    ClientSettings,
    failure_details,
    plain_details,
)
from kvplane.config import BIND_WILDCARD_HOSTS, join_host_port
from kvplane.enum_names import enum_name
from kvplane.zmq_heartbeat import DEFAULT_HEARTBEAT, Heartbeat
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_MEDIA: dict[int, str | None] = {
    pb.STORAGE_MEDIUM_UNSPECIFIED: None,
    pb.STORAGE_MEDIUM_GPU: "GPU",
    pb.STORAGE_MEDIUM_CPU_PINNED: "CPU_PINNED",
    pb.STORAGE_MEDIUM_DISK: "DISK",
    pb.STORAGE_MEDIUM_EXTERNAL: "EXTERNAL",
}
_INT64_BYTES = 8
# Resubscriptions for batches gone missing that follow each other with no batch in sequence
# between them (the engine's stream breaks sequence every time): from this one on, they wait
# the reconnect backoff instead of resubscribing at once.
_GAPS_BEFORE_BACKOFF = 2
# The largest `KvEventBatch.sequence_number` (uint64).
MAX_SEQUENCE_NUMBER = (1 << 64) - 1


def _medium(value: int) -> str | None:
    """The engine's StorageMedium as the ZMQ wire names it. A value this build does not know
    (a newer engine's) keeps a name of its own, so the translator skips and counts it as any
    unknown medium: read as unspecified it would go to the nil medium's tier."""
    return _MEDIA.get(value, f"STORAGE_MEDIUM_{value}")


def decode_hash(value: pb.KvBlockHash) -> EngineHash:
    """`int64`: 8 bytes big-endian two's complement; `string`: decimal text when it parses;
    anything else: the raw bytes (to_sfixed64 takes their last 8 bytes)."""
    raw = bytes(value.value)
    if value.encoding in ("int64", "") and len(raw) == _INT64_BYTES:
        return int.from_bytes(raw, "big", signed=True)
    if value.encoding == "string":
        try:
            number = int(raw.decode())
        except (UnicodeDecodeError, ValueError):
            pass
        else:
            if -(1 << 63) <= number < (1 << 64):
                return number
    if not raw:
        raise ValueError("empty block hash")
    return raw


def decode_event(event: pb.KvEvent) -> EngineEvent | None:
    """One protobuf KvEvent; None for an empty oneof. Raises ValueError when malformed."""
    kind = event.WhichOneof("event")
    if kind == "block_stored":
        s = event.block_stored
        return BlockStored(
            block_hashes=tuple(decode_hash(h) for h in s.block_hashes),
            parent_block_hash=(
                decode_hash(s.parent_block_hash) if s.HasField("parent_block_hash") else None
            ),
            token_ids=tuple(s.token_ids),
            block_size=s.block_size or None,
            medium=_medium(s.medium),
            lora_name=s.lora_name or None,
            lora_id=s.lora_id or None,
            extra_keys=tuple(tuple(k.values) or None for k in s.extra_keys),
            group_idx=s.group_idx,
            kv_cache_spec_kind=s.kv_cache_spec_kind or None,
            kv_cache_spec_sliding_window=s.kv_cache_spec_sliding_window or None,
        )
    if kind == "block_removed":
        r = event.block_removed
        return BlockRemoved(
            block_hashes=tuple(decode_hash(h) for h in r.block_hashes),
            medium=_medium(r.medium),
            group_idx=r.group_idx,
        )
    if kind == "all_blocks_cleared":
        return AllBlocksCleared()
    return None


@dataclass(frozen=True, slots=True)
class OpenEngineSourceSettings:
    target: str
    data_parallel_ranks: tuple[int, ...] = ()
    discover_zmq: bool = True
    # How the advertised ZMQ sources' positional events are read (`indexer.zmq_decode`).
    array_tail: ArrayTail = "ignore"
    # How those sources find a publisher that falls silent (`kvplane.zmq_heartbeat`).
    heartbeat: Heartbeat = DEFAULT_HEARTBEAT
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 5.0
    # How the source's user names its TLS and token settings: a failed subscription's
    # warning says which one it most likely lacks (`kvplane.channels.setting_hint`); None:
    # no hint.
    client_settings: ClientSettings | None = None


class OpenEngineSource:
    def __init__(
        self,
        settings: OpenEngineSourceSettings,
        translator: WorkerTranslator,
        sink: BatchSink,
        *,
        channels: ClientChannels = INSECURE,
        on_batch_time: BatchTimeObserver | None = None,
        on_sequence_break: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.translator = translator
        self.sink = sink
        self.counters = SourceCounters()
        self.on_batch_time = on_batch_time
        self.on_sequence_break = on_sequence_break
        self.last_seq: int | None = None
        # Batches out of sequence (not snapshots) since the last batch in sequence: an engine
        # whose every stream breaks sequence is resubscribed with backoff, not at once.
        self._gaps_in_a_row = 0
        # Set when the engine lacks SubscribeKvEvents and its advertised ZMQ sources are
        # followed instead (one per data-parallel rank).
        self.zmq_sources: tuple[ZmqSource, ...] = ()
        self._channels = channels
        self._progress = asyncio.Condition()
        # Why the next subscription starts from a snapshot (None: it resumes).
        self._resync_wanted: str | None = None
        self._call: grpc.aio.UnaryStreamCall[Any, Any] | None = None
        # Set by a resync request: ends a reconnect backoff at once.
        self._wake = asyncio.Event()
        # Whether a SubscribeKvEvents call is open on a channel that reached the engine.
        self._link = Link(f"subscribing to {settings.target}")

    @property
    def worker_id(self) -> str:
        return self.translator.options.worker_id

    @property
    def stream_lost(self) -> bool:
        """No SubscribeKvEvents call is open (the source waits to reconnect, or has not
        subscribed yet): its worker may hold an earlier process's blocks. Following advertised
        ZMQ sources, never (they find a restarted publisher by its sequence numbers)."""
        return self._call is None and not self.zmq_sources

    @property
    def link(self) -> Link:
        """Whether the engine's events reach this source now: its SubscribeKvEvents call, or,
        following advertised ZMQ sources, every rank's publisher (`indexer.sources.link`)."""
        if self.zmq_sources:
            return weakest((s.worker_id, s.link) for s in self.zmq_sources)
        return self._link

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        """Wait (at most `timeout_s`) until `predicate()` holds after some batch was handled."""
        async with asyncio.timeout(timeout_s), self._progress:
            await self._progress.wait_for(predicate)

    def request_resync(self, worker_id: str | None = None) -> None:
        """The index dropped or lost this worker's entries: resubscribe with a snapshot now.
        Synchronous, for index-backend callbacks. Following ZMQ sources, only the rank that
        feeds `worker_id` is rebuilt (every rank when it names none of them)."""
        if self.zmq_sources:
            ranks = [s for s in self.zmq_sources if s.worker_id == worker_id]
            for source in ranks or self.zmq_sources:
                source.request_resync()
            return
        self._resync_wanted = "the index asked for a resync"
        self._wake.set()
        if self._call is not None:
            self._call.cancel()

    async def run(self) -> None:
        backoff = Backoff(self.settings.backoff_initial_s, self.settings.backoff_max_s)
        while True:
            follow_zmq = False
            try:
                async with self._channels.aio_channel(self.settings.target) as channel:
                    delivered = await self._subscribe(channel)
                    if delivered and self._gaps_in_a_row < _GAPS_BEFORE_BACKOFF:
                        backoff.reset()
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                follow_zmq = (
                    exc.code() == grpc.StatusCode.UNIMPLEMENTED and self.settings.discover_zmq
                )
                if not follow_zmq:
                    reason = self._failure_reason(exc)
                    self._link.went_down(reason)
                    log.warning("openengine source %s: %s", self.settings.target, reason)
            except Exception as exc:
                self._link.went_down(f"failed: {exc!r}")
                log.exception("openengine source %s failed", self.settings.target)
            if follow_zmq:
                try:
                    await self._follow_advertised_zmq()  # until cancelled, unless none follows
                except asyncio.CancelledError:
                    raise
                except grpc.aio.AioRpcError as exc:  # one line each retry: no traceback
                    self._log_discovery_failure(exc, backoff.next_s)
                except Exception:
                    log.exception(
                        "openengine source %s: ZMQ discovery failed", self.settings.target
                    )
            if self._resync_wanted is not None:
                if self._gaps_in_a_row < _GAPS_BEFORE_BACKOFF:
                    continue  # resubscribe at once
                log.warning(
                    "worker %s: its stream broke sequence again before a batch in sequence; "
                    "resubscribing in %.1fs",
                    self.worker_id,
                    backoff.next_s,
                )
            self.counters.num_restarts += 1
            self._wake.clear()
            # A resync request ends the wait. (Not `asyncio.wait_for`: on Python 3.11 it loses
            # a cancellation that arrives as the request does.)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(backoff.take()):
                    await self._wake.wait()

    def _failure_reason(self, exc: grpc.aio.AioRpcError) -> str:
        """A failed call (SubscribeKvEvents, GetKvEventSources) as an operator reads it: its
        code and details (a TLS handshake's trail cut to OpenSSL's reason), with the setting
        it most likely lacks when the source's user named them (`client_settings`)."""
        details = exc.details() or ""
        settings = self.settings.client_settings
        if settings is not None:
            details = failure_details(self._channels, exc.code(), details, settings)
        else:
            details = plain_details(details)
        return f"{exc.code().name}: {details}"

    def _log_discovery_failure(self, exc: grpc.aio.AioRpcError, backoff_s: float) -> None:
        """GetKvEventSources failed too. A target without either RPC is no OpenEngine server
        (yet: an engine may take its place), so the source keeps retrying."""
        target = self.settings.target
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            log.warning(
                "openengine source %s serves neither SubscribeKvEvents nor GetKvEventSources; "
                "retrying in %.1fs",
                target,
                backoff_s,
            )
        else:
            log.warning(
                "openengine source %s: GetKvEventSources: %s; retrying in %.1fs",
                target,
                self._failure_reason(exc),
                backoff_s,
            )

    async def _subscribe(self, channel: grpc.aio.Channel) -> bool:
        """Follow one subscription until it ends; True if it delivered anything."""
        if self._resync_wanted is not None:
            self.counters.num_resyncs += 1
            log.warning("worker %s: %s; resubscribing", self.worker_id, self._resync_wanted)
            self._resync_wanted = None
            self.last_seq = None  # the snapshot (or replay from 0) clears and rebuilds
        if self.last_seq == MAX_SEQUENCE_NUMBER:
            # No next number to resume from (the engine's nonsense, or a wrap): start over
            # from a snapshot, which clears and rebuilds, as after a resync.
            self.last_seq = None
        start = 0 if self.last_seq is None else self.last_seq + 1
        request = pb.SubscribeKvEventsRequest(
            data_parallel_ranks=self.settings.data_parallel_ranks,
            include_snapshot=True,
            start_sequence_number=start,
        )
        delivered = False
        call = self._call = pb_grpc.OpenEngineStub(channel).SubscribeKvEvents(request)
        # The call is open at the engine once its channel is READY (an engine that has nothing
        # to replay sends nothing until its next event).
        reached = asyncio.ensure_future(self._reached(channel, call))
        ended = "the stream ended"
        try:
            async for response in call:
                if response.WhichOneof("event") == "error":
                    code = enum_name(pb.ErrorCode.DESCRIPTOR, response.error.code)
                    ended = f"the stream ended with {code}: {response.error.message}"
                    log.warning("openengine source %s: %s", self.settings.target, ended)
                    break
                if response.WhichOneof("event") == "batch":
                    await self._on_batch(response.batch)
                    delivered = True
                    async with self._progress:
                        self._progress.notify_all()
                if self._resync_wanted is not None:
                    break
        except asyncio.CancelledError:
            # request_resync cancelled the call; a cancelled task must stay cancelled.
            task = asyncio.current_task()
            if self._resync_wanted is None or (task is not None and task.cancelling()):
                raise
        finally:
            reached.cancel()
            self._call = None
            self._link.went_down(ended)
            call.cancel()
        return delivered

    async def _reached(
        self, channel: grpc.aio.Channel, call: grpc.aio.UnaryStreamCall[Any, Any]
    ) -> None:
        """Mark the link up once `call`'s channel reaches the engine, unless the call ended."""
        await channel.channel_ready()
        if not call.done():
            self._link.went_up()

    async def _on_batch(self, batch: pb.KvEventBatch) -> None:
        self.counters.num_messages += 1
        seq = batch.sequence_number
        expected = None if self.last_seq is None else self.last_seq + 1
        if seq == expected:
            self._gaps_in_a_row = 0
        else:
            if expected is not None:
                self.counters.num_gaps += 1
                log.warning(
                    "worker %s: batch %d where %d was expected; clearing and rebuilding",
                    self.worker_id,
                    seq,
                    expected,
                )
                if not _is_snapshot(batch):  # what the clear drops comes back with a snapshot
                    self._resync_wanted = "batches went missing from the stream"
                    self._gaps_in_a_row += 1
            self.counters.num_resets += 1
            await self.sink.apply(self.translator.reset(seq=seq))
            self.counters.num_batches_applied += 1
            if expected is not None and self.on_sequence_break is not None:
                self.on_sequence_break()
        events: list[EngineEvent] = []
        for raw in batch.events:
            try:
                event = decode_event(raw)
            except ValueError:
                self.counters.num_bad_events += 1
                continue
            if event is None:
                self.counters.num_unknown_events += 1
            else:
                events.append(event)
        self.counters.num_events += len(events)
        for index_batch in self.translator.translate(events, seq=seq):
            await self.sink.apply(index_batch)
            self.counters.num_batches_applied += 1
        self.last_seq = seq
        # 0: the engine did not stamp the batch.
        if self.on_batch_time is not None and batch.timestamp_unix_nanos:
            self.on_batch_time(batch.timestamp_unix_nanos / 1e9)

    async def _follow_advertised_zmq(self) -> None:
        """Follow every ZMQ/msgpack source the engine advertises until cancelled; returns when
        it advertises none (to be asked again after a backoff)."""
        sources = await self._discover_zmq()
        if not sources:
            log.warning(
                "openengine source %s: SubscribeKvEvents unimplemented and no ZMQ/msgpack "
                "KV-event source advertised",
                self.settings.target,
            )
            return
        if len(sources) > 1:  # each rank is its own worker: nothing feeds this one any more
            self.counters.num_resets += 1
            await self.sink.apply(self.translator.reset())
            self.counters.num_batches_applied += 1
        self.zmq_sources = tuple(sources)
        async with asyncio.TaskGroup() as group:
            for source in sources:
                group.create_task(source.run(), name=f"source:{source.worker_id}")

    async def _discover_zmq(self) -> list[ZmqSource]:
        """One `ZmqSource` per advertised ZMQ/msgpack source, each feeding its own worker
        (see the module docstring)."""
        async with self._channels.aio_channel(self.settings.target) as channel:
            stub = pb_grpc.OpenEngineStub(channel)
            response = await stub.GetKvEventSources(
                pb.GetKvEventSourcesRequest(data_parallel_ranks=self.settings.data_parallel_ranks)
            )
        adverts = [
            s for s in response.sources if s.transport == "zmq" and s.encoding in ("", "msgpack")
        ]
        sources: list[ZmqSource] = []
        for position, advert in enumerate(adverts):
            translator = self.translator
            if len(adverts) > 1:
                rank = (
                    advert.data_parallel_rank if advert.HasField("data_parallel_rank") else position
                )
                worker_id = rank_worker_id(self.worker_id, rank)
                if any(s.worker_id == worker_id for s in sources):
                    log.warning(
                        "openengine source %s advertises rank %d twice; following the first",
                        self.settings.target,
                        rank,
                    )
                    continue
                translator = WorkerTranslator(replace(self.translator.options, worker_id=worker_id))
                translator.counters = self.translator.counters
                translator.root_block = self.translator.root_block
            problem = advert_endpoint_problem(advert)
            if problem is not None:
                log.warning(
                    "openengine source %s: not following its ZMQ source %s: %s",
                    self.settings.target,
                    translator.options.worker_id,
                    problem,
                )
                continue
            settings = zmq_source_settings(
                advert, array_tail=self.settings.array_tail, heartbeat=self.settings.heartbeat
            )
            log.info(
                "worker %s: SubscribeKvEvents unimplemented; following ZMQ %s (replay %s)",
                translator.options.worker_id,
                settings.endpoint,
                settings.replay_endpoint,
            )
            source = ZmqSource(
                settings,
                translator,
                self.sink,
                on_batch_time=self.on_batch_time,
                on_sequence_break=self.on_sequence_break,
            )
            source.counters = self.counters
            sources.append(source)
        return sources


def _is_snapshot(batch: pb.KvEventBatch) -> bool:
    """A snapshot lists every cached block after an AllBlocksCleared."""
    return bool(batch.events) and batch.events[0].WhichOneof("event") == "all_blocks_cleared"


def rank_worker_id(worker_id: str, rank: int) -> str:
    """The worker id of data-parallel rank `rank` of the engine followed as `worker_id`."""
    return f"{worker_id}/dp{rank}"


def engine_worker_id(worker_id: str) -> str:
    """The engine's worker id for a rank's worker id (`rank_worker_id`'s inverse); any other
    id is returned as it is."""
    engine, separator, rank = worker_id.rpartition("/dp")
    return engine if separator and rank.isascii() and rank.isdigit() else worker_id


def advert_endpoint_problem(advert: pb.KvEventSource) -> str | None:
    """Why an advertised source's `endpoint_addr` cannot be dialled, or None. The seed makes it
    a connectable host:port, never a bind wildcard: dialling `0.0.0.0` would reach whatever
    listens on that port of this machine, not the engine, and `*` is no address at all."""
    address = advert.endpoint_addr
    if address.host.strip() in BIND_WILDCARD_HOSTS:
        return f"endpoint_addr host {address.host!r} is a bind wildcard, not an address to dial"
    if not 0 < address.port <= 65535:
        return f"endpoint_addr port {address.port} is not a port to dial"
    return None


def zmq_source_settings(
    advert: pb.KvEventSource, *, array_tail: ArrayTail, heartbeat: Heartbeat = DEFAULT_HEARTBEAT
) -> ZmqSourceSettings:
    """How to follow one advertised ZMQ source (its replay endpoint may lack the scheme),
    reading its positional events' fields from index 7 on as `array_tail` says: the advert does
    not say which engine's layout they follow. Check `advert_endpoint_problem` first."""
    endpoint = "tcp://" + join_host_port(advert.endpoint_addr.host, advert.endpoint_addr.port)
    replay = advert.replay_endpoint or None
    if replay is not None and "://" not in replay:
        replay = f"tcp://{replay}"
    return ZmqSourceSettings(
        endpoint=endpoint,
        replay_endpoint=replay,
        topic=advert.topic,
        array_tail=array_tail,
        heartbeat=heartbeat,
    )
