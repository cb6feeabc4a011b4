"""Controller replicas on one Redis index share the fleet's run-time membership: an engine
registered, cordoned, uncordoned or removed through one replica (behind a load balancer, the
one the call lands on) is routed to, or not, by every replica, a replica started later
included; a change Redis does not take is refused, changing nothing; and an engine drained
through one replica leaves the others' routing as a drain, not a flap."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from controller.app import start_controller
from controller.registry import EngineState, Registry
from engine.server.service import EngineApp
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from tests.controller.conftest import EngineFleet, Fleet, close_fleet, make_fleet, start_sim_engine
from tests.controller.test_controller_replicas import close_replica, shared_index
from tests.controller.test_flapping_engines import LONG_HOLD_DOWN
from tests.controller.test_stalled_engines import EngineProcess
from tests.polling import eventually
from tests.redis_servers import RedisServer

pytestmark = pytest.mark.timeout(120)


async def workers(fleet: Fleet) -> dict[str, apb.WorkerInfo]:
    reply = await fleet.admin.ListWorkers(apb.ListWorkersRequest())
    return {w.address: w for w in reply.workers}


async def routes_to(fleet: EngineFleet[Any], address: str) -> bool:
    """Whether the replica's router would send a prompt to the engine (its only one)."""
    try:
        reply = await fleet.admin.Route(
            apb.PromptQuery(token_ids=pb.TokenIds(ids=[1, 2, 3]), model="sim")
        )
    except grpc.aio.AioRpcError as exc:
        assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND), exc
        return False
    return reply.engine == address


async def assert_a_replica_started_now_has_no_engine(fleet: Fleet) -> None:
    """A replica started with the same config as `fleet`'s has no engine."""
    later = await start_controller(fleet.app.controller.config)
    try:
        assert later.controller.fleet.registry.records() == []
    finally:
        await later.close(0.2)


async def replicas_without_engines(redis: RedisServer, count: int) -> list[Fleet]:
    return [await make_fleet(engines=[], index=shared_index(redis)) for _ in range(count)]


async def test_an_engine_registered_cordoned_and_removed_through_one_replica_is_so_on_every(
    redis: RedisServer,
) -> None:
    a, b = await replicas_without_engines(redis, 2)
    engine = await start_sim_engine("e0")
    address = f"127.0.0.1:{engine.port}"
    try:
        await a.admin.RegisterEngine(
            apb.RegisterEngineRequest(address=address, kv_events="zmq", owner="kubernetes:ns/d")
        )
        await eventually(lambda: routes_to(b, address), 20, "b to route to the registered engine")
        registered = (await workers(b))[address]
        assert (registered.source, registered.kv_events) == ("admin", "zmq")
        assert registered.owner == "kubernetes:ns/d"  # as the planner finds its engines again

        await a.admin.Cordon(apb.EngineRef(engine=address))
        await eventually(lambda: not_routed(b, address), 20, "b to stop routing to it")
        assert (await workers(b))[address].cordoned

        await a.admin.Uncordon(apb.EngineRef(engine=address))
        await eventually(lambda: routes_to(b, address), 20, "b to route to it again")

        await a.admin.RemoveEngine(apb.EngineRef(engine=address))
        await eventually(lambda: forgot(b, address), 20, "b to forget the removed engine")
        assert address not in await workers(a)
    finally:
        await close_replica(b)
        await close_fleet(a)
        await engine.close()


async def not_routed(fleet: Fleet, address: str) -> bool:
    return not await routes_to(fleet, address)


async def forgot(fleet: Fleet, address: str) -> bool:
    return address not in await workers(fleet)


async def test_a_replica_started_later_has_the_engines_registered_and_cordoned_before(
    redis: RedisServer,
) -> None:
    (a,) = await replicas_without_engines(redis, 1)
    engines = [await start_sim_engine(f"e{i}") for i in range(2)]
    addresses = [f"127.0.0.1:{e.port}" for e in engines]
    later: Fleet | None = None
    try:
        for address, owner in zip(addresses, ["kubernetes:ns/d", ""], strict=True):
            await a.admin.RegisterEngine(apb.RegisterEngineRequest(address=address, owner=owner))
        await a.admin.Cordon(apb.EngineRef(engine=addresses[1]))
        later = await make_fleet(engines=[], index=shared_index(redis))
        known = await workers(later)  # read as it started, before serving
        assert sorted(known) == sorted(addresses)
        assert [known[a].cordoned for a in addresses] == [False, True]
        assert [known[a].owner for a in addresses] == ["kubernetes:ns/d", ""]
        await eventually(lambda: routes_to(later, addresses[0]), 20, "the later one to route")
    finally:
        if later is not None:
            await close_replica(later)
        await close_fleet(a)
        for engine in engines:
            await engine.close()


