"""The ZMQ event intake end to end against a naive model of the engine's cache (hypothesis
stateful): the engine's publisher (`engine.server.zmq_publisher`, fed by a `KvEventLog`) on
real loopback sockets, a `ZmqSource` following it (live SUB, replay DEALER) and an in-memory
index, in canonical hash mode.

Rules: the engine publishes a batch of BlockStored (chained blocks over a two-token alphabet,
so prefixes are shared; only blocks not cached whose parent is), BlockRemoved (cached leaves
only, as an LRU evicts) and AllBlocksCleared events; batches are lost on the wire (the
publisher numbers and buffers them, the SUB never gets them) before one that arrives; the
engine restarts (a new process: a new epoch, seq from 0, an empty cache, the same ports); the
source stops, the engine may publish meanwhile, and a new source starts; the index loses the
worker and asks for a resync.

After each rule, once the source has applied the engine's newest batch (at once when the
engine has published nothing since it started), its SUB is connected (to the new process,
after a restart) and a resync asked for has run, the worker's blocks in the index must become
exactly the model's cached set, in canonical keys computed from the tokens. The next rule
waits for that connection because what a PUB sends before a SUB's connection is up is lost
with nothing after it to show a gap; what a source must do about it is pinned by the
reconnection rules (docs/indexer.md, "Sequence tracking").
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from array import array
from collections.abc import Callable

import xxhash
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule
from zmq.utils.monitor import recv_monitor_message

from engine.core.api import AllBlocksCleared, BlockKey, BlockRemoved, BlockStored, KvEvent
from engine.server.kv_event_log import KvEventLog
from engine.server.zmq_publisher import ZmqKvPublisher
from indexer.index import PrefixIndex
from indexer.keys import block_keys
from indexer.memory_backend import MemoryBackend
from indexer.sources.zmq import SourceCounters, ZmqSource, ZmqSourceSettings
from indexer.translate import HashMode, TranslateOptions, WorkerTranslator
from tests.polling import eventually

BLOCK_SIZE = 2
TOKENS = (0, 1)  # four distinct blocks: prefixes are shared all the time
WORKER = "engine"
TOPIC = "kv@test@sim"
WAIT_S = 10.0

Prefix = tuple[int, ...]


class LossyPublisher(ZmqKvPublisher):
    """The engine's publisher, whose next `drop` batches are numbered and buffered for
    replay but never reach the wire (a network loss the SUB sees only as a gap), and which
    counts the SUB connections its PUB accepted (`handshakes`)."""

    drop = 0
    _handshakes = 0
    _monitor: zmq.Socket[bytes] | None = None

    async def start(self) -> None:
        await super().start()
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
        self.source: ZmqSource | None = None
        self.task: asyncio.Task[None] | None = None
        # The PUB's handshakes when the engine or the source last restarted (None: not since
        # the last check): the check waits for the SUB's connection after it (`_connected`).
        self.handshakes_before: int | None = None
        self.loop.run_until_complete(self._start_engine("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"))
        self.loop.run_until_complete(self._start_source())
        self.handshakes_before = 0  # the first check waits for the SUB's first connection

    # -- the engine and the source ---------------------------------------------------------

    async def _start_engine(self, endpoint: str, replay_endpoint: str) -> None:
        # A new process: its own epoch (the log's first number), seq from 0, nothing cached.
        self.log = KvEventLog(1000, first_sequence_number=next(self.epochs) * 10**9)
        self.publisher = LossyPublisher(
            endpoint=endpoint,
            replay_endpoint=replay_endpoint,
            topic=TOPIC,
            hwm=1000,
            buffer_steps=1000,
            first_sequence_number=self.log.first_sequence_number,
            snapshot=self.log.snapshot,
        )
        await self.publisher.start()
        self.log.add_listener(self.publisher.publish_batch)
        self.cached = set()

    async def _start_source(self) -> None:
        assert self.publisher.bound_replay_endpoint is not None
        settings = ZmqSourceSettings(
            endpoint=self.publisher.bound_endpoint,
            replay_endpoint=self.publisher.bound_replay_endpoint,
            topic=TOPIC,
            replay_timeout_s=2.0,
        )
        translator = WorkerTranslator(
            TranslateOptions(worker_id=WORKER, hash_mode=HashMode.CANONICAL)
        )
        self.source = ZmqSource(settings, translator, self.backend, context=self.ctx)
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

    def _append(self, events: list[KvEvent]) -> bool:
        """Append `events` to the engine's log as one batch, from within the machine's event
        loop, as the engine does (the publisher's asyncio socket sends there: outside it, it
        would need a current event loop, which an earlier test may have unset); whether
        there was one."""

        async def append() -> bool:
            return self.log.append(events) is not None

        return self.loop.run_until_complete(append())

    # -- rules -----------------------------------------------------------------------------

    @rule(specs=batches)
    def publish(self, specs: list[EventSpec]) -> None:
        self._publish(specs)
        self._check()

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

    @rule(specs=batches)
    def restart_engine(self, specs: list[EventSpec]) -> None:
        """A new engine process on the same ports (its cache empty), publishing or not."""
        endpoint, replay = self.publisher.bound_endpoint, self.publisher.bound_replay_endpoint
        assert replay is not None

        async def restart() -> None:
            await self.publisher.close()
            await self._start_engine(endpoint, replay)

        self.loop.run_until_complete(restart())
        self.handshakes_before = 0  # a new publisher
        self._publish(specs)  # (before the SUB's reconnect reaches the new process, or not)
        self._check()

    @rule(meanwhile=st.lists(batches, max_size=2))
    def restart_source(self, meanwhile: list[list[EventSpec]]) -> None:
        """The source stops (the index keeps what it holds), the engine publishes meanwhile
        or not, and a new source starts."""
        self.loop.run_until_complete(self._stop_source())
        for specs in meanwhile:
            self._publish(specs)
        self.handshakes_before = self.publisher.handshakes()
        self.loop.run_until_complete(self._start_source())
        self._check()

    @rule(lost=st.booleans())
    def resync(self, lost: bool) -> None:
        """The index asks for a resync, having lost the worker's entries or not."""
        if lost:
            self.loop.run_until_complete(self.backend.remove_worker(WORKER))
        assert self.source is not None
        replays = self.source.counters.num_replays
        self.source.request_resync(WORKER)
        # (A rebuild the source was about to make, at a reconnection, serves the request too.)
        self._check(lambda: self._counters().num_replays > replays)

    # -- the check -------------------------------------------------------------------------

    def _unchanging_batch(self) -> None:
        """A batch that changes no cached set: a block stored and evicted."""
        block = (len(TOKENS),) * BLOCK_SIZE  # a token no other block has
        key = engine_key(block)
        stored = BlockStored(
            block_keys=(key,), parent_key=None, token_ids=block, block_size=BLOCK_SIZE
        )
        self._append([stored, BlockRemoved(block_keys=(key,))])

    def _check(self, done: Callable[[], bool] = lambda: True) -> None:
        """Wait until the source has caught up (`done` too), then compare."""
        self.loop.run_until_complete(self._caught_up(done))
        self.handshakes_before = None

    def _counters(self) -> SourceCounters:
        assert self.source is not None
        return self.source.counters

    def _indexed(self) -> set[BlockKey]:
        return {p.key for p in self.index.placements(WORKER)}

    def _applied_newest(self) -> bool:
        """Whether the source applied the engine's newest batch (or the engine has none)."""
        assert self.source is not None
        newest = self.log.last_sequence_number - self.log.first_sequence_number
        return newest < 0 or self.source.last_seq == newest

    def _connected(self) -> bool:
        """Whether the SUB has connected since the restart, if there was one."""
        before = self.handshakes_before
        return before is None or self.publisher.handshakes() > before

    async def _caught_up(self, done: Callable[[], bool]) -> None:
        expected = {canonical_key(p) for p in self.cached}

        def settled() -> bool:
            return (
                done()
                and self._connected()
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
                f"{source.counters}"
            ) from None


ZmqIntakeMachine.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestZmqIntakeAgainstModel = ZmqIntakeMachine.TestCase
