"""The ZMQ event intake end to end against a naive model of the engine's cache (hypothesis
stateful): the engine's publisher (`engine.server.zmq_publisher`, fed by a `KvEventLog`) on
real loopback sockets, a `ZmqSource` following it (live SUB, replay DEALER) and an in-memory
index, in canonical hash mode.

Rules: the engine publishes a batch of BlockStored (chained blocks over a two-token alphabet,
so prefixes are shared; only blocks not cached whose parent is), BlockRemoved (cached leaves
only, as an LRU evicts) and AllBlocksCleared events; batches are lost on the wire (the
publisher numbers and buffers them, the SUB never gets them) before one that arrives; the
engine restarts (a new process: a new epoch, seq from 0, an empty cache, the same ports),
the index asking for a resync at once or not; the source stops, the engine may publish
meanwhile, and a new source starts; the index loses the worker and asks for a resync. The
publisher's replay ROUTER leaves the next requests of a rule unanswered (each fails at the
source's `replay_timeout_s`), or answers every request slowly (well within it).

The publisher also goes away (its process stopped or cut off: both sockets closed) for a few
rules: meanwhile it publishes or not (buffered only), its replay ROUTER comes back before its
PUB (the same process, or a new one on the same ports), the index asks for a resync, the
source restarts; then its PUB comes back, the index asking for a resync as the SUB connects
or not, its replay ROUTER failing the first requests or not.

After each rule (with the publisher up), once the source has applied the engine's newest
batch (at once when the engine has published nothing since it started), its SUB is connected
(to the new process, after a restart) and a resync asked for has run, the worker's blocks in
the index must become exactly the model's cached set, in canonical keys computed from the
tokens; the source must have counted each resync asked (`resyncs`) and told a sequence break
for each publisher it saw leave with batches applied, and for each other process found behind
a new connection (docs/indexer.md, "Sequence tracking"). The next rule waits for that
connection because what a PUB sends before a SUB's connection is up is lost with nothing
after it to show a gap; what a source must do about it is pinned by the reconnection rules.
The replay failures a rule armed are spent before anything is published after them: a
message that comes after a failed replay is rebuilt from alone (no second stall), and what
came before it is then missing by design (until the next resync).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from array import array

import xxhash
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule
from zmq.utils.monitor import recv_monitor_message

from engine.core.api import AllBlocksCleared, BlockKey, BlockRemoved, BlockStored, KvEvent
from engine.server.kv_event_log import KvEventLog
from engine.server.zmq_publisher import ZmqKvPublisher
from indexer.index import PrefixIndex
from indexer.keys import block_keys
from indexer.memory_backend import MemoryBackend
from indexer.sources.zmq import SourceCounters, ZmqSource, ZmqSourceSettings
from indexer.translate import HashMode, TranslateOptions, WorkerTranslator
from tests.indexer.test_zmq_source import _LinkAskingAResync
from tests.polling import eventually

BLOCK_SIZE = 2
TOKENS = (0, 1)  # four distinct blocks: prefixes are shared all the time
WORKER = "engine"
TOPIC = "kv@test@sim"
WAIT_S = 10.0
REPLAY_TIMEOUT_S = 0.5  # the source's: each unanswered request stalls it this long
SLOW_REPLAY_S = 0.15  # a slow ROUTER's wait before each answer (well within the timeout)
SPARE_ENDPOINT = "tcp://127.0.0.1:*"  # a port no source knows: a socket bound there is not up

Prefix = tuple[int, ...]


class LossyPublisher(ZmqKvPublisher):
    """The engine's publisher, whose next `drop` batches are numbered and buffered for
    replay but never reach the wire (a network loss the SUB sees only as a gap), whose replay
    ROUTER leaves the next `unanswered` requests unanswered and waits `replay_delay_s` before
    answering each other, which can go away and come back (`go_away`, `start`: the same
    process, its buffer kept), its PUB after its ROUTER or with it (`open_pub`), and which
    counts the SUB connections its PUB accepted (`handshakes`)."""

    drop = 0
    unanswered = 0
    replay_delay_s = 0.0
    left_last_unanswered = False  # (the last request)
    _handshakes = 0
    _monitor: zmq.Socket[bytes] | None = None

    async def start(self, *, pub: bool = True) -> None:
        """Bind both sockets, the PUB on a spare port until `open_pub` unless `pub`; later
        starts bind the ports the first one got."""
        if self._ctx.closed:  # (back after `go_away`)
            self._ctx = zmq.asyncio.Context()
        live = self._endpoint
        if not pub:
            self._endpoint = SPARE_ENDPOINT
        try:
            await super().start()
        finally:
            self._endpoint = live
        self._replay_endpoint = self.bound_replay_endpoint
        if pub:
            self._endpoint = self.bound_endpoint
        assert self._pub is not None
        address = f"inproc://pub-monitor-{id(self)}"
        self._pub.monitor(address, zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._monitor = zmq.Context.shadow(self._ctx.underlying).socket(zmq.PAIR)
        self._monitor.connect(address)

    def handshakes(self) -> int:
        """SUB connections whose ZMTP handshake the PUB completed so far."""
        if self._monitor is None or self._monitor.closed:
            return self._handshakes
        with contextlib.suppress(zmq.Again):
            while True:
                recv_monitor_message(self._monitor, zmq.NOBLOCK)
                self._handshakes += 1
        return self._handshakes

    def open_pub(self) -> None:
        """Bind the PUB where SUBs look for it (started without `pub`)."""
        assert self._pub is not None
        self._pub.bind(self._endpoint)
        self.bound_endpoint = self._endpoint

    async def go_away(self) -> None:
        """Close both sockets (the process stopped, or cut off), keeping what it buffered:
        what it publishes meanwhile is buffered only."""
        self.handshakes()  # (those its PUB made, counted before its monitor closes)
        await self.close()
        self._pub = self._router = None
        self._replay_task = None

    async def _answer_replay(self, router: zmq.asyncio.Socket, frames: list[bytes]) -> None:
        self.left_last_unanswered = self.unanswered > 0
        if self.unanswered:
            self.unanswered -= 1
            return
        await asyncio.sleep(self.replay_delay_s)
        await super()._answer_replay(router, frames)

    async def close(self) -> None:
        if self._monitor is not None:
            self._monitor.close(linger=0)
        await super().close()

    def publish(self, seq: int, payload: bytes) -> None:
        if self.drop == 0:
            super().publish(seq, payload)
            return
        self.drop -= 1
        pub, self._pub = self._pub, None  # `publish` buffers and sends nothing without a PUB
        try:
            super().publish(seq, payload)
        finally:
            self._pub = pub


def engine_key(prefix: Prefix) -> BlockKey:
    """The engine's own hash of the block ending `prefix` (not the canonical one)."""
    packed = array("I", prefix).tobytes()
    return BlockKey(xxhash.xxh3_64_intdigest(packed, seed=7) - 2**63)