async def test_a_config_engine_removed_through_one_replica_leaves_every_replica(
    redis: RedisServer,
) -> None:
    """Engines of the config are in every replica's: removed through one, each replica drops
    it, one started later with the same config included, until it is registered again."""
    engine: EngineApp = await start_sim_engine("e0")
    a = await make_fleet(engines=[engine], index=shared_index(redis))
    b = await make_fleet(engines=[engine], index=shared_index(redis))
    address = a.address(engine)
    try:
        await a.admin.Cordon(apb.EngineRef(engine=address))
        await eventually(lambda: not_routed(b, address), 20, "b to stop routing to it")
        await a.admin.RemoveEngine(apb.EngineRef(engine=address))
        await eventually(lambda: forgot(b, address), 20, "b to forget the removed engine")
        await assert_a_replica_started_now_has_no_engine(a)
        await b.admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
        await eventually(lambda: routes_to(a, address), 20, "a to route to it again")
    finally:
        await close_replica(b)
        await close_fleet(a)


async def test_a_config_engine_registered_again_and_removed_again_stays_removed(
    redis: RedisServer,
) -> None:
    """A config engine removed, registered again through the admin API and removed again: a
    replica started later with the same config leaves it out as the running ones do (found by
    the soak, seed 11, docs/soak.md: the second removal, of a record registered through the
    admin API, wrote no removal of a config engine, and the replica restarted afterwards routed
    to the engine and wrote its blocks into the index again)."""
    engine: EngineApp = await start_sim_engine("e0")
    a = await make_fleet(engines=[engine], index=shared_index(redis))
    address = a.address(engine)
    try:
        await a.admin.RemoveEngine(apb.EngineRef(engine=address))
        await a.admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
        await eventually(lambda: routes_to(a, address), 20, "a to route to it again")
        await a.admin.RemoveEngine(apb.EngineRef(engine=address))
        await assert_a_replica_started_now_has_no_engine(a)
    finally:
        await close_fleet(a)
        await engine.close()


async def test_a_config_engine_removed_stays_removed_after_redis_lost_the_membership(
    redis: RedisServer,
) -> None:
    """redis-server restarted empty: a replica writes its membership back, the removal of a
    config engine included, so a replica started later with the same config leaves it out as
    the running one does (found by the soak, docs/soak.md: the later replica routed to the
    removed engine and wrote its blocks into the index again)."""
    engine: EngineApp = await start_sim_engine("e0")
    a = await make_fleet(engines=[engine], index=shared_index(redis))
    address = a.address(engine)
    client = redis.client()
    try:
        await a.admin.RemoveEngine(apb.EngineRef(engine=address))
        await asyncio.to_thread(redis.kill)
        await asyncio.to_thread(redis.start)
        membership = "kvplane:{default:0}:fm"
        await eventually(
            lambda: client.hexists(membership, "v"), 20, "a to write its membership back"
        )
        await assert_a_replica_started_now_has_no_engine(a)
    finally:
        client.close()
        await close_fleet(a)
        await engine.close()


# Replicas that read the shared membership only when a test says so (`refresh`): the order in
# which they find Redis's loss is the test's.
READ_WHEN_TOLD = {"poll_interval_s": 3600}


async def restart_empty(redis: RedisServer) -> None:
    """redis-server restarted without its data (no persistence; no snapshot: `snapshot`'s
    gone)."""
    await asyncio.to_thread(redis.kill)
    (redis.workdir / "dump.rdb").unlink(missing_ok=True)
    await asyncio.to_thread(redis.start)


async def restart_from_snapshot(redis: RedisServer) -> None:
    """redis-server restarted with the data of its last snapshot (`snapshot`): the changes
    made since are lost, the hash's generation (`v`) is the snapshot's."""
    await asyncio.to_thread(redis.kill)
    await asyncio.to_thread(redis.start)


async def snapshot(redis: RedisServer) -> None:
    """An RDB snapshot of redis-server's data, loaded when it starts again."""
    await asyncio.to_thread(redis.command, "SAVE")


