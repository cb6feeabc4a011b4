"""The writer lease of one engine (`indexer.writer_lease`) held by three replicas over one real
redis-server, against a naive model of its module docstring's rules, driven by a hypothesis
state machine: replicas that want the lease, no longer want it (a lease held is still
renewed) or stop (giving it up), renewals, time passing
(the lease running out in Redis when nobody renewed it for a term), a paused holder's late
writes, replicas losing and regaining their reach of the engine, the engine storing and
evicting blocks, stray writes from holders and non-holders, a replica process restarted
(killed: nothing given up), Redis losing everything (FLUSHALL) or restarted empty.

Each replica is what `indexer.sources.leased` wires, at the lowest level that still runs the
real Redis functions: its own `RedisBackend` fenced by the lease (`fence_writes`), a
`WriterLease` whose `run()` loop runs as a task, and a `LeasedSink` through which a fake
source of the engine writes. The fake source starts on `on_taken`: reaching the engine, it
rebuilds the worker (one batch: clear, then every block the engine holds); it stops on
`on_lost`, and while it runs and reaches the engine it forwards each of the engine's changes.

Time is the machine's: the replicas' clock is injected, and the term is long enough (in real
seconds, for Redis and for the loop's timer) that nothing runs out or renews by itself during
an example. A renewal is one turn of a replica's loop, asked with `wake()` (or taken at once
after a refused write); time passing is the clock moved on, and, where the model's lease has
run out, its key expired in Redis (PEXPIRE: the one clock that decides an expiry).

The model, from the docstring: a renewal takes the lease when nobody holds it (or a previous
process of the same replica does), keeps it when this process holds it, finds it held
elsewhere otherwise (the holder, if it believed it held it, stops); a take (even by a
replica believing it held it: its key ran out, Redis lost it) starts a fresh subscription; a
holder that has not reached the engine since a renewal a whole term ago gives the lease up
and renews nothing for two renewal intervals; a write is accepted exactly when its replica's
process holds the lease in Redis, and a refused one stops that replica's source and has its
loop renew at once. Checked after every step: each replica's `held`, `held_elsewhere` and
source, the lease key's holder and the worker's blocks in the index are the model's. Checked
in the rules: of fenced writes from every replica at once at most one is accepted, the lease
holder's, and the refused ones leave the index as it was; a lone replica that wants the lease and
reaches the engine holds it within two terms, and the index then has the engine's blocks."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from indexer.batch import Action, ActionType, Batch, Tier
from indexer.redis_backend import LeaseState, RedisBackend, open_redis_backend
from indexer.redis_client import LeaseLostError
from indexer.sources.leased import lease_name
from indexer.writer_lease import RENEWALS_PER_TERM, LeasedSink, WriterLease, lease_holder
from tests.indexer.backend_views import worker_keys
from tests.polling import eventually
from tests.redis_servers import RedisServer, restartable_port

T = TypeVar("T")

# Whole numbers of seconds on the replicas' clock, and real seconds for Redis's expiry and the
# loop's timer: far longer than an example runs.
TERM_S = 300.0
INTERVAL_S = TERM_S / RENEWALS_PER_TERM
NUM_REPLICAS = 3
WORKER = "w0"
ENGINE = lease_name(WORKER)
WAIT_S = 30.0

replicas = st.integers(0, NUM_REPLICAS - 1)
blocks = st.integers(1, 6)


class Clock:
    """The replicas' clock (`WriterLease`'s `clock`), moved on by the machine."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class Replica:
    """One replica process: its fenced backend, its lease's loop, and a fake source of the
    engine that runs while the lease says so (what the machine's `Engine` holds, rebuilt on
    each take)."""

    def __init__(
        self, index: RedisBackend, holder: str, engine: Engine, clock: Clock, *, wants: bool
    ) -> None:
        self.index = index
        self.holder = holder
        self.engine = engine
        self.wants = wants  # inputs: whether it follows the engine, and reaches it
        self.reaches = True
        self.following = False  # the fake source runs
        self.resyncs: list[bool] = []  # each take's `resync`
        index.fence_writes(holder, lease_name)
        self.lease = WriterLease(
            index,
            ENGINE,
            holder,
            TERM_S,
            wanted=lambda: self.wants,
            on_taken=self._taken,
            on_lost=self._lost,
            reachable=lambda: self.following and self.reaches,
            clock=clock,
        )
        self.sink = LeasedSink(index, self.lease)
        self.task = asyncio.create_task(self.lease.run())

    async def _taken(self, resync: bool) -> None:
        self.following = True
        self.resyncs.append(resync)
        if self.reaches:
            await self.rebuild()

    def _lost(self) -> None:
        self.following = False

    async def rebuild(self) -> None:
        await self.sink.apply(snapshot(self.engine.blocks))

    async def turn(self) -> None:
        """One turn of the lease's loop (a renewal, when it wants or holds the lease), asked
        now (`wake`)."""
        self.lease.wake()
        await self.turn_over()

    async def turn_over(self) -> None:
        """Until the turn of the lease's loop that was asked is over: the loop clears its
        wake-up flag then, and waits (nothing public says so)."""
        await eventually(lambda: not self.lease._wake.is_set(), WAIT_S, "a turn", every_s=0.001)

    async def kill(self) -> None:
        """The process ends without giving anything up (kill -9)."""
        self.task.cancel()
        await asyncio.wait([self.task])
        await self.index.close()