def canonical_key(prefix: Prefix) -> BlockKey:
    return block_keys(prefix, BLOCK_SIZE)[-1]


# One event: ("store", pick, tokens) stores the blocks of `tokens` under the pick-th
# candidate parent (the root or a cached block); ("remove", pick, _) evicts the pick-th cached
# leaf; ("clear", _, _) drops everything.
event_specs = st.tuples(
    st.sampled_from(["store", "store", "store", "remove", "remove", "clear"]),
    st.integers(0, 64),
    st.lists(st.sampled_from(TOKENS), min_size=BLOCK_SIZE, max_size=3 * BLOCK_SIZE),
)
batches = st.lists(event_specs, min_size=1, max_size=3)
EventSpec = tuple[str, int, list[int]]


class ZmqIntakeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.cached: set[Prefix] = set()  # the engine's cache: prefix-closed
        self.epochs = itertools.count(1)
        self.index = PrefixIndex()
        self.backend = MemoryBackend(self.index)
        self.ctx = zmq.asyncio.Context()
        self.log: KvEventLog
        self.publisher: LossyPublisher
        self.epoch = 0  # the engine process's (`_start_engine`)
        # The wire timestamps of the engine's newest batch and of the last one the source
        # applied: a seq alone does not tell one process's batch from another's.
        self.newest_ts: float | None = None
        self.applied_ts: float | None = None
        self.source: ZmqSource | None = None
        self.task: asyncio.Task[None] | None = None
        # The PUB's handshakes when the engine or the source last restarted (None: not since
        # the last check): the check waits for the SUB's connection after it (`_connected`).
        self.handshakes_before: int | None = None
        self.replay_delay_s = 0.0  # every publisher's (`slow_replays`)
        # The sequence breaks the sources told, and the fewest and most the rules call for
        # (`_due_breaks`); the resyncs the index asked of the source running now.
        self.breaks: list[int] = []
        self.breaks_due = (0, 0)
        self.resyncs_asked = 0
        # While the publisher is away (`go_away` to `come_back`): whether its replay ROUTER is
        # up, whether the source saw it leave with batches applied (a break when it is back),
        # and the process whose batches a source started meanwhile holds, when one does (a
        # break if another is behind the connection).
        self.away = False
        self.replay_up = False
        self.left_with_batches = False
        self.holds_epoch: int | None = None
        self.loop.run_until_complete(self._start_engine())
        self.endpoint = self.publisher.bound_endpoint
        assert self.publisher.bound_replay_endpoint is not None
        self.replay_endpoint = self.publisher.bound_replay_endpoint
        self.loop.run_until_complete(self._start_source())
        self.handshakes_before = 0  # the first check waits for the SUB's first connection
        self._check()  # (the rules start from a source connected and caught up)

    # -- the engine and the source ---------------------------------------------------------

    async def _start_engine(self, *, pub: bool = True) -> None:
        """A new process: its own epoch (the log's first number), seq from 0, nothing cached,
        on the ports of the first (any free ones for the first); its PUB up or not yet."""
        self.epoch = next(self.epochs)
        self.log = KvEventLog(1000, first_sequence_number=self.epoch * 10**9)
        first = not hasattr(self, "endpoint")
        self.publisher = LossyPublisher(
            endpoint="tcp://127.0.0.1:*" if first else self.endpoint,
            replay_endpoint="tcp://127.0.0.1:*" if first else self.replay_endpoint,
            topic=TOPIC,
            hwm=1000,
            buffer_steps=1000,
            first_sequence_number=self.log.first_sequence_number,
            snapshot=self.log.snapshot,
        )
        self.publisher.replay_delay_s = self.replay_delay_s
        await self.publisher.start(pub=pub)
        self.log.add_listener(self.publisher.publish_batch)
        self.cached = set()

    async def _start_source(self) -> None:
        settings = ZmqSourceSettings(
            endpoint=self.endpoint,
            replay_endpoint=self.replay_endpoint,
            topic=TOPIC,
            replay_timeout_s=REPLAY_TIMEOUT_S,
        )
        translator = WorkerTranslator(
            TranslateOptions(worker_id=WORKER, hash_mode=HashMode.CANONICAL)
        )
        self.source = ZmqSource(
            settings,
            translator,
            self.backend,
            context=self.ctx,
            on_batch_time=self._applied,
            on_sequence_break=lambda: self.breaks.append(1),
        )
        self.resyncs_asked = 0
        self.task = asyncio.create_task(self.source.run())
        await self.source.ready.wait()

    async def _stop_source(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        self.task = self.source = None

    def teardown(self) -> None:
        async def stop() -> None:
            await self._stop_source()
            await self.publisher.close()

        try:
            self.loop.run_until_complete(stop())
        finally:
            self.ctx.term()
            self.loop.close()

    # -- the engine's cache ----------------------------------------------------------------

    def _event(self, kind: str, pick: int, tokens: list[int]) -> KvEvent | None:
        """The event `(kind, pick, tokens)` stands for in the cache now (None: nothing to
        do), applied to the model."""
        if kind == "clear":
            self.cached.clear()
            return AllBlocksCleared()
        if kind == "remove":
            leaves = sorted(p for p in self.cached if not self._has_child(p))
            if not leaves:
                return None
            leaf = leaves[pick % len(leaves)]
            self.cached.discard(leaf)
            return BlockRemoved(block_keys=(engine_key(leaf),))
        parents: list[Prefix] = [(), *sorted(self.cached)]
        parent = parents[pick % len(parents)]
        tokens = tokens[: len(tokens) // BLOCK_SIZE * BLOCK_SIZE]
        stored = [
            parent + tuple(tokens[:end]) for end in range(BLOCK_SIZE, len(tokens) + 1, BLOCK_SIZE)
        ]
        if stored[0] in self.cached:  # (then its children may be too: store nothing)
            return None
        self.cached.update(stored)
        return BlockStored(
            block_keys=tuple(engine_key(p) for p in stored),
            parent_key=engine_key(parent) if parent else None,
            token_ids=tuple(tokens),
            block_size=BLOCK_SIZE,
        )

    def _has_child(self, prefix: Prefix) -> bool:
        return any(
            len(p) == len(prefix) + BLOCK_SIZE and p[: len(prefix)] == prefix for p in self.cached
        )

    def _publish(self, specs: list[EventSpec]) -> bool:
        """Publish one batch of the events `specs` stand for; whether there was one."""
        events = [e for e in (self._event(*spec) for spec in specs) if e is not None]
        return self._append(events)

    def _publish_all(self, batches: list[list[EventSpec]]) -> None:
        for specs in batches:
            self._publish(specs)

    def _append(self, events: list[KvEvent]) -> bool:
        """Append `events` to the engine's log as one batch, from within the machine's event
        loop, as the engine does (the publisher's asyncio socket sends there: outside it, it
        would need a current event loop, which an earlier test may have unset); whether
        there was one."""

        async def append() -> bool:
            record = self.log.append(events)
            if record is not None:
                self.newest_ts = record.timestamp_unix_ns / 1e9  # (as the wire carries it)
            return record is not None

        return self.loop.run_until_complete(append())

    # -- rules -----------------------------------------------------------------------------

    @precondition(lambda self: not self.away)
    @rule(specs=batches)
    def publish(self, specs: list[EventSpec]) -> None:
        self._publish(specs)
        self._check()

    @precondition(lambda self: not self.away)
    @rule(lost=st.lists(batches, min_size=1, max_size=3), then=batches)
    def lose_batches(self, lost: list[list[EventSpec]], then: list[EventSpec]) -> None:
        """Batches lost on the wire, then one that arrives: the source sees the gap."""
        for specs in lost:
            self.publisher.drop = 1
            self._publish(specs)
        self.publisher.drop = 0
        if not self._publish(then):  # (`then` stood for nothing in the cache now)
            self._unchanging_batch()
        self._check()

    @precondition(lambda self: not self.away)
    @rule(specs=batches, resync=st.booleans(), failing=st.integers(0, 2))
    def restart_engine(self, specs: list[EventSpec], resync: bool, failing: int) -> None:
        """A new engine process on the same ports (its cache empty), publishing one batch or
        not, the index asking for a resync at once (racing the source's reconnection) or
        not, the new replay ROUTER leaving the first `failing` requests unanswered or not.
        (One batch: a first message after a failed replay is rebuilt from alone, which its
        seq 0 is whole.)"""
        # A break for the old process's end, when the worker held its batches then: its
        # end's clear tells it, unless the resync (racing it) cleared the worker before and
        # its replay failed; and the resync may have filled the worker from the new process
        # before the source saw the end, which its clear then tells.
        published = self._published()
        self._due_breaks(published and not (resync and failing), published or resync)

        async def restart() -> None:
            await self.publisher.close()
            await self._start_engine()

        self.loop.run_until_complete(restart())
        self.publisher.unanswered = failing
        self.handshakes_before = 0  # a new publisher
        if resync:
            self._ask_resync()
        self._publish(specs)  # (before the SUB's reconnect reaches the new process, or not)
        # (Its seq 0, once received, rebuilds the worker whole: the source retries no more.)
        self._check(retried=not self._published())

    @precondition(lambda self: not self.away)
    @rule(meanwhile=st.lists(batches, max_size=2), failing=st.integers(0, 2))
    def restart_source(self, meanwhile: list[list[EventSpec]], failing: int) -> None:
        """The source stops (the index keeps what it holds), the engine publishes meanwhile
        or not, and a new source starts, the first `failing` replays unanswered or not."""
        self.loop.run_until_complete(self._stop_source())
        self._publish_all(meanwhile)
        self.publisher.unanswered = failing
        self.handshakes_before = self.publisher.handshakes()
        self.loop.run_until_complete(self._start_source())
        self._check()

    @precondition(lambda self: not self.away)
    @rule(lost=st.booleans(), failing=st.integers(0, 2))
    def resync(self, lost: bool, failing: int) -> None:
        """The index asks for a resync, having lost the worker's entries or not, the first
        `failing` replays unanswered or not."""
        if lost:
            self.loop.run_until_complete(self.backend.remove_worker(WORKER))
        self.publisher.unanswered = failing
        self._ask_resync()
        self._check()

    @precondition(lambda self: not self.away)
    @rule(slow=st.booleans())
    def slow_replays(self, slow: bool) -> None:
        """The publisher's replay ROUTER answers slowly from now on (this process and the
        next), or promptly."""
        self.replay_delay_s = self.publisher.replay_delay_s = SLOW_REPLAY_S if slow else 0.0

    # -- the publisher away ----------------------------------------------------------------

    @precondition(lambda self: not self.away)
    @rule(then=st.lists(batches, max_size=1))
    def go_away(self, then: list[list[EventSpec]]) -> None:
        """The engine's process stops or is cut off (both sockets closed, its buffer kept),
        and the source sees its connection end; then it publishes or not (buffered only)."""
        self.left_with_batches = self._published()  # (all applied: the last check)
        self.loop.run_until_complete(self.publisher.go_away())
        self.away, self.replay_up, self.holds_epoch = True, False, None
        self.loop.run_until_complete(
            eventually(lambda: not self._link_up(), WAIT_S, "the source to see the end")
        )
        self._publish_all(then)

    @precondition(lambda self: self.away)
    @rule(new_process=st.booleans(), resync=st.booleans(), then=st.lists(batches, max_size=1))
    def replay_back(self, new_process: bool, resync: bool, then: list[list[EventSpec]]) -> None:
        """The replay ROUTER comes back before the PUB: the same process (unless its ROUTER
        is back already), or a new one; the index asks for a resync then, or not; then the
        process publishes or not (its PUB not up: buffered only)."""

        async def back() -> None:
            if new_process or self.replay_up:
                await self.publisher.close()
                await self._start_engine(pub=False)
            else:
                await self.publisher.start(pub=False)

        self.loop.run_until_complete(back())
        self.replay_up = True
        if resync:
            self._resync_while_away(lost=False)
        self._publish_all(then)

    @precondition(lambda self: self.away)
    @rule(lost=st.booleans(), then=st.lists(batches, max_size=1))
    def resync_while_away(self, lost: bool, then: list[list[EventSpec]]) -> None:
        """The index asks for a resync while the publisher is away, and the source handles
        it (a replay that fails, or answers with the ROUTER back, or none); then the
        publisher publishes or not (buffered only)."""
        self._resync_while_away(lost)
        self._publish_all(then)

    def _resync_while_away(self, lost: bool) -> None:
        if lost:
            self.loop.run_until_complete(self.backend.remove_worker(WORKER))
        counters = self._counters()
        failures, resets = counters.num_replay_failures, counters.num_resets
        self._ask_resync()
        rebuilds = self.replay_up and not self.left_with_batches  # (else: only clears)
        if rebuilds and self._published():
            self.holds_epoch = self.epoch

        def handled() -> bool:
            return self._resyncs_counted() and (
                counters.num_replay_failures > failures
                or (counters.num_resets > resets and (not rebuilds or self._rebuilt()))
            )

        self.loop.run_until_complete(eventually(handled, WAIT_S, "the resync to be handled"))

    @precondition(lambda self: self.away)
    @rule()
    def restart_source_while_away(self) -> None:
        """The source restarts while the publisher is away, and makes its start's replay
        (which fails, or answers with the ROUTER back). It never saw the publisher leave."""
        self.loop.run_until_complete(self._stop_source())
        self.loop.run_until_complete(self._start_source())
        self.left_with_batches = False
        self.holds_epoch = self.epoch if self.replay_up and self._published() else None
        counters = self._counters()

        def started() -> bool:
            return counters.num_replay_failures > 0 or (
                counters.num_resets > 0 and (not self.replay_up or self._rebuilt())
            )

        self.loop.run_until_complete(eventually(started, WAIT_S, "the start's replay"))

    @precondition(lambda self: self.away)
    @rule(resync=st.booleans(), failing=st.integers(0, 2))
    def come_back(self, resync: bool, failing: int) -> None:
        """The publisher's PUB comes back (its ROUTER with it, if not back yet), its ROUTER
        leaving the first `failing` requests unanswered or not; the index asks for a resync
        as the source acts on the SUB's connection (before its check), or not. A resync so
        asked, with replays that answer, clears the worker once (`resets`), whatever else
        the connection called for (a rebuild, a check that finds another process)."""
        self.publisher.unanswered = failing
        self.handshakes_before = self.publisher.handshakes()
        assert self.source is not None
        if resync:
            self.source.link = _LinkAskingAResync(self.source)
            self.resyncs_asked += 1
        resets = self._counters().num_resets
        if self.replay_up:
            self.publisher.open_pub()
        else:
            self.loop.run_until_complete(self.publisher.start())
        # A break for the end the source saw, or for another process behind the connection:
        # the connection's check tells it, unless its replay failed and the resync cleared
        # the worker before a retry (the source then never learns).
        replaced = self.holds_epoch not in (None, self.epoch)
        told = self.left_with_batches or (replaced and not (resync and failing))
        self._due_breaks(told, self.left_with_batches or replaced)
        self.away = False
        self._check()
        if resync and not failing:
            assert self._counters().num_resets == resets + 1, self._counters()

    # -- the check -------------------------------------------------------------------------

    def _unchanging_batch(self) -> None:
        """A batch that changes no cached set: a block stored and evicted."""
        block = (len(TOKENS),) * BLOCK_SIZE  # a token no other block has
        key = engine_key(block)
        stored = BlockStored(
            block_keys=(key,), parent_key=None, token_ids=block, block_size=BLOCK_SIZE
        )
        self._append([stored, BlockRemoved(block_keys=(key,))])

    def _check(self, *, retried: bool = True) -> None:
        """Wait until the source has caught up (`retried`: with a replay answered after the
        last one that failed, if any), then compare; the replay failures armed are spent or
        dropped."""
        self.loop.run_until_complete(self._caught_up(retried))
        self.handshakes_before = None
        self.publisher.unanswered = 0
        self.publisher.left_last_unanswered = False  # (what the next rule arms is what counts)

    def _due_breaks(self, fewest: bool, most: bool) -> None:
        """One more sequence break called for (`fewest`), or allowed (`most`)."""
        self.breaks_due = (self.breaks_due[0] + fewest, self.breaks_due[1] + most)

    def _ask_resync(self) -> None:
        assert self.source is not None
        self.resyncs_asked += 1
        self.source.request_resync(WORKER)

    def _counters(self) -> SourceCounters:
        assert self.source is not None
        return self.source.counters

    def _resyncs_counted(self) -> bool:
        return self._counters().num_resyncs == self.resyncs_asked

    def _published(self) -> bool:
        """Whether the engine's process has published a batch."""
        return self.log.last_sequence_number >= self.log.first_sequence_number

    def _rebuilt(self) -> bool:
        """Whether the worker holds the engine's cache, up to its newest batch."""
        return self._applied_newest() and self._indexed() == self._expected()

    def _expected(self) -> set[BlockKey]:
        return {canonical_key(p) for p in self.cached}

    def _link_up(self) -> bool:
        assert self.source is not None
        return self.source.link.up

    def _indexed(self) -> set[BlockKey]:
        return {p.key for p in self.index.placements(WORKER)}

    def _applied(self, ts: float) -> None:
        self.applied_ts = ts

    def _applied_newest(self) -> bool:
        """Whether the source applied the engine's newest batch (or the engine has none)."""
        assert self.source is not None
        newest = self.log.last_sequence_number - self.log.first_sequence_number
        return newest < 0 or (self.source.last_seq == newest and self.applied_ts == self.newest_ts)

    def _connected(self) -> bool:
        """Whether the SUB has connected since the restart, if there was one."""
        before = self.handshakes_before
        return before is None or self.publisher.handshakes() > before

    async def _caught_up(self, retried: bool) -> None:
        expected = self._expected()

        def settled() -> bool:
            return (
                not (retried and self.publisher.left_last_unanswered)
                and self._resyncs_counted()
                and self.breaks_due[0] <= len(self.breaks) <= self.breaks_due[1]
                and self._connected()
                and self._link_up()
                and self._applied_newest()
                and self._indexed() == expected
            )

        try:
            await eventually(settled, WAIT_S, "the index to hold the engine's cache")
        except AssertionError as exc:
            source = self.source
            assert source is not None
            newest = self.log.last_sequence_number - self.log.first_sequence_number
            raise AssertionError(
                f"{exc}: newest seq {newest}, the source's last {source.last_seq}, "
                f"missing {sorted(expected - self._indexed())}, "
                f"stale {sorted(self._indexed() - expected)}, connected {self._connected()}, "
                f"link up {self._link_up()}, breaks {len(self.breaks)} ({self.breaks_due} due), "
                f"resyncs asked {self.resyncs_asked}, {source.counters}"
            ) from None


ZmqIntakeMachine.TestCase.settings = settings(
    max_examples=15,
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestZmqIntakeAgainstModel = ZmqIntakeMachine.TestCase