@contextlib.asynccontextmanager
async def replicas_reading_when_told(redis: RedisServer) -> AsyncIterator[tuple[Fleet, Fleet, str]]:
    """Two replicas that read the shared membership only when told (`READ_WHEN_TOLD`), and
    the address of an engine their config does not name."""
    a: Fleet = await make_fleet(engines=[], index=shared_index(redis), health=READ_WHEN_TOLD)
    b: Fleet = await make_fleet(engines=[], index=shared_index(redis), health=READ_WHEN_TOLD)
    engine = await start_sim_engine("e0")
    try:
        yield a, b, f"127.0.0.1:{engine.port}"
    finally:
        await close_replica(b)
        await close_fleet(a)
        await engine.close()


async def write_back_in_turn(first: Fleet, then: Fleet) -> None:
    """Redis lost the hash: `first` finds it so and writes its membership back, `then` finds
    another generation and adds its own, and `first` reads the merge."""
    for replica in (first, then, first):
        await replica.app.controller.membership.refresh()


async def removal_done(fleet: Fleet, address: str) -> None:
    """The replica's removal of the engine at `address`, begun by its read of the hash, is
    over (what the engine left dropped; slow after Redis lost the index, its source
    resubscribing). A read finding the engine registered again before then leaves it to the
    replica's next read (`Membership._apply`): a test reading back to back waits for it."""
    removal = fleet.app.controller.fleet.removal(address)
    if removal is not None:
        await removal


async def test_an_engine_removed_and_registered_again_between_two_reads_has_its_new_owner(
    redis: RedisServer,
) -> None:
    """Removed and registered again through one replica with another owner (or none) while
    the other does not read the membership: the other reports the owner the registration
    says. It used to keep the owner it read first, the engine being one it already had."""
    async with replicas_reading_when_told(redis) as (a, b, address):
        await a.admin.RegisterEngine(apb.RegisterEngineRequest(address=address, owner="old"))
        await b.app.controller.membership.refresh()
        assert (await workers(b))[address].owner == "old"
        for owner in ("new", ""):
            await a.admin.RemoveEngine(apb.EngineRef(engine=address))
            await a.admin.RegisterEngine(apb.RegisterEngineRequest(address=address, owner=owner))
            await b.app.controller.membership.refresh()
            assert (await workers(b))[address].owner == owner


async def test_replicas_finding_the_membership_lost_in_turn_keep_an_engine_registered_again(
    redis: RedisServer,
) -> None:
    """A config engine removed and registered again is the admin API's on the replica that
    saw it, a config engine on one started later. Redis loses the hash; the later replica
    writes its membership back first, without the registration: the other, finding a hash
    rewritten since its last read, adds its own (the registration) rather than taking the
    missing field for a removal (found by the soak, docs/soak.md: the first replica forgot
    the engine, the other kept routing to it)."""
    engine: EngineApp = await start_sim_engine("e0")
    a = await make_fleet(engines=[engine], index=shared_index(redis), health=READ_WHEN_TOLD)
    address = a.address(engine)
    b: Fleet | None = None
    try:
        await a.admin.RemoveEngine(apb.EngineRef(engine=address))
        await a.admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
        b = await make_fleet(engines=[engine], index=shared_index(redis), health=READ_WHEN_TOLD)
        await asyncio.to_thread(redis.flushall)
        await b.app.controller.membership.refresh()  # writes its membership back
        await a.app.controller.membership.refresh()
        await b.app.controller.membership.refresh()
        assert address in await workers(a)
        assert address in await workers(b)
    finally:
        if b is not None:
            await close_replica(b)
        await close_fleet(a)
        await engine.close()


async def test_a_replica_started_while_the_membership_is_lost_learns_a_removal_from_the_others(
    redis: RedisServer,
) -> None:
    """Redis lost the hash and a replica starts before the running one wrote it back: it
    writes its config's engines back, a config engine removed before included; the running
    one, finding the hash rewritten, adds the removal, and the new replica drops the engine."""
    engine: EngineApp = await start_sim_engine("e0")
    a = await make_fleet(engines=[engine], index=shared_index(redis), health=READ_WHEN_TOLD)
    address = a.address(engine)
    try:
        await a.admin.RemoveEngine(apb.EngineRef(engine=address))
        await asyncio.to_thread(redis.flushall)
        later = await start_controller(a.app.controller.config)  # writes its membership back
        try:
            await a.app.controller.membership.refresh()
            await later.controller.membership.refresh()
            assert later.controller.fleet.registry.records() == []
        finally:
            await later.close(0.2)
    finally:
        await close_fleet(a)
        await engine.close()


