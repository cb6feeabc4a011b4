"""The controller replicas' shared membership (`controller.membership.Membership`) against a
naive model of the rules docs/controller.md ("Several controller replicas") and docs/redis.md
(`P:fm`) give for it, driven by a hypothesis state machine: admin registrations (with an owner
or none), removals, cordons and uncordons landing on either of two replicas, each replica's
periodic read of the hash at random times, Redis losing the hash (FLUSHALL), and a replica
restarted (a fresh `Membership` reading the hash when it starts), over one real redis-server
(a fresh key prefix per example). No engine answers and no controller serves: each replica is
its `Fleet` and `Membership`, as `controller.service` builds them, reading the hash only when
the machine says so (a poll interval of an hour).

The model, per engine address and field (registered, owner, cordoned), is the last change
that succeeded, by the order the changes were made (the hash's stamps), and what each replica
knows of each field: what it last read from the hash, or wrote itself since. A change first
reads the hash (`_catch_up`), so it is made to the fleet the hash says, and refused where that
fleet has the engine already (register) or does not have it (remove, cordon, uncordon). A
read that finds the hash lost (or written back since its last read, in another generation)
writes this replica's membership back first, each field with the change it knows it by, where
newer than the hash's: the registered engines with their owners and cordons, the config
engines removed, and the fields it knows deleted. So once every replica has read the hash
after the last change (twice over after a loss: the first to write back reads the others'
additions), every replica holds each field as the newest change any of them knew: the last
change, unless the only replica that knew it was restarted while Redis had lost the hash (a
replica's write-back is its own membership; a fresh one knows none). Between reads, each
replica holds what it knows (checked after every step).

Three addresses, one of them an engine of the replicas' config (there before any
registration; removed, it stays removed until registered again)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from controller.config import ControllerConfig
from controller.fleet import Fleet
from controller.membership import Membership
from controller.registry import DuplicateEngineError, UnknownEngineError
from tests.redis_servers import RedisServer, free_port, running_redis

# Nothing listens on these: the fleets' polls of them fail, which membership does not mind.
ADDRESSES = tuple(f"127.0.0.1:{free_port()}" for _ in range(3))
CONFIG_ENGINE = ADDRESSES[2]
REPLICAS = 2
OWNERS = ("", "planner")

REGISTERED, OWNER, CORDONED = "registered", "owner", "cordoned"
Field = tuple[str, str]  # (address, one of the above)
Value = bool | str
# A field's last change as known: (its order among the changes, 0 for none; its value).
Known = dict[Field, tuple[int, Value]]
# What a replica holds: its engines' addresses, each with its owner and whether cordoned.
View = dict[str, tuple[str, bool]]

addresses = st.sampled_from(ADDRESSES)
replicas = st.integers(0, REPLICAS - 1)


def shown(known: Known) -> View:
    """The engines a replica knowing `known` holds."""
    view = {}
    for address in ADDRESSES:
        _, registered = known.get((address, REGISTERED), (0, address == CONFIG_ENGINE))
        if registered:
            _, owner = known.get((address, OWNER), (0, ""))
            _, cordoned = known.get((address, CORDONED), (0, False))
            view[address] = (str(owner), bool(cordoned))
    return view


def written_back(known: Known) -> Known:
    """What a replica knowing `known` writes back (`Membership._write_back`): its membership,
    each field with the change it knows it by: every known field of an engine it holds, and
    the fields it knows deleted (an engine's removal, an owner or a cordon gone) of the
    others."""
    view = shown(known)
    return {f: (order, value) for f, (order, value) in known.items() if f[0] in view or not value}


@dataclass
class SharedHash:
    """The membership hash as the model has it."""

    generation: int
    fields: Known = field(default_factory=dict)

    def merge(self, known: Known) -> None:
        """A write-back: each field taken where its change is newer than the hash's."""
        for name, (order, value) in known.items():
            if name not in self.fields or order > self.fields[name][0]:
                self.fields[name] = (order, value)


@dataclass
class Replica:
    fleet: Fleet
    membership: Membership


def replica_config(redis: RedisServer) -> tuple[ControllerConfig, str]:
    """The replicas' config (`CONFIG_ENGINE` its engine), on `redis` under a fresh key prefix,
    and the key of their membership hash."""
    prefix = f"m{uuid.uuid4().hex[:12]}"
    config = ControllerConfig.model_validate(
        {
            "listen": "127.0.0.1:0",
            "engines": [{"address": CONFIG_ENGINE}],
            "index": {"backend": redis.url, "redis": {"key_prefix": prefix}},
            # Each reads the hash only when told (and tombstones outlive the test).
            "health": {"poll_interval_s": 3600.0, "backoff_initial_s": 1.0},
        }
    )
    return config, f"{prefix}:{{default:0}}:fm"


async def start_replica(config: ControllerConfig) -> Replica:
    """A replica's fleet and membership, as `controller.service` starts them: the config's
    engines, then the first read of the hash."""
    fleet = Fleet(config, None)
    membership = Membership(fleet, config)
    await fleet.start()
    await membership.start()
    return Replica(fleet, membership)


def holds(replica: Replica) -> View:
    return {r.address: (r.owner, r.cordoned) for r in replica.fleet.registry.records()}


async def close_replica(replica: Replica) -> None:
    await replica.membership.close()
    await replica.fleet.close()


class MembershipMachine(RuleBasedStateMachine):
    def __init__(self, redis: RedisServer) -> None:
        super().__init__()
        self.redis = redis
        self.loop = asyncio.new_event_loop()
        self.config, self.key = replica_config(redis)
        # The model.
        self.clock = 0  # the changes made so far
        self.last: Known = {}  # each field's last change
        self.hash: SharedHash | None = None  # None: lost (or never written)
        self.generations = 0
        self.known: list[Known] = []
        self.generation: list[int | None] = []  # each replica's at its last read
        # Fields whose last change only a replica restarted since knew (Redis had lost it).
        self.forgotten: set[Field] = set()
        self.history: list[str] = [f"config engine {CONFIG_ENGINE}"]
        self.replicas: list[Replica] = []
        for index in range(REPLICAS):
            self.known.append({})
            self.generation.append(None)
            self.replicas.append(self.run(start_replica(self.config)))
            self.model_read(index)

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    def teardown(self) -> None:
        try:
            for replica in self.replicas:
                self.run(close_replica(replica))
            self.redis.client().delete(self.key)
        finally:
            self.loop.close()

    # ---- the model ----

    def model_read(self, index: int) -> None:
        """Replica `index` reads the hash: a hash lost, or of another generation than at its
        last read, has its membership written back first."""
        known, generation = self.known[index], self.generation[index]
        if self.hash is None or (generation is not None and self.hash.generation != generation):
            if self.hash is None:
                self.generations += 1
                self.hash = SharedHash(self.generations)
            self.hash.merge(written_back(known))
        self.known[index] = dict(self.hash.fields)
        self.generation[index] = self.hash.generation

    def model_change(self, index: int, changes: dict[Field, Value]) -> None:
        self.clock += 1
        assert self.hash is not None  # (read just before)
        for name, value in changes.items():
            self.last[name] = self.hash.fields[name] = (self.clock, value)
            self.known[index][name] = (self.clock, value)

    def view(self, index: int) -> View:
        return holds(self.replicas[index])

    async def removals_done(self, replica: Replica) -> None:
        """The removals the replica began are over (quick without an index): a read finding an
        engine registered again while its removal runs adds it only at the next read."""
        for address in ADDRESSES:
            removal = replica.fleet.removal(address)
            if removal is not None:
                await removal

    def step(self, what: str) -> None:
        self.history.append(what)
        for replica in self.replicas:
            self.run(self.removals_done(replica))

    # ---- the rules ----

    @rule(index=replicas, address=addresses, owner=st.sampled_from(OWNERS))
    def register(self, index: int, address: str, owner: str) -> None:
        fields: dict[Field, Value] = {(address, REGISTERED): True, (address, OWNER): owner}
        fields[address, CORDONED] = False
        membership = self.replicas[index].membership
        self.change(index, address, membership.register(address, "grpc", owner), fields, False)
        self.step(f"register {address} as {owner!r} via {index}")

    @rule(index=replicas, address=addresses)
    def remove(self, index: int, address: str) -> None:
        fields: dict[Field, Value] = {(address, REGISTERED): False, (address, OWNER): ""}
        fields[address, CORDONED] = False
        membership = self.replicas[index].membership
        self.change(index, address, membership.remove(address), fields, True)
        self.step(f"remove {address} via {index}")

    @rule(index=replicas, address=addresses, cordoned=st.booleans())
    def cordon(self, index: int, address: str, cordoned: bool) -> None:
        membership = self.replicas[index].membership
        call = membership.set_cordoned(address, cordoned)
        self.change(index, address, call, {(address, CORDONED): cordoned}, True)
        self.step(f"{'cordon' if cordoned else 'uncordon'} {address} via {index}")

    def change(
        self, index: int, address: str, call: Any, fields: dict[Field, Value], held: bool
    ) -> None:
        """The admin `call` through replica `index`, which reads the hash first: made where
        that replica then holds the engine at `address` as `held` says (else refused:
        DuplicateEngineError, UnknownEngineError), changing `fields`."""
        self.model_read(index)
        made = (address in shown(self.known[index])) == held
        try:
            self.run(call)
        except (DuplicateEngineError, UnknownEngineError) as exc:
            assert not made, f"replica {index} refused it ({exc}): {self.history}"
        else:
            assert made, f"replica {index} made it: {self.history}"
            self.model_change(index, fields)

    @rule(index=replicas)
    def read(self, index: int) -> None:
        self.model_read(index)
        self.run(self.replicas[index].membership.refresh())
        self.step(f"read by {index}")

    @rule()
    def lose_the_hash(self) -> None:
        self.hash = None
        self.redis.flushall()
        self.step("FLUSHALL")

    @rule(index=replicas)
    def restart(self, index: int) -> None:
        for name, (order, _) in self.known[index].items():
            sources = [k for i, k in enumerate(self.known) if i != index]
            if self.hash is not None:
                sources.append(self.hash.fields)
            if all(k.get(name, (0, None))[0] < order for k in sources):
                self.forgotten.add(name)
        self.run(close_replica(self.replicas[index]))
        self.known[index], self.generation[index] = {}, None
        self.replicas[index] = self.run(start_replica(self.config))
        self.model_read(index)
        self.step(f"restart {index}")

    @precondition(lambda self: self.history)
    @rule()
    def settle(self) -> None:
        """Every replica reads the hash twice over: they agree, on the newest change any
        of them knew of each field."""
        for _ in range(2):
            for index in range(REPLICAS):
                self.read(index)
        views = [self.view(index) for index in range(REPLICAS)]
        assert all(view == views[0] for view in views), f"replicas differ: {self.history}"
        # The last change of each field, but where only a replica restarted since knew it.
        last = shown(self.last)
        now = shown(self.known[0])
        for address in {f[0] for f in self.forgotten}:
            last.pop(address, None)
            now.pop(address, None)
        assert now == last, f"{now} != {last}: {self.history}"

    @invariant()
    def each_replica_holds_what_it_knows(self) -> None:
        for index in range(REPLICAS):
            expected = shown(self.known[index])
            view = self.view(index)
            assert view == expected, f"replica {index} holds {view}, not {expected}: {self.history}"


def test_replicas_agree_on_the_newest_change_any_of_them_knew(tmp_path: Path) -> None:
    with running_redis(tmp_path / "redis") as redis:

        class OnThisRedis(MembershipMachine):
            def __init__(self) -> None:
                super().__init__(redis)

        run_state_machine_as_test(
            OnThisRedis,
            settings=settings(
                max_examples=40,
                stateful_step_count=25,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )


async def test_a_config_engine_registered_again_is_taken_back_by_a_replica_after_a_loss(
    redis: RedisServer,
) -> None:
    """The config engine removed through b, registered again through a, a restarted: Redis then
    loses the hash, and once both have written back and read, b holds the engine again (found
    by the state machine above: b, which had removed it, never took it back, the restarted a
    holding it as an engine of its config and writing back no registration of it)."""
    config, _ = replica_config(redis)
    a, b = await start_replica(config), await start_replica(config)
    try:
        await b.membership.remove(CONFIG_ENGINE)
        await a.membership.register(CONFIG_ENGINE, "grpc")
        await close_replica(a)
        a = await start_replica(config)
        await asyncio.to_thread(redis.flushall)
        for replica in (a, b, a):
            await replica.membership.refresh()
        assert holds(a) == holds(b) == {CONFIG_ENGINE: ("", False)}
    finally:
        await close_replica(a)
        await close_replica(b)


async def test_a_config_engine_registered_again_keeps_its_owner_on_a_replica_started_after_a_loss(
    redis: RedisServer,
) -> None:
    """The config engine removed and registered again (owner "planner") through a, which b
    reads only then: Redis loses the hash, b writes it back, and a restarted reads it: it
    holds the engine with its owner (before, none: b, holding it as an engine of its config,
    wrote back its owner but no registration, which is what an owner is taken from)."""
    config, _ = replica_config(redis)
    a, b = await start_replica(config), await start_replica(config)
    try:
        await a.membership.remove(CONFIG_ENGINE)
        await a.membership.register(CONFIG_ENGINE, "grpc", "planner")
        await b.membership.refresh()
        await asyncio.to_thread(redis.flushall)
        await b.membership.refresh()
        await close_replica(a)
        a = await start_replica(config)
        assert holds(a) == holds(b) == {CONFIG_ENGINE: ("planner", False)}
    finally:
        await close_replica(a)
        await close_replica(b)