@dataclass
class Engine:
    blocks: set[int] = field(default_factory=set)


@dataclass
class Expected:
    """What the model expects of one replica process."""

    holder: str
    held: bool = False
    held_elsewhere: bool = False
    following: bool = False
    resyncs: list[bool] = field(default_factory=list)
    # Since when its renewals found the engine unreachable while held; until when it stands
    # aside after giving the lease up for that.
    unreachable_since_s: float | None = None
    stand_aside_until_s: float = 0.0


def replica_of(holder: str) -> str:
    return holder.rpartition("/")[0]


def snapshot(blocks: set[int]) -> Batch:
    """A fresh subscription's rebuild of the worker: cleared, then every block the engine
    holds, in one batch."""
    clear = Action(ActionType.CLEAR_ALL_AT_TIER, Tier.HBM)
    reports = [Action(ActionType.REPORT, Tier.HBM, (block,)) for block in sorted(blocks)]
    return Batch(WORKER, (clear, *reports))


def change(block: int, stored: bool) -> Batch:
    kind = ActionType.REPORT if stored else ActionType.REVOKE
    return Batch(WORKER, (Action(kind, Tier.HBM, (block,)),))


def applied(indexed: set[int], batch: Batch) -> set[int]:
    """The worker's blocks in a naive index once `batch` is applied."""
    indexed = set(indexed)
    for action in batch.actions:
        if action.type is ActionType.CLEAR_ALL_AT_TIER:
            indexed.clear()
        elif action.type is ActionType.REPORT:
            indexed.update(action.hashes)
        else:
            indexed.difference_update(action.hashes)
    return indexed