async def test_a_removal_through_one_replica_survives_redis_restarted_empty_before_the_other_read(
    redis: RedisServer,
) -> None:
    """X removed through a; redis-server restarts empty before b read the removal, and b
    writes its membership back first, X registered in it: the removal's tombstone, which a
    writes back, is newer, and X stays removed on both. Before, a took b's write-back for a
    registration and both routed to X again (docs/controller.md used to list it as not
    handled)."""
    async with replicas_reading_when_told(redis) as (a, b, address):
        await a.admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
        await b.app.controller.membership.refresh()
        assert address in await workers(b)
        await a.admin.RemoveEngine(apb.EngineRef(engine=address))
        await restart_empty(redis)
        await write_back_in_turn(b, a)
        assert address not in await workers(a)
        assert address not in await workers(b)


async def test_a_cordon_survives_redis_restarted_empty(redis: RedisServer) -> None:
    """X registered and cordoned through a, read by b; redis-server restarts empty and each
    replica writes its membership back: X stays cordoned on both, out of routing. A
    write-back without the cordons uncordoned it on every replica."""
    async with replicas_reading_when_told(redis) as (a, b, address):
        await a.admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
        await a.admin.Cordon(apb.EngineRef(engine=address))
        await b.app.controller.membership.refresh()
        await restart_empty(redis)
        await write_back_in_turn(a, b)
        await b.app.controller.membership.refresh()
        for replica in (a, b):
            assert (await workers(replica))[address].cordoned
            assert not await routes_to(replica, address)


async def test_an_uncordon_through_one_replica_survives_redis_restarted_empty_before_the_other_read(
    redis: RedisServer,
) -> None:
    """X cordoned, then uncordoned through a; redis-server restarts empty before b read the
    uncordon, and b writes back its membership, X cordoned in it: X stays uncordoned on both.
    Before, both cordoned X again."""
    async with replicas_reading_when_told(redis) as (a, b, address):
        await a.admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
        await a.admin.Cordon(apb.EngineRef(engine=address))
        await b.app.controller.membership.refresh()
        assert (await workers(b))[address].cordoned
        await a.admin.Uncordon(apb.EngineRef(engine=address))
        await restart_empty(redis)
        await write_back_in_turn(b, a)
        assert not (await workers(a))[address].cordoned
        assert not (await workers(b))[address].cordoned


async def test_an_uncordon_through_a_replica_that_had_not_read_the_cordon_survives_redis_restarted(
    redis: RedisServer,
) -> None:
    """X cordoned through b; redis-server restarts empty before a read the cordon, and X is
    uncordoned through a (a no-op in a's view, which Redis had lost the cordon from): b then
    writes back its membership, X cordoned in it, but the uncordon is newer, and X stays
    uncordoned on both. Before, a deletion of a field the hash did not hold left no
    tombstone, and b's write-back cordoned X again on both after the uncordon succeeded."""
    async with replicas_reading_when_told(redis) as (a, b, address):
        await a.admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
        await b.admin.Cordon(apb.EngineRef(engine=address))
        await restart_empty(redis)
        await a.admin.Uncordon(apb.EngineRef(engine=address))  # writes a's view back first
        await write_back_in_turn(b, a)
        assert not (await workers(a))[address].cordoned
        assert not (await workers(b))[address].cordoned


async def test_an_engine_registered_afresh_is_not_cordoned_by_a_cordon_made_after_its_removal(
    redis: RedisServer,
) -> None:
    """X removed through b; redis-server restarts empty before a read the removal, and X is
    cordoned through a (its view, written back, still has X); b writes its view back, the
    removal newer than a's: X is removed on both, its cordon left in the hash. X registered
    again through b is a fresh engine, not cordoned, on both, as b answers it. Before, the
    registration left the cordon in the hash, and both replicas cordoned X at their next
    read."""
    async with replicas_reading_when_told(redis) as (a, b, address):
        await a.admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
        await b.admin.RemoveEngine(apb.EngineRef(engine=address))
        await restart_empty(redis)
        await a.admin.Cordon(apb.EngineRef(engine=address))
        await write_back_in_turn(b, a)
        assert address not in await workers(a)
        await removal_done(a, address)
        await b.admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
        for replica in (a, b):
            await replica.app.controller.membership.refresh()
            assert not (await workers(replica))[address].cordoned


