"""A vLLM / SGLang ZMQ KV-event source: SUB on the publisher, replay from its ROUTER.

One `ZmqSource` follows one publisher (one engine, one data-parallel rank) and feeds one
worker through a `WorkerTranslator` into a sink (an index backend, or the bridge's
ApplyExternalKvBatch client).

Sequence rules (WIRE.md section 1; per publisher, starting at 0):

- start: with a replay endpoint the worker is cleared (entries left by an earlier run are
  stale) and rebuilt from a replay from seq 0 at once, before any message: an idle engine
  publishes nothing, and what it holds would stay unknown until it did (a restarted indexer or
  controller beside running engines). A replay that holds nothing clears the worker all the
  same (the publisher has published nothing since it started: what the index holds of the
  worker is an earlier process's, left by a writer that lost its lease across the engine's
  restart). Without a replay endpoint, or when the replay fails or holds nothing, the first
  message clears and rebuilds the worker; such a replay (failed: the publisher not up yet; or
  empty: its replay ROUTER answered before its first batch) is also retried at the SUB's next
  connection, so a publisher that comes up, publishes before the SUB reaches it and goes idle
  is indexed all the same. A replay that failed while the SUB was connected (the publisher's
  replay ROUTER not answering yet) is retried with the source's backoff until one answers or
  a message comes (a streak of failures warns at its 1st, 2nd, 4th, 8th, ... failure, and
  says when the replay answers again; a replay that answers, whatever asked it, and a new
  connection start the backoff from its shortest wait again). A rebuild that follows a
  replay failed on the same connection (timed out: an endpoint that never answers) does not
  ask again at once: it rebuilds from its message alone rather than stall the source a
  second time;
- a new connection (the SUB made or accepted one, its handshake done) with batches applied
  (a replay brought them before it: the start's, a resync's) is checked at once as a gap is,
  from one replay from the last applied seq, with no message to wait for: the SUB misses
  whatever the publisher sent before its connection was up, and the publisher may have sent
  batches after that replay and then gone idle (or be another process by now). Whatever the
  replay brought after the last applied seq is applied (their live copies are duplicates;
  `connection_heals` counts such a check, `gaps` does not: no message showed a gap); a
  replay that shows another process rebuilds the worker from the replay; a connection that
  ends (or another made) while the check replays makes it moot (`_connection_changed_meanwhile`:
  one sequence break for a process replaced meanwhile). One that fails is retried with the
  backoff while the SUB stays connected, and the connection's first message, should it come
  first, rebuilds from itself alone (no second stall), unless it is a live copy
  of a replayed batch (a duplicate: the same process, the SUB connected before it was sent;
  copies read after the check are duplicates too, whichever replay applied them). Without a
  replay endpoint, or when the message comes with the connection, its first message is checked
  so (an engine restart is a new connection; the SUB may have missed the new process's first
  messages, exactly as many as the old one had sent);
- seq == expected: applied (unless the connection's check above is still to be made);
- seq > expected (a gap): replay from the last applied seq. A gap may hide an engine restart
  (the new process's seq already passed the old one while the SUB missed its first messages),
  so the replayed batch at the last applied seq must be byte for byte the one applied: vLLM and
  SGLang replay the very bytes they published, and every batch carries its own timestamp. If it
  differs or is no longer buffered (or there is no replay), or the replay does not cover the
  gap contiguously, the worker is cleared and rebuilt from what the replay buffer holds up to
  the message, and past it to the newest batch the replay brought when it holds the message
  itself (a lagging source catches up at once; their live copies are then duplicates);
  otherwise the replayed batches heal the gap;
- a replay's replies count only as an unbroken run of seqs ending at the newest: a replay
  ROUTER drops replies past its high-water mark and still sends the end marker, so a hole is
  asked for again, and what stays unfilled drops everything before it (`_replay`). A replay
  holds at most `replay_bytes` of replies as they come (`HeldReplies`): past that its oldest
  are dropped, a hole before the newest as an unfilled one is;
- seq < expected: a live copy of a batch the last replay applied (same seq, same bytes) is
  dropped as a duplicate; anything else is an engine restart (seq reset), so the worker is
  cleared and rebuilt as on a first message;
- the SUB's connection ends (the monitor's disconnect; an engine killed publishes no last
  word): the worker is cleared at once, and the next connection rebuilds it from a replay
  from seq 0, as a start does (a sequence break: the publisher may be a new process); after
  a disconnection with nothing applied to clear (nothing published yet, a failed rebuild),
  the next connection rebuilds from the replay all the same. A
  connection that ends while another stays open is no such end (`_OpenConnections`: a binding
  SUB accepts stray connections, a port scan or a TCP probe, besides the publisher's);
- a publisher that falls silent without closing its connection (its host frozen or cut off,
  its process stopped: TCP sees nothing, since a SUB never sends) is found by ZMTP heartbeats
  (`Heartbeat`): the SUB pings it, and a connection that brings nothing back within the
  timeout is closed by libzmq, which is the disconnect above. Only a connection whose ZMTP
  handshake succeeded counts as the publisher back: the kernel of a stopped process still
  accepts TCP connections, and such a connection carries nothing;
- a connecting SUB's connection that ends before its ZMTP handshake on a protocol error (a
  peer of another socket type) restarts the loop as a failure does: libzmq never dials again
  after a protocol error. One whose handshake failed otherwise (it timed out: a stopped
  process, whose kernel still accepts the connection; the peer closed it) is dialled again
  by libzmq itself: the SUB is kept, its link down, and the streak is logged at its 1st, 2nd,
  4th, 8th, ... failure (`_OpenConnections.redials`);
- a sink failure leaves the index in doubt: the loop restarts (with backoff) and the next
  message rebuilds the worker as on a first message; an endpoint ZMQ cannot parse (EINVAL,
  EPROTONOSUPPORT from connect / bind) would fail again on every restart, so it ends `run`
  with a `ConfigError` instead;
- a resync request (`request_resync`: the index backend dropped or lost this worker's entries,
  e.g. Redis restarted empty) clears the worker and rebuilds it from a replay from seq 0 at
  once, between two messages, without waiting for the next one; live messages the replay
  already covered are then dropped as duplicates. Without a replay endpoint it only clears the
  worker (at once, even one its publisher left: a Redis back with older data holds blocks
  cleared since) and the next message rebuilds as on a first message (older blocks stay
  missing, never stale). So does one asked while the publisher is away (its disconnection
  cleared the worker): its next connection rebuilds the worker from the replay, as ever (a
  rebuild before it, taken as done, would miss what the publisher sent before that
  connection). A rebuild of the source's own pending when the index asks (the
  publisher back after a disconnection) is served by the index's, which counts as a resync
  (`resyncs`) and is logged as the index's. A resync whose replay fails is retried as the
  source's own rebuild is (with the backoff while the SUB is connected, else at its next
  connection), until one answers or a message comes (logged as the resync retried). A
  resync asked while a new connection's check is still to be made makes that check first
  (`_resync`): a check that rebuilds the worker serves the resync, and one whose replay
  fails is not followed by the resync's own replay at once (no second stall).

`on_sequence_break`, when given, is called (synchronously) each time a message out of sequence
(a seq reset, a gap the replay does not heal) has cleared the worker after earlier messages,
and when the SUB connects again after a disconnect cleared it:
the publisher may be a new engine process, as `OpenEngineSource.on_sequence_break` says of a
SubscribeKvEvents stream. A first message, a rebuild after a sink failure and a resync request
are no such break.

Live messages come as `[topic, seq, payload]` or, from some senders, `[seq, payload]`; a source
with a topic receives both (see `TWO_FRAME_SUBSCRIPTION`). TCP endpoints on an IPv6 address
(`tcp://[::1]:5557`), or on `*` when binding, get libzmq's IPv6 option (`kvplane.zmq_ip`).

`link` (`indexer.sources.link`) says whether the publisher is connected now, as the monitor
reports its handshakes and disconnections (a publisher nothing answers at never connects): a
SUB reconnects by itself, so `stream_lost` never says it.

A replayed batch of another data-parallel rank than the live stream's (a replay endpoint left
at another rank's port) is counted as bad and dropped; a live batch's rank that differs from
the rank of the batches the worker holds (filled by such a replay at start) makes its gap
check clear and rebuild (`_is_other_ranks`, `_learn_rank`).

Received messages wait for the index in a `ReceiveQueue`, bounded by messages and by bytes
(`receive_hwm`, `receive_queue_bytes`): past either, its oldest are dropped (`_receive`), a
gap the next message shows and the replay heals.

Malformed messages are counted and dropped (`indexer.zmq_decode`); the loop never dies of one
(each logged as a warning only at the source's 1st, 2nd, 4th, 8th, ... bad message,
`_drop_bad_message`; malformed and unknown events likewise, `_drop_bad_events`).
A message whose content the translator or the index refuses (validation, or the bridge's
target refusing it) counts as bad too: its refused batch is dropped (a missing block, never a
stale one) and the stream goes on. A clear the index refuses is logged and leaves the worker
not counted as cleared, so the next clear is sent again (`_reset_worker`).
What these rules cannot see is listed in docs/indexer.md ("Sequence tracking").
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from indexer.batch import Batch
from indexer.engine_events import EventBatch
from indexer.sources.held_replies import DEFAULT_REPLAY_BYTES, HeldReplies
from indexer.sources.link import Link
from indexer.sources.receive_queue import DEFAULT_RECEIVE_QUEUE_BYTES, ReceiveQueue
from indexer.translate import WorkerTranslator
from indexer.validation import IndexRequestError
from indexer.zmq_decode import (
    ArrayTail,
    KvEventDecodeError,
    ZmqMessage,
    decode_frames,
    decode_payload,
    decode_replay_reply,
)
from kvplane.backoff import Backoff
from kvplane.errors import ConfigError
from kvplane.zmq_heartbeat import DEFAULT_HEARTBEAT, Heartbeat
from kvplane.zmq_ip import set_ip_version

log = logging.getLogger(__name__)

SEQ_BYTES = 8
# What ZMQ's prefix filter sees first in a 2-frame message `[seq, payload]`, which has no topic
# frame: its seq, whose first byte is 0 (big-endian, below 2^56). A source with a topic also
# subscribes to it, so that it receives both layouts (a 3-frame message let in by it whose
# topic is not the source's is dropped, `_is_wanted_topic`).
TWO_FRAME_SUBSCRIPTION = b"\x00"
# Why a rebuild from the replay runs with no request from the index (see `_resync`).
_STARTING = "starting"
_RECONNECTED = "the publisher is back"
_INDEX_ASKED = "the index asked for a resync"
_RESYNC_RETRIED = "the index's resync is retried (its replay failed)"
# (Not a rebuild: the check a new connection makes of the stream, `_check_connection`.)
_CONNECTED = "a new connection to the publisher"
# connect / bind errors that no retry can cure: the endpoint itself is malformed.
_BAD_ENDPOINT_ERRNOS = frozenset({zmq.EINVAL, zmq.EPROTONOSUPPORT})
# Replay requests at most per replay: the first, then one per hole left (see `_replay`).
MAX_REPLAY_ROUNDS = 8
# The SUB's own receive queue (ZMQ's, bounded by its count of messages only): the source moves
# each message into its `ReceiveQueue`, bounded by bytes too, as it arrives, so this one fills
# only while the source's event loop is busy; past it, TCP holds the rest back at the publisher.
SUB_QUEUE_MESSAGES = 100
# Messages `_receive` moves in one turn of the event loop at most (a read of a message already
# in the SUB's queue waits for nothing, so it would not let the index run while they come).
RECEIVE_TURN = 32


class BatchSink(Protocol):
    """Where translated batches go: an `IndexBackend`, or a KVIndexer client. A batch the
    index refuses (and would refuse again) raises `IndexRequestError`; any other failure
    leaves the index in doubt."""

    async def apply(self, batch: Batch) -> None: ...


# Told each engine batch's own timestamp (unix seconds, the engine's clock) once the batch is
# in the sink: how the controller measures its event lag.
BatchTimeObserver = Callable[[float], None]


@dataclass(slots=True)
class SourceCounters:
    num_messages: int = 0
    num_bad_messages: int = 0
    num_events: int = 0
    num_bad_events: int = 0
    num_unknown_events: int = 0
    num_batches_applied: int = 0
    num_gaps: int = 0
    num_replays: int = 0
    num_replay_failures: int = 0
    num_replayed_messages: int = 0
    num_duplicates: int = 0
    num_resets: int = 0
    num_restarts: int = 0  # loop restarts after an error (reconnect with backoff)
    num_resyncs: int = 0  # rebuilds the index asked for (request_resync)
    num_queue_drops: int = 0  # evicted from a full receive queue (`ReceiveQueue`)
    # New connections whose check applied batches the SUB missed (`_check_connection`).
    num_connection_heals: int = 0


# What each `SourceCounters` field counts, as the Prometheus HELP of the counter that exports
# it (the indexer's, and the controller's for the engines it follows itself): what an
# operator reads on /metrics, where the field's name says little.
SOURCE_COUNTER_HELP = {
    "num_messages": "KV-event messages received from the engine (ZMQ messages, stream batches)",
    "num_bad_messages": "KV-event messages dropped as undecodable (live or replayed)",
    "num_events": "KV events decoded from the messages",
    "num_bad_events": "KV events dropped as malformed",
    "num_unknown_events": "KV events of a kind this version does not know, dropped",
    "num_batches_applied": "KV-event batches applied to the index",
    "num_gaps": "KV-event batches or messages that skipped sequence numbers",
    "num_replays": "Replays of missed messages asked of the publisher's replay endpoint",
    "num_replay_failures": "Replays that failed (timed out or the endpoint unreachable)",
    "num_replayed_messages": "Messages received in replays",
    "num_duplicates": "Messages skipped as already applied (a replay brought them first)",
    "num_resets": "Times the engine's entries were cleared to rebuild them (at the start too) "
    "or because its publisher disconnected",
    "num_restarts": "KV-event subscriptions restarted after an error",
    "num_resyncs": "KV-event resubscriptions with a snapshot (the index lost the engine's "
    "entries, or its stream skipped)",
    "num_queue_drops": "KV-event messages dropped, the oldest first, from a full receive queue "
    "(the index behind the engine; healed from the replay as gaps)",
    "num_connection_heals": "New connections to the engine's KV-event publisher whose check "
    "applied batches from its replay that the subscription missed (published before the "
    "connection was up; no later batch showed them as a gap)",
}


@dataclass(frozen=True, slots=True)
class _Break:
    """A break in the stream applied so far, found by a replay from its last seq
    (`_continuation`): the worker is rebuilt (`_rebuild`, a sequence break), from `buffered`
    when that replay brought the whole buffer."""

    reason: str
    buffered: list[ZmqMessage] | None = None


class _Checked(enum.Enum):
    """What a new connection's check (`_check_connection`) leaves to a resync made right
    after it (`_resync`)."""

    NOTHING = enum.auto()  # none was pending, it was moot, or the stream went on
    REBUILT = enum.auto()  # the worker rebuilt from a replay made just now: the resync's too
    FAILED = enum.auto()  # its replay failed just now: no second stall on another at once


@dataclass(frozen=True, slots=True)
class ZmqSourceSettings:
    endpoint: str
    replay_endpoint: str | None = None
    # A prefix of the topic frame; messages without one (2 frames) are received either way.
    topic: str = ""
    # Bind the SUB instead of connecting (for publishers that connect, e.g. vLLM configured
    # with an endpoint without `*`).
    bind: bool = False
    array_tail: ArrayTail = "ignore"
    # Longest wait for the next replay reply before the replay counts as failed.
    replay_timeout_s: float = 5.0
    # How a publisher that falls silent without closing its connection is found.
    heartbeat: Heartbeat = DEFAULT_HEARTBEAT
    # With a replay endpoint: rebuild the worker from the replay as the source starts, not at
    # the first message (off only to study the first-message rules alone).
    rebuild_at_start: bool = True
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 5.0
    # The receive queue's bounds, in messages and in bytes (`ReceiveQueue`).
    receive_hwm: int = 100_000
    receive_queue_bytes: int = DEFAULT_RECEIVE_QUEUE_BYTES
    # A replay's replies held until applied, at most, in bytes (`HeldReplies`).
    replay_bytes: int = DEFAULT_REPLAY_BYTES


class ZmqSource:
    def __init__(
        self,
        settings: ZmqSourceSettings,
        translator: WorkerTranslator,
        sink: BatchSink,
        *,
        context: zmq.asyncio.Context | None = None,
        on_batch_time: BatchTimeObserver | None = None,
        on_sequence_break: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.translator = translator
        self.sink = sink
        self.counters = SourceCounters()
        self.on_batch_time = on_batch_time
        self.on_sequence_break = on_sequence_break
        self._context = context or zmq.asyncio.Context.instance()
        # Next seq expected; None until the first message (then the worker is rebuilt).
        self._expected: int | None = None
        # The payload of the last applied message (seq expected - 1), to tell on a gap whether
        # the publisher is still the process that sent it.
        self._last_payload: bytes | None = None
        # Payloads of the batches the last replay applied that may still arrive live (seq ->
        # payload); a live message matching one is a duplicate, not a seq reset.
        self._replayed: dict[int, bytes] = {}
        # A connection was made or accepted and the stream applied so far not checked against
        # the replay since (`_check_connection`): the check runs at once with a replay
        # endpoint, or at the connection's first message when that comes first (or without
        # one).
        self._new_connection = False
        self._progress = asyncio.Condition()
        # Set by request_resync (and at start, with a replay endpoint, and at a new connection:
        # `_want_resync`); handled between two messages. `_resync_cause` says why.
        self._resync_wanted = asyncio.Event()
        self._resync_cause = _STARTING
        # The worker was cleared because the publisher disconnected: its next connection
        # rebuilds it from the replay.
        self._cleared_by_disconnect = False
        # The rebuild from the replay at start (or at a reconnection) failed (the publisher
        # not up yet) or found nothing (its replay ROUTER answered before its first batch and
        # before the SUB's connection): the SUB's next connection retries it. (Waiting for the
        # first message instead left an engine that published before the SUB reached it, then
        # went idle, unindexed: a writer lease taken over while the engine restarted; indexer
        # soak, seeds 6 and 13.)
        self._rebuild_at_connection = False
        # The rebuild from the replay at start (or at a reconnection, or a new connection's
        # check) failed while the SUB was connected: no connection is coming to retry it, so it
        # is retried after a backoff (`_retry_replay`); the pending retry, and the waits
        # before the next ones: from the shortest again once a replay answers, whatever asked
        # it (`_replay`: a resync, a gap, a connection's check), and at a new connection.
        self._start_replay_retry: asyncio.TimerHandle | None = None
        self.replay_backoff = Backoff(settings.backoff_initial_s, settings.backoff_max_s)
        # Replays failed since the last one that answered: a dead replay ROUTER beside a live
        # PUB fails every retry, so only the 1st, 2nd, 4th, 8th, ... of a streak warn.
        self._replay_failures_in_a_row = 0
        # The last replay on the SUB's present connection failed (timed out): the rebuild at
        # the first message does not ask again at once, which would stall the source twice as
        # long on a replay endpoint that never answers (the rebuild at the connection, then
        # the first message's). Forgotten when a replay answers and when a connection is made
        # or ends.
        self._replay_failed_on_connection = False
        # The SUB's monitor and its open connections while `_follow` runs (None otherwise).
        self._monitor: tuple[zmq.asyncio.Socket, _OpenConnections] | None = None
        if settings.replay_endpoint and settings.rebuild_at_start:
            self._resync_wanted.set()
        self.last_seq: int | None = None
        # The data-parallel rank the live stream's batches carry (None until one says), and
        # whether replayed batches of another rank were warned about (`_is_other_ranks`).
        self._live_rank: int | None = None
        self._warned_other_rank = False
        # Whether a replay holding batches under other topics only was warned of: a `topic`
        # the publisher never sends is said once, not at every replay (a start asks twice when
        # the SUB connects after the start's replay), until a replay holds the source's.
        self._warned_foreign_topic = False
        # The rank of the batches the worker holds (None when none said): a start's replay
        # runs before any live batch tells the stream's rank.
        self._applied_rank: int | None = None
        # This source cleared its worker and has written nothing to it since: a rebuild need
        # not clear it again (the first message after an empty replay at start cleared it a
        # second time, two resets on a healthy run). Forgotten when the index may hold
        # something else: at each (re)start of the loop, at a resync the index asks for (it
        # may have come back with older data) and at the next write.
        self._worker_clear = False
        # Whether the publisher is connected now, as the SUB's monitor says (`_OpenConnections`).
        self.link = Link(f"connecting to {settings.endpoint}")
        # Whether a failed connection to a publisher never reached was warned of.
        self._warned_unreachable = False
        # Connections in a row whose ZMTP handshake failed without a protocol error (a
        # stopped publisher), since the last that succeeded (`_on_end_before_handshake`).
        self._silent_handshakes = 0
        # Set once the SUB socket is connected (or bound): for callers that must not publish
        # before a binding source listens.
        self.ready = asyncio.Event()
        # The messages received and not handled yet (emptied when the SUB is made anew).
        self.receive_queue = ReceiveQueue(settings.receive_hwm, settings.receive_queue_bytes)

    @property
    def worker_id(self) -> str:
        return self.translator.options.worker_id

    @property
    def stream_lost(self) -> bool:
        """Never: a SUB socket reconnects by itself, and a restarted publisher is found by its
        sequence numbers (`Resyncable.stream_lost`)."""
        return False

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        """Wait (at most `timeout_s`) until `predicate()` holds after some message was handled."""
        async with asyncio.timeout(timeout_s), self._progress:
            await self._progress.wait_for(predicate)

    def request_resync(self, worker_id: str | None = None) -> None:
        """The index dropped or lost this worker's entries: clear and rebuild it (from a replay
        from seq 0) before the next message. Synchronous, for index-backend callbacks.
        (`worker_id` matters to sources feeding several workers; this one feeds one.)"""
        self._resync_cause = _INDEX_ASKED
        self._worker_clear = False
        self._resync_wanted.set()

    def _want_resync(self, cause: str) -> None:
        """Have the loop rebuild the worker from the replay (or check the stream against it, at
        a new connection) between two messages, for `cause` (`_resync`). A resync the index
        asked for and still pending stays the one that runs: it clears and rebuilds the worker
        from the replay, which serves whatever else asked, and it counts as the index's
        (`resyncs`; before, a reconnection's rebuild took it over, uncounted)."""
        if not (self._resync_wanted.is_set() and self._resync_cause == _INDEX_ASKED):
            self._resync_cause = cause
        self._resync_wanted.set()

    async def run(self) -> None:
        """Follow the publisher until cancelled; restart with backoff after any error. A streak
        of failures with no batch applied between them (a bind on an address taken or not
        this host's, an index that stays down) logs its 1st, 2nd, 4th, 8th, ... failure as an
        error, the rest at debug level; one that follows applied batches starts a new streak,
        from the shortest backoff."""
        backoff = Backoff(self.settings.backoff_initial_s, self.settings.backoff_max_s)
        failures = 0  # in a row
        applied = self.counters.num_batches_applied  # when the last one happened
        while True:
            self._worker_clear = False  # what the index holds is not this loop's to know
            try:
                await self._follow()
            except (asyncio.CancelledError, ConfigError):
                raise
            except Exception as exc:
                if self.counters.num_batches_applied != applied:
                    failures = 0
                    backoff.reset()
                applied = self.counters.num_batches_applied
                failures += 1
                self.counters.num_restarts += 1
                self._expected = None  # the index is in doubt: rebuild on the next message
                self.link.went_down(f"restarting after an error: {exc!r}")
                delay_s = backoff.take()
                log.log(
                    _sparse_level(failures - 1, failures, logging.ERROR),
                    "zmq source %s (worker %s) failed%s; retrying in %.1fs",
                    self.settings.endpoint,
                    self.worker_id,
                    f" ({failures} times in a row)" if failures > 1 else "",
                    delay_s,
                    exc_info=True,
                )
                if self._resync_wanted.is_set():  # pending from before: no shortcut
                    await asyncio.sleep(delay_s)
                else:  # a resync request (the index is back) ends the wait early
                    with contextlib.suppress(TimeoutError):  # (see `_replay` on wait_for)
                        async with asyncio.timeout(delay_s):
                            await self._resync_wanted.wait()

    async def _follow(self) -> None:
        sub = self._context.socket(zmq.SUB)
        # Reports each connection before any message can arrive on it: once its ZMTP handshake
        # succeeded, not at its TCP connect or accept (the kernel of a stopped publisher still
        # accepts; such a connection brings nothing and ends at the handshake's timeout).
        # (Failed connection attempts only for `_warn_unreachable`.)
        connections = sub.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_DISCONNECTED
            | _OpenConnections.OPENED
            | zmq.EVENT_CONNECT_RETRIED
        )
        # A connection that ends while another is still open is not the publisher leaving.
        open_connections = _OpenConnections()
        self._monitor = (connections, open_connections)
        recv: asyncio.Future[list[bytes]] | None = None
        # Ready when the monitor has events: a publisher that goes away or comes back is acted
        # on while no message comes (an engine killed, or restarted idle, publishes nothing).
        # (Its result is not read: pyzmq's stubs type a socket's poll as a Poller's.)
        monitored: asyncio.Future[object] | None = None
        waker = asyncio.ensure_future(self._resync_wanted.wait())
        self._replay_failed_on_connection = False  # a new SUB: a new connection
        self.receive_queue.clear()
        receiver: asyncio.Future[None] | None = None
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, SUB_QUEUE_MESSAGES)
            sub.setsockopt(zmq.RECONNECT_IVL, int(self.settings.backoff_initial_s * 1000))
            sub.setsockopt(zmq.RECONNECT_IVL_MAX, int(self.settings.backoff_max_s * 1000))
            self.settings.heartbeat.apply_to(sub)
            for prefix in _subscriptions(self.settings.topic):
                sub.setsockopt(zmq.SUBSCRIBE, prefix)
            self._attach(sub)
            log.info("zmq source %s -> worker %s", self.settings.endpoint, self.worker_id)
            receiver = asyncio.ensure_future(self._receive(sub))
            self.ready.set()
            while True:
                if self._resync_wanted.is_set():
                    self._resync_wanted.clear()
                    try:
                        await self._resync()
                    except BaseException:
                        self._resync_wanted.set()  # retried after the restart
                        raise
                    async with self._progress:
                        self._progress.notify_all()
                    continue
                if recv is None:
                    recv = self.receive_queue.next()
                if monitored is None:
                    monitored = asyncio.ensure_future(_readable(connections))
                if not recv.done():  # (done already when a message was queued)
                    await asyncio.wait(
                        (recv, waker, monitored, receiver), return_when=asyncio.FIRST_COMPLETED
                    )
                    if receiver.done():
                        receiver.result()  # the SUB failed: restart
                    if waker.done():
                        waker = asyncio.ensure_future(self._resync_wanted.wait())
                    if not recv.done():
                        # (A message received already goes first: the events read with it
                        # say whether it is a departed publisher's last word. Not the SUB's
                        # own EVENTS: reading them eats the edge `_receive`'s read waits for.)
                        if monitored.done() and not self.receive_queue:
                            monitored = None
                            if await self._handle_queued_connection_events():
                                async with self._progress:
                                    self._progress.notify_all()
                        continue
                frames = recv.result()
                recv = None
                events = await self._queued_publisher_events()
                # Messages of a connection come before its end: with no connection since, this
                # one is the departed publisher's last word, applied before its worker is
                # cleared (the other way round, it would be the only stale thing left).
                ended = bool(events) and events[-1] == zmq.EVENT_DISCONNECTED
                if not ended:
                    await self._on_connection_events(events)
                try:
                    message = decode_frames(frames)
                except KvEventDecodeError as exc:
                    self._drop_bad_message("bad message from %s: %s", self.settings.endpoint, exc)
                else:
                    if _is_wanted_topic(message.topic, self.settings.topic):
                        await self._on_message(message)
                if ended:
                    await self._on_connection_events(events)
                async with self._progress:
                    self._progress.notify_all()
        finally:
            self._monitor = None
            if self._start_replay_retry is not None:  # the source stops or restarts
                self._start_replay_retry.cancel()
                self._start_replay_retry = None
            waker.cancel()
            if receiver is not None:
                receiver.cancel()
            if recv is not None:
                recv.cancel()
            if monitored is not None:
                monitored.cancel()
            if not sub.closed:  # (a destroyed context closed it already)
                sub.disable_monitor()
            connections.close(linger=0)
            sub.close(linger=0)

    async def _receive(self, sub: zmq.asyncio.Socket) -> None:
        """Move each message from the SUB into the receive queue as it arrives. A full queue
        drops its oldest messages (counted, warned of at the 1st, 2nd, 4th, 8th, ... drop):
        `_on_message` sees the gap at the next message it reads and heals it from the replay."""
        for received in itertools.count(1):
            frames = await sub.recv_multipart()
            self.counters.num_messages += 1
            dropped = self.receive_queue.put(frames)
            if dropped:
                before = self.counters.num_queue_drops
                self.counters.num_queue_drops += dropped
                log.log(
                    _sparse_level(before, self.counters.num_queue_drops),
                    "worker %s: the receive queue is full (%d messages, %d bytes at most): "
                    "dropped its %d oldest (%d so far); the index is behind the publisher, "
                    "the gap is healed from the replay",
                    self.worker_id,
                    self.settings.receive_hwm,
                    self.settings.receive_queue_bytes,
                    dropped,
                    self.counters.num_queue_drops,
                )
            if received % RECEIVE_TURN == 0:  # the index's turn, while messages keep coming
                await asyncio.sleep(0)

    async def _on_connection_events(self, events: list[int]) -> None:
        """Act on the SUB's monitor events. A connection made or accepted (its handshake done)
        has the stream applied so far checked against the replay at once (`_new_connection`,
        `_check_connection`): what the publisher sent before the SUB's connection was up is
        lost to the SUB, and an idle publisher sends nothing after it that would show the gap.
        A disconnection means the publisher went away (its process ended: a killed engine
        publishes no last word, or it fell silent past the heartbeat timeout): the blocks
        indexed from it are cleared at once rather than left stale until it publishes again,
        which a dead engine never does. The next connection (the engine back, restarted or
        not) then rebuilds the worker from the replay at once, as a start does."""
        ends = [i for i, event in enumerate(events) if event == zmq.EVENT_DISCONNECTED]
        if ends:
            self._replay_failed_on_connection = False  # (the connection it failed on)
        # Connections made after the last end (one that came and went is no publisher now).
        connected_since = len(events) > (ends[-1] + 1 if ends else 0)
        if connected_since:
            self._new_connection = True
            # A replay that failed before this connection (the start's, made while the SUB
            # was connecting) did not fail on it: its first message asks the replay again.
            self._replay_failed_on_connection = False
            if self._warned_unreachable and not self.link.ever_up:
                log.info("worker %s: reached publisher %s", self.worker_id, self.settings.endpoint)
            self.link.went_up()
            self._silent_handshakes = 0
            # A failed start replay on this connection is retried from the shortest wait.
            self.replay_backoff.reset()
        elif ends:
            self._new_connection = False
            self.link.went_down(f"publisher {self.settings.endpoint} disconnected")
        if ends and self._expected is not None:
            log.warning(
                "worker %s: publisher %s disconnected; clearing the worker until it is back",
                self.worker_id,
                self.settings.endpoint,
            )
            self._cleared_by_disconnect = True
            await self._reset_worker(self.last_seq or 0)
        elif ends:
            # Nothing applied since the start, a reset or a resync (an idle engine, or a
            # rebuild whose replay failed): the next connection may be a new process that
            # publishes before the SUB's reconnect reaches it and then goes idle, so it
            # rebuilds from the replay as a start's pending one does (before, the worker
            # missed that batch until the engine's next one; tests/indexer/
            # test_zmq_intake_property.py found it).
            self._rebuild_at_connection = True
        # (A rebuild pending from the start matters only while nothing is applied: the first
        # message may have rebuilt the worker since, and this connection's first message is then
        # checked as any new connection's.)
        rebuild_pending = self._rebuild_at_connection and self._expected is None
        if self._new_connection and (self._cleared_by_disconnect or rebuild_pending):
            # The rebuild shows which process publishes now: nothing left to check.
            sequence_break = self._cleared_by_disconnect
            self._new_connection = self._cleared_by_disconnect = False
            self._rebuild_at_connection = False
            if self.settings.replay_endpoint:
                self._want_resync(_RECONNECTED)
            if sequence_break and self.on_sequence_break is not None:  # maybe a new process
                self.on_sequence_break()
        if self._new_connection and self._expected is not None and self.settings.replay_endpoint:
            # The worker holds batches a replay brought before this connection (the start's,
            # a resync's): the publisher may have published after that replay and before the
            # connection, then gone idle (before, its first message checked, and the worker
            # missed those batches until the engine's next one; tests/indexer/
            # test_zmq_intake_property.py found it). Without a replay endpoint the first
            # message rebuilds.
            self._want_resync(_CONNECTED)
        # (An end followed by a connection read with it: the SUB is connected again, however
        # that end came.)
        if ends and not connected_since and not self.settings.bind and self._monitor is not None:
            self._on_end_before_handshake(self._monitor[1])

    def _on_end_before_handshake(self, open_connections: _OpenConnections) -> None:
        """The SUB's last connection ended before its ZMTP handshake (if it did). libzmq dials
        again after a handshake that timed out or a connection the peer closed (a silent peer:
        a stopped process, whose kernel still accepts connections), not after a protocol error
        (a peer of another socket type): the SUB would then stay unconnected for good, so the
        source restarts it (with its backoff). The other kind keeps the SUB: restarting it
        would only dial the same silent peer again, and count a failure each time."""
        if not open_connections.ended_before_handshake:
            return
        if open_connections.redials:
            self._silent_handshakes += 1
            reason = (
                f"publisher {self.settings.endpoint} accepted the connection but did not "
                f"complete its ZMTP handshake within {self.settings.heartbeat.timeout_s:g} s "
                "(a stopped or frozen process?); ZMQ dials again"
            )
            self.link.went_down(reason)
            log.log(
                _sparse_level(self._silent_handshakes - 1, self._silent_handshakes),
                "worker %s: %s (%d times in a row)",
                self.worker_id,
                reason,
                self._silent_handshakes,
            )
            return
        raise ConnectionError(
            f"the connection to {self.settings.endpoint} ended before its ZMTP handshake: "
            "no ZMQ publisher answers there (a socket of another type, e.g. the replay "
            "endpoint's ROUTER)"
        )

    async def _handle_queued_connection_events(self) -> bool:
        """Act on the SUB's monitor events queued so far (`_on_connection_events`); whether
        there were any of the publisher's."""
        events = await self._queued_publisher_events()
        if events:
            await self._on_connection_events(events)
        return bool(events)

    async def _queued_publisher_events(self) -> list[int]:
        """The SUB's monitor events queued so far, reduced to the publisher's handshakes and
        ends (`_OpenConnections`); failed connection attempts are told to
        `_warn_unreachable`."""
        if self._monitor is None:
            return []
        connections, open_connections = self._monitor
        events = await _connection_events(connections)
        if any(event == zmq.EVENT_CONNECT_RETRIED for event, _ in events):
            self._warn_unreachable()
        return open_connections.publisher_events(
            [(event, value) for event, value in events if event != zmq.EVENT_CONNECT_RETRIED]
        )

    def _warn_unreachable(self) -> None:
        """ZMQ failed to connect to a publisher the source has never reached (a wrong host or
        port, a firewall, an engine not up yet): ZMQ retries silently for ever, so say it
        once, the first time. (A publisher that was reached and went away was warned of at
        its disconnection.)"""
        if self.link.ever_up or self._warned_unreachable:
            return
        self._warned_unreachable = True
        log.warning(
            "worker %s: cannot reach publisher %s yet (ZMQ keeps retrying, every %.1f s at "
            "most); the worker stays unindexed until it answers",
            self.worker_id,
            self.settings.endpoint,
            self.settings.backoff_max_s,
        )

    def _attach(self, sub: zmq.asyncio.Socket) -> None:
        """Connect (or bind) the SUB; a malformed endpoint is a `ConfigError`, not retried."""
        try:
            set_ip_version(sub, self.settings.endpoint)
            if self.settings.bind:
                sub.bind(self.settings.endpoint)
            else:
                sub.connect(self.settings.endpoint)
        except zmq.ZMQError as exc:
            if exc.errno in _BAD_ENDPOINT_ERRNOS:
                raise ConfigError(
                    f"cannot {'bind' if self.settings.bind else 'connect'} ZMQ endpoint "
                    f"{self.settings.endpoint!r}: {zmq.strerror(exc.errno)}"
                ) from exc
            raise

    async def _resync(self) -> None:
        """Clear the worker and rebuild it from a replay from seq 0 (see the module docstring).
        At start a failed replay changes nothing (it is retried, see below) and an empty one
        only clears: the first message then rebuilds the worker as ever. At a new connection
        (`_CONNECTED`), check the stream applied so far against the replay instead
        (`_check_connection`).

        A connection's check still pending (wanted, or to be retried after its replay failed)
        is made first, whatever else asked. (A resync the index asked for took its place
        (`_want_resync`), and the check, left pending, ran at the first message against the
        resync's replay: one replay for nothing, and another process behind the connection
        was never told as a sequence break.) The resync's replay is no such check: it shows
        what the publisher holds, not whether that goes on from the batches the worker held
        before it was cleared. And a replay here that answers ends a check left pending by its
        own failed replay: the worker is rebuilt from this one, made with the connection up,
        which holds whatever the publisher sent before the connection. A check that rebuilt
        the worker (another process) did so from a replay made after whatever asked: that
        serves the resync too (before, the resync's replay rebuilt it a second time). One
        whose replay failed just now leaves the resync to clear the worker and retry its
        rebuild, without a second replay at once (which stalled the source twice as long)."""
        cause = self._resync_cause
        checked = await self._check_connection()  # (a no-op unless one is pending)
        if cause == _CONNECTED:
            return
        if checked is _Checked.REBUILT:
            if cause == _INDEX_ASKED:
                self.counters.num_resyncs += 1
                log.warning(
                    "worker %s: %s; served by the connection's rebuild", self.worker_id, cause
                )
            return
        floor = self._expected
        # Rebuilding a worker this source cleared itself (or has not filled yet): not a resync
        # the index asked for. One the index asked for clears the worker even with nothing to
        # rebuild it from: a Redis back with older data holds blocks this source cleared (a
        # departed publisher's, which sends no next message to clear them).
        starting = cause in (_STARTING, _RECONNECTED, _RESYNC_RETRIED)
        if starting and floor is None and not self.settings.replay_endpoint:
            return  # the next message clears and rebuilds the worker anyway
        if starting and floor is not None:
            return  # a message since the start or reconnection has rebuilt the worker already
        if starting:  # (a retry of a failed one says so only when it fails)
            log.log(
                logging.DEBUG if self._replay_failures_in_a_row else logging.INFO,
                "worker %s: %s; rebuilding it from the replay",
                self.worker_id,
                cause,
            )
        else:
            self.counters.num_resyncs += 1
            log.warning("worker %s: %s; clearing and rebuilding", self.worker_id, cause)
        # A publisher away (its end cleared the worker) is not rebuilt from its replay until its
        # next connection does it (`_cleared_by_disconnect`): rebuilt now, the connection would
        # take the rebuild as done, and miss what the publisher sent before it.
        away = self._cleared_by_disconnect
        replies = None if checked is _Checked.FAILED or away else await self._replay(0)
        if replies is not None:
            self._new_connection = False  # (see above)
        if starting:
            await self._refill(replies, cause)
            return
        # Seqs an earlier replay applied whose live copies may still be queued (this may be
        # the second replay before the first message: the start's replay set `floor`).
        still_queued = self._replayed
        await self._reset_worker(self.last_seq or 0)
        if replies is None:  # no replay (or it failed): the next message rebuilds, retrying it
            if self.settings.replay_endpoint:
                self._retry_replay(_RESYNC_RETRIED)  # (a reconnection's it served, too)
            return
        for reply in replies:
            await self._apply(reply, replayed=True)
        if not replies:
            self._expected = floor
        else:
            # Live messages still queued (seq >= floor, or replayed before and not seen live
            # since) were replayed: drop them as duplicates. (A replay that ends before
            # `floor` is healed as a gap by the next message.)
            self._replayed = {
                r.seq: r.payload
                for r in replies
                if floor is None or r.seq >= floor or r.seq in still_queued
            }

    async def _refill(self, replies: list[ZmqMessage] | None, cause: str) -> None:
        """Rebuild the worker, with nothing applied since it was cleared or the source started,
        from `replies`: a replay (of the whole buffer) made just now for `cause` (`_STARTING`,
        `_RECONNECTED`, `_RESYNC_RETRIED`), None when it failed.
        Failed (None) or empty: retried at the SUB's next connection, or rebuilt by the first
        message, whichever comes first. When the SUB connected while the replay ran (its
        connection is handled first), an empty replay is not retried: the SUB then receives
        whatever the replay could not hold; a failed one is retried after a backoff (the
        publisher may have published before that connection, then gone idle)."""
        if not replies:
            if replies is not None:
                # The publisher holds nothing it published: the worker's entries are stale.
                await self._reset_worker(self.last_seq or 0)
            await self._handle_queued_connection_events()
            if replies is None:
                self._retry_replay(cause)
            else:
                self._rebuild_at_connection = not self.link.up
            return
        await self._reset_worker(self.last_seq or 0)
        for reply in replies:
            await self._apply(reply, replayed=True)
        # Their live copies may still be queued, or come: duplicates.
        self._replayed = {r.seq: r.payload for r in replies}

    def _retry_replay(self, cause: str) -> None:
        """A rebuild from the replay (or a new connection's check, `_CONNECTED`) failed: retry
        it at the SUB's next connection, or, while the SUB is connected (no connection is
        coming to retry it), after the source's backoff (`replay_backoff`: doubling, as
        `run`'s, and short again once a replay answers or a connection is made): a publisher
        that published before that connection and went idle sends no message that would
        rebuild the worker (nor clear what an earlier process of it left in the index), or
        show the gap."""
        if not self.link.up:
            if cause != _CONNECTED:  # (a new connection is checked anyway)
                self._rebuild_at_connection = True
            return
        self._rebuild_at_connection = False
        if self._start_replay_retry is not None:
            self._start_replay_retry.cancel()
        self._start_replay_retry = asyncio.get_running_loop().call_later(
            self.replay_backoff.take(), self._retry_replay_now, cause
        )

    def _retry_replay_now(self, cause: str) -> None:
        """The retry's time has come: rebuild from the replay (or check the connection), as
        the failed attempt would have, unless a message has rebuilt the worker (or checked
        the connection) meanwhile or a rebuild is pending already. A SUB that lost its
        connection meanwhile retries at its next one instead."""
        self._start_replay_retry = None
        if self._resync_wanted.is_set():
            return
        if cause == _CONNECTED:
            if self._new_connection and self._expected is not None and self.link.up:
                self._want_resync(cause)
            return
        if self._expected is not None:
            return
        if self.link.up:
            self._want_resync(cause)
        else:
            self._rebuild_at_connection = True

    async def _on_message(self, message: ZmqMessage) -> None:
        expected = self._expected
        new_connection, self._new_connection = self._new_connection, False
        if expected is None:
            await self._rebuild(message, reason=None)
        elif new_connection and self._replay_failed_on_connection and message.seq >= expected:
            # The connection's check failed (`_resync`): rebuilt from this message alone,
            # rather than stall the source on a second replay. (A live copy of a replayed
            # batch shows the same process, the SUB connected before it: a duplicate.)
            await self._rebuild(message, reason="no replay to check the new connection against")
        elif message.seq == expected and not new_connection and not self._is_new_rank(message):
            self._replayed = {}  # past any replayed range
            await self._apply(message)
        elif message.seq >= expected:
            if message.seq > expected:
                self.counters.num_gaps += 1
                log.warning(
                    "worker %s: gap, expected seq %d, got %d",
                    self.worker_id,
                    expected,
                    message.seq,
                )
            else:
                log.info("worker %s: new connection; checking the stream goes on", self.worker_id)
            await self._heal_gap(expected, message)
        elif self._replayed.get(message.seq) == message.payload:
            self.counters.num_duplicates += 1
        else:
            log.warning(
                "worker %s: seq went back from %d to %d (engine restart)",
                self.worker_id,
                expected - 1,
                message.seq,
            )
            await self._rebuild(message, reason="seq reset")

    async def _apply(self, message: ZmqMessage, *, replayed: bool = False) -> None:
        """Decode, translate and apply one message (a malformed payload is counted, and so is
        a replayed batch of another data-parallel rank than the live stream's)."""
        try:
            batch = decode_payload(message.payload, array_tail=self.settings.array_tail)
        except KvEventDecodeError as exc:
            self._drop_bad_message("seq %d: %s", message.seq, exc)
        else:
            if self._is_other_ranks(batch, replayed=replayed):
                self.counters.num_bad_messages += 1  # (warned once per run, by the check)
            else:
                self.counters.num_events += len(batch.events)
                self._drop_bad_events(message.seq, batch)
                await self._index(batch, message.seq)
                if self.on_batch_time is not None:
                    self.on_batch_time(batch.ts)
        # A malformed payload still consumes its seq: it is not a gap to heal.
        self._expected = message.seq + 1
        self.last_seq = message.seq
        self._last_payload = message.payload

    def _is_new_rank(self, message: ZmqMessage) -> bool:
        """Whether a live message is the first to tell the stream's data-parallel rank, and
        another than the replayed batches' the worker holds (a replay endpoint left at another
        rank's port filled the worker before any live batch; the connection's check had no
        live rank to hold them against): then it is checked as a gap is, which rebuilds."""
        if self._live_rank is not None or self._applied_rank is None:
            return False
        self._learn_rank(message)
        return self._live_rank not in (None, self._applied_rank)

    def _learn_rank(self, message: ZmqMessage) -> None:
        """Take the data-parallel rank a live message's batch carries as the stream's (before
        a rebuild or a gap's replay: a replay endpoint left at another rank's port must not
        fill the worker; see `_is_other_ranks`)."""
        with contextlib.suppress(KvEventDecodeError):
            batch = decode_payload(message.payload, array_tail=self.settings.array_tail)
            if batch.data_parallel_rank is not None:
                self._live_rank = batch.data_parallel_rank

    def _is_other_ranks(self, batch: EventBatch, *, replayed: bool) -> bool:
        """Whether a replayed batch is another data-parallel rank's than the live stream's (the
        replay endpoint is another rank's: vLLM and SGLang offset both ports by the rank, and
        a replay endpoint left at another rank's port would rebuild the worker from that
        rank's blocks); a live batch tells the stream's rank."""
        rank = batch.data_parallel_rank
        if not replayed:
            if rank is not None:
                self._live_rank = self._applied_rank = rank
            return False
        if rank is None or self._live_rank is None or rank == self._live_rank:
            self._warned_other_rank = False
            if rank is not None:
                self._applied_rank = rank
            return False
        if not self._warned_other_rank:  # once per run of them (a rebuild replays thousands)
            self._warned_other_rank = True
            log.warning(
                "worker %s: dropping replayed batches of data-parallel rank %d: the live stream "
                "from %s is rank %d's; is replay endpoint %s that rank's (its port offset by "
                "the rank, as the endpoint's)?",
                self.worker_id,
                rank,
                self.settings.endpoint,
                self._live_rank,
                self.settings.replay_endpoint,
            )
        return True

    async def _index(self, batch: EventBatch, seq: int) -> None:
        """Translate and apply one decoded message. What its content causes (a translation
        error, a batch the index refuses: invalid, or refused by the bridge's target) makes
        it a bad message: it would fail again on every rebuild, so it must not restart the
        loop. Any other sink failure (e.g. Redis down) raises: the index is in doubt."""
        self._worker_clear = False  # (the translator's state changes too, even if it fails)
        try:
            index_batches = self.translator.translate(batch.events, seq=seq)
        except Exception as exc:
            self._drop_bad_message("seq %d: translation failed: %r", seq, exc, exc_info=True)
            return
        refusal: IndexRequestError | None = None
        for index_batch in index_batches:
            try:
                await self.sink.apply(index_batch)
            except IndexRequestError as exc:
                refusal = exc
                continue
            self.counters.num_batches_applied += 1
        if refusal is not None:
            self._drop_bad_message("seq %d: the index refused a batch of it: %s", seq, refusal)

    def _drop_bad_message(self, what: str, *args: object, exc_info: bool = False) -> None:
        """Count a message dropped as bad (`what % args` says which and why) and log it: a
        warning for the 1st, 2nd, 4th, 8th, ... of the source's, the rest at debug level (a
        publisher of another format, or a stray sender, sends nothing else: a warning per
        message would flood the log; `bad_messages` counts them all)."""
        self.counters.num_bad_messages += 1
        count = self.counters.num_bad_messages
        log.log(
            _sparse_level(count - 1, count),
            "worker %s: dropping " + what + " (%d bad messages so far)",
            self.worker_id,
            *args,
            count,
            exc_info=exc_info,
        )

    def _drop_bad_events(self, seq: int, batch: EventBatch) -> None:
        """Count a batch's malformed and unknown events (its other events are applied) and
        log them as `_drop_bad_message` does: when either count reaches the next power of
        two (an engine newer than this version publishes a kind of event in every batch)."""
        if not batch.num_bad_events and not batch.num_unknown_events:
            return
        counters = self.counters
        bad, unknown = counters.num_bad_events, counters.num_unknown_events
        counters.num_bad_events += batch.num_bad_events
        counters.num_unknown_events += batch.num_unknown_events
        log.log(
            max(
                _sparse_level(bad, counters.num_bad_events),
                _sparse_level(unknown, counters.num_unknown_events),
            ),
            "worker %s: seq %d had %d malformed and %d unknown events%s, skipped (%d and %d "
            "so far); its other events are applied",
            self.worker_id,
            seq,
            batch.num_bad_events,
            batch.num_unknown_events,
            _named_types(batch.unknown_types),
            counters.num_bad_events,
            counters.num_unknown_events,
        )

    async def _reset_worker(self, seq: int) -> None:
        """Clear the worker in the index; the stream's place is forgotten with it (the next
        message rebuilds, unless a replay applied after this sets it again). A worker this
        source cleared and has written nothing to since is not cleared again (nor counted).
        A clear the index refuses (`IndexRequestError`: the bridge's target answered a status
        that would come again) is logged and the stream goes on, the worker not taken as
        clear nor the clear counted as a reset: the next clear is sent again, and what the
        index holds of the worker meanwhile may be stale."""
        self._expected = None
        self._replayed = {}
        self._applied_rank = None
        if self._worker_clear:
            return
        try:
            await self.sink.apply(self.translator.reset(seq=seq))
        except IndexRequestError as exc:
            log.warning(
                "worker %s: the index refused to clear it (%s); what it holds of the worker "
                "may be stale until a later clear lands",
                self.worker_id,
                exc,
            )
            return
        self.counters.num_resets += 1  # (a clear that did not land cleared nothing)
        self.counters.num_batches_applied += 1
        self._worker_clear = True

    async def _rebuild(
        self,
        trigger: ZmqMessage | None,
        *,
        reason: str | None,
        buffered: list[ZmqMessage] | None = None,
    ) -> None:
        """Clear the worker, then rebuild it from the replay buffer (if any) and `trigger`,
        up to the newest batch the replay brought (a source lagging behind its publisher
        catches up at once). A `reason` is a break in a stream followed until now (see
        `on_sequence_break`). `buffered`: what a replay made just now says the buffer holds
        (the whole buffer, or nothing when it failed), not asked for again; None: replay from
        seq 0 (unless the last replay on this connection failed: from `trigger` alone). No
        `trigger` (a new connection's check, `_check_connection`): from the replay alone,
        retried as a reconnection's rebuild is when it fails (`_refill`)."""
        if reason is not None:
            log.warning("worker %s: clearing and rebuilding (%s)", self.worker_id, reason)
        if trigger is None:
            await self._reset_worker(self.last_seq or 0)
            replies = buffered if buffered is not None else await self._replay(0)
            await self._refill(replies, _RECONNECTED)
            if reason is not None and self.on_sequence_break is not None:
                self.on_sequence_break()
            return
        self._learn_rank(trigger)  # before the replay, whose batches must be of that rank
        await self._reset_worker(trigger.seq)
        newer: list[ZmqMessage] = []
        if trigger.seq > 0:
            if buffered is None and not self._replay_failed_on_connection:
                buffered = await self._replay(0)
            # The replay's seqs are consecutive. Its batches before the trigger count when
            # they run up to it, those after it when it holds the trigger itself (the same
            # bytes: the same process): after the clear, a rebuild that starts late only
            # misses blocks; one that skipped a batch would keep what that batch removed.
            replies = buffered or []
            before = [r for r in replies if r.seq < trigger.seq]
            if before and before[-1].seq + 1 == trigger.seq:
                for reply in before:
                    await self._apply(reply, replayed=True)
            if any(r.seq == trigger.seq and r.payload == trigger.payload for r in replies):
                newer = [r for r in replies if r.seq > trigger.seq]
        await self._apply(trigger)
        for reply in newer:
            await self._apply(reply, replayed=True)
        # Their live copies, still to come, are duplicates.
        self._replayed = {r.seq: r.payload for r in newer}
        if reason is not None and self.on_sequence_break is not None:
            self.on_sequence_break()

    async def _heal_gap(self, expected: int, trigger: ZmqMessage) -> None:
        """Heal the gap (possibly empty, a new connection's first message) before `trigger`
        from one replay from the last applied seq (`_continuation`), or clear and rebuild the
        worker when the replay shows another publisher process (see the module docstring) or
        cannot cover the gap."""
        last = expected - 1
        self._learn_rank(trigger)
        found = await self._continuation(last, rank_known=True)
        if found is None:  # (one that failed is not asked again at once: `_rebuild`)
            found = _Break("no replay to check the stream against")
        elif isinstance(found, list) and (found[-1].seq if found else last) + 1 < trigger.seq:
            found = _Break("replay cannot cover the gap")
        if isinstance(found, _Break):
            await self._rebuild(trigger, reason=found.reason, buffered=found.buffered)
            return
        for reply in found:
            await self._apply(reply, replayed=True)
        # Live messages after the trigger that the replay already applied are duplicates.
        self._replayed = {r.seq: r.payload for r in found if r.seq > trigger.seq}
        if trigger.seq >= (self._expected or 0):
            await self._apply(trigger)
        else:
            self.counters.num_duplicates += 1

    async def _check_connection(self) -> _Checked:
        """Check the stream applied so far against one replay from the last applied seq
        (`_continuation`) as a new connection is made (`_resync`), unless nothing is applied
        or a message has checked it since (`_new_connection`). What the replay brought after
        the last applied seq is applied: what the publisher sent before the SUB's connection
        was up never comes live. A replay that shows another process rebuilds the worker from
        the replay; one that fails leaves the check to a retry or to the first message."""
        expected = self._expected
        if not self._new_connection or expected is None:
            return _Checked.NOTHING
        self._new_connection = False
        # (With no live batch yet, no rank to hold the replayed ones against: `_is_new_rank`.)
        found = await self._continuation(expected - 1, rank_known=self._live_rank is not None)
        if await self._connection_changed_meanwhile():
            return _Checked.NOTHING  # (what the events asked for replaces the check: see there)
        if found is None:
            # Checked at the first message (from it alone: no second stall) or at a retry.
            self._new_connection = True
            self._retry_replay(_CONNECTED)
            return _Checked.FAILED
        if isinstance(found, _Break):
            await self._rebuild(None, reason=found.reason, buffered=found.buffered)
            return _Checked.REBUILT
        for reply in found:
            await self._apply(reply, replayed=True)
        if found:
            self.counters.num_connection_heals += 1  # (not a gap: no message showed one)
            log.info(
                "worker %s: new connection; the replay brought seq %d to %d",
                self.worker_id,
                found[0].seq,
                found[-1].seq,
            )
        # Their live copies, if any come (sent once the SUB was connected), are duplicates,
        # and so are those of the batches the replay before the connection applied (no
        # live batch has come since to pass them: they may still be on their way).
        self._replayed.update((r.seq, r.payload) for r in found)
        return _Checked.NOTHING

    async def _continuation(
        self, last: int, *, rank_known: bool
    ) -> list[ZmqMessage] | _Break | None:
        """One replay from `last`, the last applied seq: the batches after it when the replay
        goes on from the very batch applied at `last` (the same bytes: the same process, see
        the module docstring; its replies run without a hole, `_replay`), else why not; None
        when it failed. No replay when the worker holds replayed batches of another
        data-parallel rank than the live stream's, once `rank_known` (`_is_new_rank`)."""
        if rank_known and self._applied_rank not in (None, self._live_rank):
            return _Break(
                f"the worker holds data-parallel rank {self._applied_rank}'s batches "
                f"(replayed), the live stream is rank {self._live_rank}'s"
            )
        replies = await self._replay(last)
        if replies is None:
            return None
        if not replies or replies[0].seq != last:
            return _Break(
                f"the replay no longer holds seq {last} (buffer trimmed, a restart, or more to "
                "replay than replay_bytes)",
                # A buffer that starts after `last` came whole (the backlog outgrew it).
                buffered=replies or None,
            )
        if replies[0].payload != self._last_payload:
            return _Break(f"seq {last} changed: the engine restarted")
        return replies[1:]

    async def _connection_changed_meanwhile(self) -> bool:
        """Whether the SUB's connection changed (ended, or another was made) while a new
        connection's check replayed, acted on now (`_on_connection_events`): the check is then
        moot. An end clears the worker, and a connection after it rebuilds the worker from the
        replay, a sequence break; a new connection is checked anew. (Before, a check whose
        replay reached the publisher's next process rebuilt the worker, and the end read next
        cleared and rebuilt it again: two sequence breaks for one restart.) Not while messages
        are queued: those of a connection are handled before its end (`_follow`)."""
        if self.receive_queue:
            return False
        return await self._handle_queued_connection_events()

    async def _replay(self, start_seq: int) -> list[ZmqMessage] | None:
        """The buffered messages from `start_seq` on, as one run of consecutive seqs that ends
        at the newest (legacy protocol), or None when no replay endpoint is configured or the
        replay failed.

        A replay can come back with holes: vLLM's and SGLang's replay ROUTER sends its whole
        buffer in one tight loop, and a ROUTER silently drops what its high-water mark (1000
        messages, theirs is left at the default) cannot take while its I/O thread catches
        up; the end marker, sent last, often gets through after such a drop. Applied as it
        came, a replay with a hole would lose what the missing batches removed: blocks the
        engine evicted would stay indexed. So each hole is asked for again (a replay from its
        first missing seq, `MAX_REPLAY_ROUNDS` at most, while each round fills some), and
        what stays unfilled drops every message before the last hole: those blocks are
        missing until stored again, never stale, as with a buffer trimmed at its start. The
        replies are held as they come, at most `replay_bytes` of them: past that the oldest
        are dropped, which leaves such a hole, treated the same way (`HeldReplies`)."""
        if not self.settings.replay_endpoint:
            return None
        # (No heartbeats here: `replay_timeout_s` bounds every wait of a replay, a silent
        # publisher's included.)
        dealer = self._context.socket(zmq.DEALER)
        received = HeldReplies(self.settings.replay_bytes)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            # As deep as the receive queue: a replay's replies are read one at a time, and
            # what the DEALER cannot queue backs up into the ROUTER, which drops it.
            dealer.setsockopt(zmq.RCVHWM, self.settings.receive_hwm)
            set_ip_version(dealer, self.settings.replay_endpoint)
            dealer.connect(self.settings.replay_endpoint)
            request: int | None = start_seq
            for round_number in range(MAX_REPLAY_ROUNDS):
                if request is None:
                    break
                first = await self._replay_round(dealer, request, received)
                if round_number and first != request:
                    break  # the hole is no longer buffered (trimmed meanwhile, or a restart)
                request = received.first_missing_seq()
        except (TimeoutError, zmq.ZMQError) as exc:
            self.counters.num_replay_failures += 1
            self._replay_failures_in_a_row += 1
            self._replay_failed_on_connection = True
            failures = self._replay_failures_in_a_row
            log.log(
                _sparse_level(failures - 1, failures),
                "worker %s: replay from %s failed%s: %r",
                self.worker_id,
                self.settings.replay_endpoint,
                f" ({failures} times in a row)" if failures > 1 else "",
                exc,
            )
            return None
        finally:
            dealer.close(linger=0)
        self._replay_failed_on_connection = False
        # (Before, only a new connection reset it: after one episode of failed replays, a
        # later resync's failed replay waited up to `backoff_max_s` for its first retry.)
        self.replay_backoff.reset()
        if self._replay_failures_in_a_row:
            log.info(
                "worker %s: replay from %s answered after %d failures",
                self.worker_id,
                self.settings.replay_endpoint,
                self._replay_failures_in_a_row,
            )
            self._replay_failures_in_a_row = 0
        replies = received.in_seq_order()
        run = _consecutive_tail(replies)
        if received.dropped:
            self.counters.num_gaps += 1
            log.warning(
                "worker %s: the replay from seq %d brought more than replay_bytes "
                "(%d bytes): dropped its %d oldest replies; applying seq %d to %d only",
                self.worker_id,
                start_seq,
                received.max_bytes,
                received.dropped,
                run[0].seq,
                run[-1].seq,
            )
        elif len(run) < len(replies):
            self.counters.num_gaps += 1
            log.warning(
                "worker %s: the replay from seq %d has a hole before seq %d that asking again "
                "did not fill (a replay ROUTER drops replies past its high-water mark); "
                "applying seq %d to %d only",
                self.worker_id,
                start_seq,
                run[0].seq,
                run[0].seq,
                run[-1].seq,
            )
        return run

    async def _replay_round(
        self, dealer: zmq.asyncio.Socket, start_seq: int, received: HeldReplies
    ) -> int | None:
        """One replay request on `dealer`: its replies up to the end marker go to `received`;
        the lowest seq they held (None: none)."""
        self.counters.num_replays += 1
        count = 0
        lowest: int | None = None
        foreign_topic: str | None = None  # a reply's under another topic than the source's
        # A DEALER with no connected peer blocks on send: bound that wait too. (Not
        # `asyncio.wait_for`: on Python 3.11 it loses a cancellation that arrives as the
        # reply does, and the cancelled source would then follow on forever.)
        async with asyncio.timeout(self.settings.replay_timeout_s):
            await dealer.send_multipart([b"", start_seq.to_bytes(SEQ_BYTES, "big")])
        while True:
            async with asyncio.timeout(self.settings.replay_timeout_s):
                frames = await dealer.recv_multipart()
            try:
                reply = decode_replay_reply(frames)
            except KvEventDecodeError as exc:
                self._drop_bad_message("a bad replay reply: %s", exc)
                continue
            if reply is None:
                break
            if _is_wanted_topic(reply.topic, self.settings.topic):
                count += 1
                lowest = reply.seq if lowest is None else min(lowest, reply.seq)
                received.add(reply)
            else:
                foreign_topic = reply.topic
        if count:
            self._warned_foreign_topic = False
        elif foreign_topic is not None and not self._warned_foreign_topic:
            # The SUB filters at the publisher, so a `topic` the publisher never sends shows
            # nowhere else: the worker stays empty, its link up, no message counted.
            self._warned_foreign_topic = True
            log.warning(
                "worker %s: the replay from %s holds batches under topic %r only, none under "
                "this source's %r: is `topic` right? (its live messages are filtered out too)",
                self.worker_id,
                self.settings.replay_endpoint,
                foreign_topic,
                self.settings.topic,
            )
        self.counters.num_replayed_messages += count
        return lowest