class WriterLeaseMachine(RuleBasedStateMachine):
    def __init__(self, redis: RedisServer) -> None:
        super().__init__()
        self.redis = redis
        self.loop = asyncio.new_event_loop()
        self.prefix = f"l{uuid.uuid4().hex[:12]}"
        self.lease_key = f"{self.prefix}:{{default:0}}:l:{ENGINE}"
        self.clock = Clock()
        self.engine = Engine()
        self.history: list[str] = []
        # The model: the lease in Redis, the worker's blocks in the index, each replica.
        self.lease_holder: str | None = None
        self.lease_expires_s = 0.0
        self.indexed: set[int] = set()
        self.expected: list[Expected] = []
        self.incarnations = [0] * NUM_REPLICAS
        self.observer = self.run(open_redis_backend(redis.url, key_prefix=self.prefix, buckets=16))
        self.replicas: list[Replica] = []
        for i in range(NUM_REPLICAS):
            self.replicas.append(self.run(self.start_replica(i, wants=True)))
            self.expected.append(Expected(self.replicas[i].holder))
            self.turn(i)

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coroutine)

    def teardown(self) -> None:
        try:
            for replica in self.replicas:
                self.run(replica.kill())
            self.run(self.observer.close())
            for key in self.redis.client().scan_iter(f"{self.prefix}:*"):
                self.redis.client().delete(key)
        finally:
            self.loop.close()

    async def start_replica(self, i: int, *, wants: bool) -> Replica:
        self.incarnations[i] += 1
        holder = lease_holder(f"r{i}", "127.0.0.1:0", f"p{self.incarnations[i]}")
        index = await open_redis_backend(self.redis.url, key_prefix=self.prefix, buckets=16)
        return Replica(index, holder, self.engine, self.clock, wants=wants)

    # ---- the model ----

    def model_hold(self, i: int) -> LeaseState:
        """kvp_lease for replica i's process."""
        me, holder = self.expected[i].holder, self.lease_holder
        if holder is not None and holder != me and replica_of(holder) != replica_of(me):
            return LeaseState.HELD_ELSEWHERE
        self.lease_expires_s = self.clock.now_s + TERM_S
        if holder == me:
            return LeaseState.KEPT
        if holder is not None:
            event("taken over from the replica's previous process")
        self.lease_holder = me
        return LeaseState.TAKEN

    def model_release(self, i: int) -> None:
        expected = self.expected[i]
        if expected.held:
            expected.held = False
            if self.lease_holder == expected.holder:
                self.lease_holder = None

    def model_taken(self, i: int) -> None:
        expected, replica = self.expected[i], self.replicas[i]
        expected.resyncs.append(expected.held)  # taken anew: it believed it held it
        expected.held = expected.following = True
        if replica.reaches:
            self.model_write(i, snapshot(self.engine.blocks))

    def model_write(self, i: int, batch: Batch) -> bool:
        """A write of replica i's source: accepted exactly when its process holds the lease;
        refused, its source stops and its loop renews at once."""
        expected = self.expected[i]
        if self.lease_holder == expected.holder:
            self.indexed = applied(self.indexed, batch)
            return True
        event(f"write refused{' (believed held)' if expected.held else ''}")
        expected.held = expected.following = False
        self.model_turn(i)
        return False

    def model_turn(self, i: int) -> None:
        """One turn of replica i's loop (`WriterLease.run`): a renewal, unless it neither
        wants nor holds the lease, gives it up for the engine unreachable a whole term, or
        stands aside."""
        expected, replica = self.expected[i], self.replicas[i]
        if not (replica.wants or expected.held):
            return
        now_s = self.clock.now_s
        if expected.held and not (expected.following and replica.reaches):
            if expected.unreachable_since_s is None:
                expected.unreachable_since_s = now_s
            if now_s - expected.unreachable_since_s >= TERM_S:
                event("given up: the engine unreachable a term")
                expected.unreachable_since_s = None
                expected.stand_aside_until_s = now_s + 2 * INTERVAL_S
                expected.following = False
                self.model_release(i)
                return
        else:
            expected.unreachable_since_s = None
        if now_s < expected.stand_aside_until_s:
            event("stands aside")
            return
        state = self.model_hold(i)
        event(f"renewal: {state.name}{' (believed held)' if expected.held else ''}")
        expected.held_elsewhere = state is LeaseState.HELD_ELSEWHERE
        if expected.held_elsewhere:
            expected.held = expected.following = False
        elif state is LeaseState.TAKEN or not expected.held:
            self.model_taken(i)

    # ---- driving the replicas ----

    def turn(self, i: int) -> None:
        self.model_turn(i)
        self.run(self.replicas[i].turn())

    def write(self, i: int, batch: Batch) -> bool:
        """Replica i's source writes `batch` through its sink; whether the index took it. A
        refused write has the replica's loop take a turn at once (`LeasedSink`, unasked
        here): it is over before this returns."""
        replica = self.replicas[i]
        try:
            self.run(replica.sink.apply(batch))
        except LeaseLostError:
            assert not self.model_write(i, batch), f"refused: {self.history}"
            self.run(replica.turn_over())
            return False
        assert self.model_write(i, batch), f"accepted: {self.history}"
        return True

    def engine_changes(self, block: int, stored: bool, order: Sequence[int]) -> None:
        """The engine stores or evicts `block`: forwarded, in `order`, by every replica whose
        source runs and reaches it."""
        self.history.append(f"engine {'stores' if stored else 'evicts'} {block}")
        if stored:
            self.engine.blocks.add(block)
        else:
            self.engine.blocks.discard(block)
        for i in order:
            if self.replicas[i].following and self.replicas[i].reaches:
                self.write(i, change(block, stored))

    def time_passes(self, intervals: int) -> None:
        """The clock moves on; a lease its holder did not renew for a term runs out in Redis."""
        self.clock.now_s += intervals * INTERVAL_S
        if self.lease_holder is not None and self.clock.now_s >= self.lease_expires_s:
            self.lease_holder = None
            self.redis.command("PEXPIRE", self.lease_key, 1)
            self.run(eventually(lambda: not self.redis.command("EXISTS", self.lease_key),
                                WAIT_S, "the lease key to expire"))  # fmt: skip

    def stop_replica(self, i: int) -> None:
        """Replica i stops following the engine: its source stops, its lease is given up."""
        replica = self.replicas[i]
        replica.wants = replica.following = False
        self.expected[i].following = False
        self.model_release(i)
        self.run(replica.lease.release())

    def reach(self, i: int, reaches: bool) -> None:
        """Replica i loses or regains the engine; reconnected, a running source resubscribes
        (a rebuild)."""
        replica = self.replicas[i]
        regained = reaches and not replica.reaches
        replica.reaches = reaches
        if regained and replica.following:
            self.write(i, snapshot(self.engine.blocks))

    # ---- the rules ----

    @rule(i=replicas)
    def renew(self, i: int) -> None:
        self.history.append(f"renewal by {i}")
        self.turn(i)

    @rule(intervals=st.integers(1, RENEWALS_PER_TERM))
    def time_passes_without_renewals(self, intervals: int) -> None:
        """Every replica is paused (or its renewals are late)."""
        self.history.append(f"{intervals} renewal intervals pass")
        self.time_passes(intervals)

    @rule(intervals=st.integers(1, 2 * RENEWALS_PER_TERM))
    def time_passes_with_renewals(self, intervals: int) -> None:
        """Every replica renews once each renewal interval."""
        self.history.append(f"{intervals} renewal intervals pass, renewed")
        for _ in range(intervals):
            self.time_passes(1)
            for i in range(NUM_REPLICAS):
                self.turn(i)

    @rule(i=replicas)
    def want(self, i: int) -> None:
        """Replica i follows the engine from now on: it asks for the lease at once."""
        self.history.append(f"{i} wants the lease")
        self.replicas[i].wants = True
        self.turn(i)

    @rule(i=replicas)
    def no_longer_wants(self, i: int) -> None:
        """Replica i no longer wants the lease (a controller that cannot read the engine's
        identity), its source left running: a lease it holds is still renewed."""
        self.history.append(f"{i} no longer wants the lease")
        self.replicas[i].wants = False

    @rule(i=replicas)
    def stop(self, i: int) -> None:
        self.history.append(f"{i} stops")
        self.stop_replica(i)

    @precondition(lambda self: any(e.held for e in self.expected))
    @rule(
        taker=st.none() | replicas,
        block=blocks,
        stored=st.booleans(),
        order=st.permutations(range(NUM_REPLICAS)),
    )
    def a_paused_holder_writes_late(
        self, taker: int | None, block: int, stored: bool, order: Sequence[int]
    ) -> None:
        """A holder paused past the expiry (another replica may have taken the lease
        meanwhile) forwards an engine's change late: refused. Then the replicas that follow
        the engine forward it."""
        paused = next(i for i, e in enumerate(self.expected) if e.held)
        self.history.append(f"{paused} paused past the expiry; renewal by {taker} meanwhile")
        self.time_passes(RENEWALS_PER_TERM)
        if taker is not None and taker != paused:
            self.turn(taker)
        self.history.append(f"{paused} writes late")
        assert not self.write(paused, change(block, stored))
        self.engine_changes(block, stored, [i for i in order if i != paused])

    @rule(block=blocks, stored=st.booleans(), order=st.permutations(range(NUM_REPLICAS)))
    def the_engine_changes(self, block: int, stored: bool, order: Sequence[int]) -> None:
        self.engine_changes(block, stored, order)

    @rule(i=replicas, block=blocks)
    def a_stray_write(self, i: int, block: int) -> None:
        """Replica i's sink writes whether its source runs or not (a holder's, a
        non-holder's)."""
        self.history.append(f"stray write of {block} by {i}")
        self.write(i, change(block, True))

    @rule(block=blocks)
    def every_replica_writes_at_once(self, block: int) -> None:
        """Fenced writes of every replica at once, straight to their backends (no sink stops
        a source): at most one is accepted, the lease holder's (as Redis had it just before),
        and the refused ones leave the index as it was."""
        self.history.append(f"every replica writes {block} at once")
        holder = self.redis.command("GET", self.lease_key)
        before = self.run(worker_keys(self.observer, WORKER))

        async def accepted(replica: Replica) -> bool:
            try:
                await replica.index.apply(change(block, True)._replace(under_lease=True))
            except LeaseLostError:
                return False
            return True

        async def everyone() -> list[bool]:
            return await asyncio.gather(*(accepted(r) for r in self.replicas))

        took = self.run(everyone())
        writers = [r.holder.encode() for r, ok in zip(self.replicas, took, strict=True) if ok]
        # (The holder may be a process killed since: nobody writes then.)
        holders = [r.holder.encode() for r in self.replicas if r.holder.encode() == holder]
        assert writers == holders, f"{writers} wrote, not {holders}: {self.history}"
        after = self.run(worker_keys(self.observer, WORKER))
        assert after == (before | {block} if writers else before), f"{after}: {self.history}"
        if writers:
            self.indexed = applied(self.indexed, change(block, True))

    @rule(i=replicas, reaches=st.booleans())
    def the_engine_reaches_a_replica(self, i: int, reaches: bool) -> None:
        self.history.append(f"{i} {'reaches' if reaches else 'loses'} the engine")
        self.reach(i, reaches)

    @precondition(lambda self: any(e.held for e in self.expected))
    @rule()
    def the_holder_loses_the_engine(self) -> None:
        """A partition between the holder and the engine, both reaching Redis."""
        holder = next(i for i, e in enumerate(self.expected) if e.held)
        self.the_engine_reaches_a_replica(holder, False)

    @rule()
    def redis_loses_everything(self) -> None:
        self.history.append("FLUSHALL")
        self.redis.flushall()
        self.lease_holder, self.indexed = None, set()

    @rule()
    def redis_restarts_empty(self) -> None:
        self.history.append("Redis restarted")
        self.redis.kill()
        self.redis.start()
        self.lease_holder, self.indexed = None, set()

    @rule(i=replicas)
    def the_replica_restarts(self, i: int) -> None:
        """Killed (nothing given up) and started again: the same replica, another process,
        which takes the lease at once where its previous process held it."""
        self.history.append(f"{i} restarted")
        old = self.replicas[i]
        self.run(old.kill())
        self.replicas[i] = self.run(self.start_replica(i, wants=old.wants))
        self.replicas[i].reaches = old.reaches
        self.expected[i] = Expected(self.replicas[i].holder)
        self.turn(i)

    @rule(i=replicas)
    def a_lone_replica_that_reaches_the_engine_takes_the_lease(self, i: int) -> None:
        """The others stop; replica i, wanting the lease and reaching the engine, renewing
        every interval, holds it within two terms; taken meanwhile, the index then has the
        engine's blocks (its fresh subscription's)."""
        self.history.append(f"{i} alone")
        for j in range(NUM_REPLICAS):
            if j != i:
                self.stop_replica(j)
        self.reach(i, True)
        replica = self.replicas[i]
        num_takes = len(replica.resyncs)
        if not replica.wants:
            self.want(i)
        for _ in range(2 * RENEWALS_PER_TERM):
            if self.redis.command("GET", self.lease_key) == replica.holder.encode():
                break
            self.time_passes(1)
            self.turn(i)
        assert self.redis.command("GET", self.lease_key) == replica.holder.encode(), self.history
        assert replica.lease.held, f"{i} does not know it holds the lease: {self.history}"
        if len(replica.resyncs) > num_takes:
            indexed = self.run(worker_keys(self.observer, WORKER))
            assert indexed == self.engine.blocks, f"{indexed}: {self.history}"

    # ---- the invariants ----

    @invariant()
    def replicas_are_as_modelled(self) -> None:
        for i, (replica, expected) in enumerate(zip(self.replicas, self.expected, strict=True)):
            seen = (replica.lease.held, replica.lease.held_elsewhere, replica.following)
            wanted = (expected.held, expected.held_elsewhere, expected.following)
            assert seen == wanted, f"replica {i}: {seen} != {wanted}: {self.history}"
            assert replica.resyncs == expected.resyncs, f"replica {i}: {self.history}"
            assert not replica.task.done(), f"replica {i}'s lease loop ended: {self.history}"

    @invariant()
    def the_lease_and_the_index_are_as_modelled(self) -> None:
        holder = self.redis.command("GET", self.lease_key)
        expected = self.lease_holder.encode() if self.lease_holder is not None else None
        assert holder == expected, f"the lease is {holder!r}, not {expected!r}: {self.history}"
        indexed = self.run(worker_keys(self.observer, WORKER))
        assert indexed == self.indexed, f"{indexed} != {self.indexed}: {self.history}"


def test_one_replica_writes_an_engine_under_its_writer_lease(tmp_path: Path) -> None:
    redis = RedisServer(tmp_path / "redis", port=restartable_port())
    redis.start()
    try:

        class OnThisRedis(WriterLeaseMachine):
            def __init__(self) -> None:
                super().__init__(redis)

        run_state_machine_as_test(
            OnThisRedis,
            settings=settings(
                max_examples=60,
                stateful_step_count=40,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        redis.stop()