@pytest.mark.parametrize("first", ["a", "b"])
async def test_a_removal_after_redis_last_saved_survives_redis_restarted_from_the_snapshot(
    redis: RedisServer, first: str
) -> None:
    """X registered through a, read by b, and Redis saves its data; X removed through a, and
    redis-server restarts from the snapshot, X registered in it, with the generation both
    replicas know: the replica that knew of a later change than the hash holds (a, the
    removal) writes its membership back, into a new generation, and X stays removed on both,
    whichever replica reads the hash first. Before, the replicas took the snapshot for the
    membership, and both routed to X again."""
    async with replicas_reading_when_told(redis) as (a, b, address):
        await a.admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
        await b.app.controller.membership.refresh()
        await snapshot(redis)
        await a.admin.RemoveEngine(apb.EngineRef(engine=address))
        await restart_from_snapshot(redis)
        for replica in (a, b, a) if first == "a" else (b, a, b, a):
            await replica.app.controller.membership.refresh()
        assert address not in await workers(a)
        assert address not in await workers(b)


async def test_an_engine_registered_again_after_a_removal_survives_redis_restarted_empty(
    redis: RedisServer,
) -> None:
    """X removed through a, b reads the removal (its tombstone), X registered again through a;
    redis-server restarts empty before b read the registration: b writes the tombstone back
    first, but the registration is newer, and both route to X."""
    async with replicas_reading_when_told(redis) as (a, b, address):
        await a.admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
        await a.admin.RemoveEngine(apb.EngineRef(engine=address))
        await b.app.controller.membership.refresh()
        await a.admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
        await restart_empty(redis)
        await write_back_in_turn(b, a)
        assert address in await workers(a)
        assert address in await workers(b)


async def test_a_change_redis_does_not_take_is_refused_and_changes_nothing(
    redis: RedisServer,
) -> None:
    (a,) = await replicas_without_engines(redis, 1)
    engine = await start_sim_engine("e0")
    address = f"127.0.0.1:{engine.port}"
    try:
        redis.stop()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await a.admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert "Redis" in (err.value.details() or "")
        assert await workers(a) == {}
    finally:
        await close_fleet(a)
        await engine.close()


async def test_a_registration_redis_reads_but_does_not_write_is_refused_and_changes_nothing(
    redis: RedisServer,
) -> None:
    """Redis answers reads but refuses writes (`min-replicas-to-write` with no replica): the
    registration is refused, UNAVAILABLE, and the engine is not registered on this replica
    alone, where the others would never learn of it."""
    (a,) = await replicas_without_engines(redis, 1)
    engine = await start_sim_engine("e0")
    address = f"127.0.0.1:{engine.port}"
    try:
        await asyncio.to_thread(redis.command, "CONFIG", "SET", "min-replicas-to-write", "1")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await a.admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert "NOREPLICAS" in (err.value.details() or ""), err.value.details()
        assert await workers(a) == {}
    finally:
        await asyncio.to_thread(redis.command, "CONFIG", "SET", "min-replicas-to-write", "0")
        await close_fleet(a)
        await engine.close()


async def test_admin_calls_landing_on_a_replica_that_has_not_read_the_change_before_them_act_on_it(
    redis: RedisServer,
) -> None:
    """Each `kvplane admin` call is a connection of its own, which the load balancer may send
    to another replica than the call before: one that has not read the membership since
    (here: never unless told; live, up to `health.poll_interval_s`). Registered through a,
    the engine is cordoned, drained and removed through b; removed through a, it is
    registered again through b, and stays registered on both. Before, b answered NOT_FOUND
    to the cordon and the drain, and ALREADY_EXISTS to the registration, after which both
    replicas dropped the engine at their next read."""
    a: Fleet = await make_fleet(engines=[], index=shared_index(redis), health=READ_WHEN_TOLD)
    b: Fleet = await make_fleet(engines=[], index=shared_index(redis), health=READ_WHEN_TOLD)
    engine = await start_sim_engine("e0")
    address = f"127.0.0.1:{engine.port}"
    try:
        await a.admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
        assert (await b.admin.Cordon(apb.EngineRef(engine=address))).cordoned
        await a.app.controller.membership.refresh()
        assert (await workers(a))[address].cordoned

        await a.admin.RemoveEngine(apb.EngineRef(engine=address))
        await b.admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
        for replica in a, b:
            await replica.app.controller.membership.refresh()
            assert not (await workers(replica))[address].cordoned

        await a.admin.RemoveEngine(apb.EngineRef(engine=address))
        await a.admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
        await eventually(lambda: routes_to(a, address), 20, "a to route to the engine")
        drained = b.admin.DrainEngine(apb.DrainEngineRequest(engine=address))
        assert [r.state async for r in drained][-1] == pb.DRAIN_STATE_COMPLETE
        await b.admin.RemoveEngine(apb.EngineRef(engine=address))
        await a.app.controller.membership.refresh()
        assert await workers(a) == {}
    finally:
        await close_replica(b)
        await close_fleet(a)
        await engine.close()