def _named_types(tags: tuple[str, ...], most: int = 4) -> str:
    """`tags` as a log says them: quoted, cut short (a sender's string, any length)."""
    if not tags:
        return ""
    named = ", ".join(repr(tag[:40]) for tag in tags[:most])
    return f" (of types {named}{', ...' if len(tags) > most else ''})"


def _sparse_level(before: int, after: int, level: int = logging.WARNING) -> int:
    """`level` when a count went from `before` past a power of two (its 1st, 2nd, 4th, 8th,
    ... occurrence), else DEBUG: how a condition that may repeat on every message, or every
    retry, is logged."""
    return level if after.bit_length() > before.bit_length() else logging.DEBUG


def _consecutive_tail(replies: list[ZmqMessage]) -> list[ZmqMessage]:
    """The longest run of consecutive seqs that ends at the last of `replies` (seq order)."""
    start = len(replies) - 1
    while start > 0 and replies[start - 1].seq + 1 == replies[start].seq:
        start -= 1
    return replies[max(start, 0) :]


async def _connection_events(monitor: zmq.asyncio.Socket) -> list[tuple[int, int]]:
    """The monitor events queued so far, in order, each as (event, value) (none: its readiness
    can wake a poll with nothing to read)."""
    events: list[tuple[int, int]] = []
    while int(monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
        message = parse_monitor_message(await monitor.recv_multipart())
        events.append((message["event"], message["value"]))
    return events


class _OpenConnections:
    """Which monitor events are the publisher's, told by the SUB's open TCP connections.

    A connection's connect or accept, and its end, carry its file descriptor; a handshake does
    not. A binding SUB accepts whatever dials its port (a port scan, a TCP liveness probe, a
    stray client): such a connection fails its ZMTP handshake and ends, and its end is no
    publisher leaving while the publisher's own connection is still open. So an end counts
    only when it leaves no connection open (one still open without a handshake ends at the
    handshake's timeout, and its end then counts). A connecting SUB has one connection at a
    time: every end counts, as before.

    A handshake that fails without a protocol error (it timed out, or the peer closed the
    connection) is reported as such before the end; one that fails on a protocol error (a peer
    of another socket type) is not: its connection just ends. libzmq dials again after the
    former only (`redials`)."""

    OPENED = zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED

    def __init__(self) -> None:
        self._open: set[int] = set()
        self._handshaken = False  # since the last connection opened
        self._handshake_failed = False  # without a protocol error, since that opening
        # Whether the last end that counted came before any handshake since that opening, and
        # whether libzmq dials again after it (its handshake failed without a protocol error).
        self.ended_before_handshake = False
        self.redials = False

    def publisher_events(self, events: list[tuple[int, int]]) -> list[int]:
        """`events` (in order) reduced to the handshakes and the ends that leave no connection
        open."""
        kept: list[int] = []
        for event, descriptor in events:
            if event & self.OPENED:
                self._open.add(descriptor)
                self._handshaken = self._handshake_failed = False
            elif event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                self._handshake_failed = True
            elif event == zmq.EVENT_DISCONNECTED:
                self._open.discard(descriptor)
                if not self._open:
                    kept.append(event)
                    self.ended_before_handshake = not self._handshaken
                    self.redials = self._handshake_failed
            else:
                self._handshaken = True
                kept.append(event)
        return kept


async def _readable(sock: zmq.asyncio.Socket) -> object:
    """Once `sock` has something to read (a socket's poll waits for POLLIN by default)."""
    return await sock.poll()


def _subscriptions(topic: str) -> tuple[bytes, ...]:
    """The SUB's prefixes: the topic, and with a topic the 2-frame messages' first byte."""
    return (topic.encode(), TWO_FRAME_SUBSCRIPTION) if topic else (b"",)


def _is_wanted_topic(message_topic: str | None, topic: str) -> bool:
    """Whether a message (live or replayed) is the source's: under its topic, or without a
    topic frame (2-frame messages, older vLLM's replay replies: topic None). An empty topic
    frame is a topic like any other: the SUB's filter keeps it out of a source with a topic,
    so the replay must too."""
    return message_topic is None or message_topic.startswith(topic)
