"""The admin API's membership RPCs refuse bad input with the right status and leave the fleet
as it was: RegisterEngine of an address no engine can have, or of one already registered;
RemoveEngine of an engine the fleet does not have; RegisterEngine of an address whose removal
is still running; DrainEngine of an engine removed while the drain is recorded; RegisterEngine
of the controller's own address."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from controller.registry import EngineState
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from tests.controller.conftest import Fleet, close_fleet, generate_request, make_fleet
from tests.controller.paused_index import PausedIndex
from tests.controller.test_gateway import PREFIX, generate, holder_of
from tests.polling import eventually

pytestmark = pytest.mark.timeout(60)


async def workers(fleet: Fleet) -> list[tuple[str, str, bool]]:
    reply = await fleet.admin.ListWorkers(apb.ListWorkersRequest())
    return [(w.address, w.instance_id, w.routable) for w in reply.workers]


@pytest.mark.parametrize(
    "address",
    [
        "garbage",
        "",
        "127.0.0.1:",
        "127.0.0.1:0",
        "127.0.0.1:70000",
        "127.0.0.1:\u0663",
        "a b:9001",
        " 127.0.0.1:9001",
        "http://127.0.0.1:9001",
        "::1:9001",
        "127.0.0.1\x00.example:9001",  # gRPC would dial 127.0.0.1:443
    ],
)
async def test_register_engine_refuses_an_address_no_engine_can_have(
    fleet: Fleet, address: str
) -> None:
    before = await workers(fleet)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await fleet.admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert await workers(fleet) == before


async def test_register_engine_refuses_an_engine_registered_already(fleet: Fleet) -> None:
    before = await workers(fleet)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await fleet.admin.RegisterEngine(
            apb.RegisterEngineRequest(address=fleet.address(fleet.engines[0]), kv_events="none")
        )
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert await workers(fleet) == before
    record = fleet.app.controller.fleet.registry.get(fleet.address(fleet.engines[0]))
    assert (record.source, record.kv_events) == ("config", "grpc")


@pytest.mark.parametrize("engine", ["nope", "127.0.0.1:1"])
async def test_remove_engine_of_an_unknown_engine_is_not_found(fleet: Fleet, engine: str) -> None:
    before = await workers(fleet)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await fleet.admin.RemoveEngine(apb.EngineRef(engine=engine))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert await workers(fleet) == before


@pytest.mark.parametrize("rpc", ["RemoveEngine", "Cordon", "Uncordon"])
async def test_an_empty_engine_reference_is_invalid_even_where_an_engine_has_no_id(
    fleet: Fleet, rpc: str
) -> None:
    """An engine may leave its instance id empty: "" must not name it."""
    registry = fleet.app.controller.fleet.registry
    record = registry.get(fleet.address(fleet.engines[0]))
    assert record.identity is not None
    record.identity = dataclasses.replace(record.identity, instance_id="")
    before = await workers(fleet)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await getattr(fleet.admin, rpc)(apb.EngineRef(engine=""))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await workers(fleet) == before


async def test_an_engine_registered_again_while_its_removal_runs_is_taken_once_it_ends() -> None:
    """RemoveEngine drops what the engine left (its index entries, the router's accounting)
    after it leaves the registry: the same address registered meanwhile would have its new
    entries dropped with the old ones, and its warm cache would go unrouted. The registration
    waits for the removal (before, it was refused ALREADY_EXISTS, "being removed"), then
    takes the engine afresh."""
    index = PausedIndex()
    fleet = await make_fleet(2, index_backend=index)
    try:
        await generate(fleet, generate_request("warm", [*PREFIX, 1]))
        holder = await holder_of(fleet, PREFIX, 4)
        index.pause("remove_worker")
        removal = asyncio.ensure_future(fleet.admin.RemoveEngine(apb.EngineRef(engine=holder)))
        await index.paused.wait()
        found = watch_removals(fleet)
        register = asyncio.ensure_future(
            fleet.admin.RegisterEngine(apb.RegisterEngineRequest(address=holder))
        )
        await eventually(lambda: register.done() or found.is_set(), 30, "the registration")
        index.resume.set()
        await removal
        await register
        await fleet.wait_routable(2)
        assert await holder_of(fleet, PREFIX, 4) == holder  # its cache, from a new snapshot
    finally:
        index.resume.set()
        await close_fleet(fleet)


async def test_match_leaves_out_an_engine_removed_while_the_index_answers() -> None:
    """`match` lists the engines, then asks the index: an engine removed meanwhile (here a
    cordoned one) has left the fleet and is not listed. It was listed as one the router may
    choose (`out_of_routing` "", its cordon gone with its record), with nothing held."""
    index = PausedIndex()
    fleet = await make_fleet(2, index_backend=index)
    try:
        await generate(fleet, generate_request("warm", [*PREFIX, 1]))
        holder = await holder_of(fleet, PREFIX, 4)
        other = next(a for a in map(fleet.address, fleet.engines) if a != holder)
        await fleet.admin.Cordon(apb.EngineRef(engine=holder))
        query = apb.PromptQuery(token_ids=pb.TokenIds(ids=[*PREFIX, 5]))
        before = await fleet.admin.Match(query)
        assert {m.engine: m.out_of_routing for m in before.matches} == {
            holder: "cordoned", other: "",
        }  # fmt: skip
        index.pause("match_prefix_by_tier")
        matching = asyncio.ensure_future(fleet.admin.Match(query))
        await index.paused.wait()
        await fleet.admin.RemoveEngine(apb.EngineRef(engine=holder))
        index.resume.set()
        reply = await matching
        assert [(m.engine, m.out_of_routing) for m in reply.matches] == [(other, "")]
    finally:
        index.resume.set()
        await close_fleet(fleet)


def watch_removals(fleet: Fleet) -> asyncio.Event:
    """Set once a caller of the fleet's `removal` (the registration) finds one running."""
    found = asyncio.Event()
    engines, removal = fleet.app.controller.fleet, fleet.app.controller.fleet.removal

    def watched(address: str) -> asyncio.Task[None] | None:
        running = removal(address)
        if running is not None:
            found.set()
        return running

    engines.removal = watched  # type: ignore[method-assign]
    return found


async def test_a_removal_whose_caller_gives_up_still_drops_what_the_engine_left() -> None:
    """RemoveEngine's client may stop waiting (its deadline, Ctrl-C) while the removal drops
    the engine's index entries: the engine has left the registry by then, so nothing would
    drop them later. The removal runs to its end all the same."""
    index = PausedIndex()
    fleet = await make_fleet(2, index_backend=index)
    try:
        await generate(fleet, generate_request("warm", [*PREFIX, 1]))
        holder = await holder_of(fleet, PREFIX, 4)
        index.pause("remove_worker")
        removal = asyncio.create_task(fleet.app.controller.fleet.remove_engine(holder))
        await index.paused.wait()
        removal.cancel()  # what a cancelled RemoveEngine does to its handler
        await asyncio.wait([removal])
        index.resume.set()

        async def dropped() -> bool:
            return holder not in {w.worker_id for w in (await index.stats()).workers}

        await eventually(dropped, 30, "the removed engine's index entries to be dropped")
        await fleet.admin.RegisterEngine(apb.RegisterEngineRequest(address=holder))
        await fleet.wait_routable(2)
    finally:
        index.resume.set()
        await close_fleet(fleet)


async def test_a_drain_of_an_engine_removed_while_it_is_recorded_is_not_found(fleet: Fleet) -> None:
    """DrainEngine records the drain (an await) before it sends it: an engine removed
    meanwhile is NOT_FOUND, as one never registered, not an internal error. The fleet's
    change notification is held so that the removal lands inside that await."""
    service = fleet.app.controller.fleet
    address = fleet.address(fleet.engines[0])
    async with service._changed:  # DrainEngine's notification of the drain waits for it
        drain = asyncio.ensure_future(
            anext(aiter(fleet.admin.DrainEngine(apb.DrainEngineRequest(engine=address))))
        )
        await eventually(lambda: service.registry.get(address).drain_requested)
        removal = asyncio.ensure_future(service.remove_engine(address))
        await eventually(lambda: service.registry.by_engine_id(address) is None)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await drain
    assert err.value.code() == grpc.StatusCode.NOT_FOUND, err.value.details()
    assert "removed" in (err.value.details() or "")
    await removal
    assert address not in [w for w, _, _ in await workers(fleet)]


async def test_the_controller_registered_as_an_engine_is_refused_and_never_routed_to(
    fleet: Fleet,
) -> None:
    """RegisterEngine of the controller's own address: its gateway answers GetEngineInfo like
    an engine, and a request routed there comes back in (here it failed as a duplicate of
    itself). It is rejected as incompatible, naming itself, and every request reaches a real
    engine."""
    await fleet.admin.RegisterEngine(
        apb.RegisterEngineRequest(address=fleet.target, kv_events="none")
    )
    registry = fleet.app.controller.fleet.registry
    await eventually(
        lambda: registry.get(fleet.target).state is EngineState.INCOMPATIBLE,
        what="the controller's own address rejected",
    )
    assert "the controller itself" in registry.get(fleet.target).last_error
    for i in range(6):
        responses = await generate(fleet, generate_request(f"self-{i}", PREFIX))
        assert responses[-1].WhichOneof("event") == "finished", responses[-1]