async def test_an_engine_drained_through_one_replica_and_restarted_is_no_flap_to_the_other(
    redis: RedisServer,
) -> None:
    """Drained through a, then restarted (a new process), twice: b, whose polls never see the
    engine say DRAINING (its health is read hourly here; live, an engine that drains and
    stops within a poll interval), sees it leave ready each time, reads the drain from the
    shared membership then, and takes the leave for the drain: no flap, no hold-down. Before,
    b counted two flaps and held the engine down (two flaps hold it here), routing around it
    while a routed to it."""
    engine: EngineApp = await start_sim_engine("e0")
    a = await make_fleet(engines=[engine], index=shared_index(redis))
    hourly = {"poll_interval_s": 3600, "hold_down_after_flaps": 2, **LONG_HOLD_DOWN}
    b = await make_fleet(engines=[engine], index=shared_index(redis), health=hourly)
    address = a.address(engine)
    registry = b.app.controller.fleet.registry
    try:
        await eventually(lambda: routes_to(b, address), 20, "b to route to the engine")
        for restart in ("e0-1", "e0-2"):
            drained = a.admin.DrainEngine(apb.DrainEngineRequest(engine=address))
            assert [r.state async for r in drained][-1] == pb.DRAIN_STATE_COMPLETE
            await a.restart_engine(address, restart)
            await eventually(functools.partial(ready_as, registry, address, restart), 20, "b")
        record = registry.get(address)
        assert (record.state, record.num_flaps) == (EngineState.READY, 0), record.last_error
        assert await routes_to(b, address)
    finally:
        await close_replica(b)
        await close_fleet(a)


def ready_as(registry: Registry, address: str, instance_id: str) -> bool:
    """Whether the engine's process `instance_id` says it is ready (held down or not)."""
    record = registry.get(address)
    return record.engine_id == instance_id and record.state in (
        EngineState.READY,
        EngineState.HELD_DOWN,
    )


async def test_a_drain_the_engine_did_not_take_is_no_drain_to_the_other_replica(
    redis: RedisServer, tmp_path: Path
) -> None:
    """The engine hangs (SIGSTOP: its connections stay open); a DrainEngine through a gets no
    answer in time (UNAVAILABLE), and a takes the drain back. b's polls time out meanwhile:
    the engine leaves ready there, a flap of its own, not the drain, which the engine never
    took. Once it answers again, both route to it. Before, the drain stayed in the shared
    membership: b took the leave for it and kept the engine out of routing as draining,
    for as long as the process lived."""
    engine = await EngineProcess.start(tmp_path, "e0")
    quick = {"poll_interval_s": 0.2, "rpc_timeout_s": 1.0}
    a = await make_fleet(engines=[engine], index=shared_index(redis), health=quick)
    b = await make_fleet(engines=[engine], index=shared_index(redis), health=quick)
    address = f"127.0.0.1:{engine.port}"
    records = [fleet.app.controller.fleet.registry for fleet in (a, b)]
    try:
        for fleet in (a, b):
            await eventually(functools.partial(routes_to, fleet, address), 20, "routed to")
        engine.stop()
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in a.admin.DrainEngine(apb.DrainEngineRequest(engine=address)):
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
            await eventually(lambda: not records[1].get(address).routable, 20, "b's leave")
        finally:
            engine.resume()
        answered = (EngineState.READY, EngineState.DRAINING)
        await eventually(lambda: records[0].get(address).state in answered, 20, "a's view")
        if records[0].get(address).state is EngineState.DRAINING:
            # It took the Drain it woke up to (a race of its own): a drain on both.
            draining = EngineState.DRAINING
            await eventually(lambda: records[1].get(address).state is draining, 20, "b's")
            return
        await eventually(lambda: records[1].get(address).routable, 20, "b to route to it")
        assert records[1].get(address).num_flaps == 1
    finally:
        await close_replica(b)
        await close_fleet(a)
        await engine.close()


async def test_an_engine_leaving_ready_after_the_membership_closed_is_still_followed(
    redis: RedisServer,
) -> None:
    """A controller closing closes its shared membership before its fleet, whose polls go
    on meanwhile (removals awaited, the engines closed one by one): an engine that stops
    then is seen leave ready, judged without the other replicas' drains. Before, its poll
    asked the closed membership for them, failed an assertion and died, and the engine
    stayed routed to until the fleet closed."""
    engine: EngineApp = await start_sim_engine("e0")
    a = await make_fleet(engines=[engine], index=shared_index(redis))
    address = a.address(engine)
    registry = a.app.controller.fleet.registry
    try:
        await eventually(lambda: routes_to(a, address), 20, "a to route to the engine")
        await a.app.controller.membership.close()
        await engine.close()
        await eventually(lambda: not registry.get(address).routable, 20, "the engine's leave")
    finally:
        await close_fleet(a)


async def test_a_registration_arriving_while_a_read_of_the_hash_removes_the_engine_waits_for_it(
    redis: RedisServer,
) -> None:
    """b read the hash (its periodic read) and began removing the engine removed through a:
    a registration of its address through b, arriving while that removal drops the engine's
    index entries (held here by Redis refusing writes), waits for it and registers the engine
    afresh. Before, only a removal the registration's own read began was waited for: it was
    refused ALREADY_EXISTS "being removed"."""
    rare: dict[str, Any] = {"poll_interval_s": 3600}  # each reads the hash when told to only
    # Redis's writes wait for the test's UNPAUSE, however long (the removal with them).
    index = {**shared_index(redis), "redis": {"timeout_s": 120.0}}
    a: Fleet = await make_fleet(engines=[], index=index, health=rare)
    b: Fleet = await make_fleet(engines=[], index=index, health=rare)
    engine = await start_sim_engine("e0")
    address = f"127.0.0.1:{engine.port}"
    fleet_b, membership_b = b.app.controller.fleet, b.app.controller.membership
    register = None
    try:
        await a.admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
        await membership_b.refresh()
        await a.admin.RemoveEngine(apb.EngineRef(engine=address))  # a's lease released
        lease = fleet_b._engines[address].lease
        assert lease is not None
        await eventually(lambda: lease.held, 20, "b to write the engine's entries")
        redis.command("CLIENT", "PAUSE", 60_000, "WRITE")  # b's removal of its entries waits
        await membership_b.refresh()  # b's periodic read: the engine is being removed
        assert address in getattr(fleet_b, "_removing", fleet_b._removals)
        reads = hash_reads(redis)
        register = asyncio.ensure_future(
            b.admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
        )
        # The registration read the hash (reads go on): it waits for the removal, or not.
        await eventually(lambda: register.done() or hash_reads(redis) > reads, 20, "its read")
        # b's other membership calls go on meanwhile (its periodic read here): the
        # registration waits without holding the membership. Before, they waited as long.
        read = asyncio.ensure_future(membership_b.refresh())
        await eventually(read.done, 20, "b's read of the hash while the registration waits")
        assert not register.done()  # (the removal waits for Redis's writes)
        redis.command("CLIENT", "UNPAUSE")
        await register
        await eventually(lambda: routes_to(b, address), 20, "b to route to it again")
        await a.app.controller.membership.refresh()
        await eventually(lambda: routes_to(a, address), 20, "a to route to it again")
    finally:
        redis.command("CLIENT", "UNPAUSE")
        if register is not None and not register.done():
            register.cancel()
        await close_replica(b)
        await close_fleet(a)
        await engine.close()


def hash_reads(redis: RedisServer) -> int:
    """How many HGETALL calls Redis has answered (the membership hash's reads)."""
    stats: dict[str, Any] = redis.command("INFO", "commandstats")
    return int(stats.get("cmdstat_hgetall", {}).get("calls", 0))
