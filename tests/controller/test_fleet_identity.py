"""An engine whose identity changes at the same address, through real servers: a process
restarted with another model, block size and role is read again; a new process named by
GetLoad takes no traffic until the old one's blocks are gone; a process replaced by an
incompatible build leaves the index at once, and its compatible successor is followed afresh;
an address found to be another address's engine drops what it indexed for that process; an
engine restarted under its instance id between two polls is read again when its KV-event
stream breaks sequence (SubscribeKvEvents, or a ZMQ seq reset); one restarted with another
config under its instance id as a poll fails is a new process, its stream's break not
seen yet."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from controller.registry import EngineState
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import (
    EngineFleet,
    Fleet,
    close_fleet,
    generate_request,
    make_fleet,
    start_sim_engine,
)
from tests.controller.fronted_engine import CancelsAPoll, Forwarding, start_fronted_engine
from tests.controller.test_fleet_events import (
    WAIT_S,
    generate,
    index_through_zmq,
    start_zmq_engine,
    zmq_events_config,
    zmq_fleet,
)
from tests.controller.test_fleet_restarts import wait_unreachable
from tests.controller.test_gateway import PREFIX, holder_of, status_of
from tests.polling import eventually

pytestmark = pytest.mark.timeout(60)

Context = grpc.aio.ServicerContext[Any, Any]

# Polls an hour apart: within a test, only an engine's KV-event stream can say it restarted.
HOURLY = {"poll_interval_s": 3600.0, "load_poll_interval_s": 3600.0}


class Replaceable(Forwarding):
    """A sim engine whose process the test replaces in place: GetEngineInfo and GetLoad name
    `instance`, GetEngineInfo advertises contract `revision`, and waits for `release` (set
    unless a test holds the identity fetch), saying `identity_asked` first."""

    def __init__(self, inner: pb_grpc.OpenEngineAsyncStub) -> None:
        super().__init__(inner)
        self.instance = "p1"
        self.revision = 1
        self.identity_asked = asyncio.Event()
        self.release = asyncio.Event()
        self.release.set()

    def replace(self, instance: str, revision: int = 1) -> None:
        self.instance, self.revision = instance, revision

    async def GetEngineInfo(self, request: pb.GetEngineInfoRequest, context: Context) -> Any:
        self.identity_asked.set()
        await self.release.wait()
        info = await self.inner.GetEngineInfo(request)
        info.instance_id = self.instance
        info.schema_revision = info.minimum_client_revision = self.revision
        return info

    async def GetLoad(self, request: pb.GetLoadRequest, context: Context) -> Any:
        load = await self.inner.GetLoad(request)
        load.instance_id = self.instance
        return load


async def indexed_workers(fleet: EngineFleet[Any]) -> set[str]:
    index = fleet.app.controller.index
    assert index is not None
    return {w.worker_id for w in (await index.stats()).workers if w.num_blocks}


async def test_an_engine_restarted_as_another_model_block_size_and_role_is_read_again() -> None:
    engines = [
        await start_sim_engine("a", served_model_name="small", block_size=16),
        await start_sim_engine("other"),
    ]
    fleet = await make_fleet(engines=engines)
    try:
        old = engines[0]
        address = fleet.address(old)
        await old.close()
        await wait_unreachable(fleet, address)
        fleet.engines[0] = await start_sim_engine(
            "b", port=old.port, served_model_name="big", block_size=32, role="prefill"
        )
        registry = fleet.app.controller.fleet.registry
        await fleet.app.controller.fleet.wait_for(
            lambda: registry.get(address).engine_id == "b" and registry.get(address).routable,
            WAIT_S,
        )
        workers = await fleet.admin.ListWorkers(apb.ListWorkersRequest())
        (worker,) = [w for w in workers.workers if w.address == address]
        assert (worker.instance_id, list(worker.models)) == ("b", ["big"])
        assert (worker.block_size, worker.role) == (32, "prefill")
        info = await fleet.gateway.GetEngineInfo(pb.GetEngineInfoRequest())
        assert sorted(info.supported_models) == ["big", "sim"]
        small = fleet.admin.Route(apb.PromptQuery(token_ids=pb.TokenIds(ids=PREFIX), model="small"))
        assert await status_of(small) == grpc.StatusCode.NOT_FOUND
    finally:
        await close_fleet(fleet)


async def test_an_engine_restarted_between_polls_under_its_instance_id_is_read_again() -> None:
    """An engine restarted under the instance id its config sets, with another block size,
    between two polls (an hour apart here): no poll failed and GetLoad names the same
    process, so only its KV-event stream says so, by breaking sequence. Its identity is read
    again at once: admin `workers` shows the new block size, and prompts are matched in it."""
    engine = await start_sim_engine("a", block_size=16)
    fleet = await make_fleet(engines=[engine], health=HOURLY)
    try:
        address = fleet.address(engine)
        await generate(fleet, generate_request("warm", [*PREFIX, 1]))
        assert await holder_of(fleet, PREFIX, 4) == address  # 4 blocks of 16
        await engine.close()
        fleet.engines[0] = await start_sim_engine("a", port=engine.port, block_size=32)
        registry = fleet.app.controller.fleet.registry

        def read_again() -> bool:
            identity = registry.get(address).identity
            return identity is not None and identity.block_size == 32

        await fleet.app.controller.fleet.wait_for(read_again, WAIT_S)
        workers = await fleet.admin.ListWorkers(apb.ListWorkersRequest())
        assert [(w.instance_id, w.block_size) for w in workers.workers] == [("a", 32)]
        await fleet.app.controller.fleet.wait_for(lambda: registry.get(address).routable, WAIT_S)
        await generate(fleet, generate_request("again", [*PREFIX, 1]))
        assert await holder_of(fleet, PREFIX, 2) == address  # its cache, in blocks of 32
        match = await fleet.admin.Match(apb.PromptQuery(token_ids=pb.TokenIds(ids=PREFIX)))
        assert (match.block_size, match.num_blocks) == (32, 2)
    finally:
        await close_fleet(fleet)


async def publish_until(fleet: Fleet, done: Callable[[], bool]) -> None:
    """Send fresh prompts through the gateway until `done()` holds after a registry change. A
    restarted ZMQ publisher says nothing until it caches something, and a SUB socket rejoins
    it asynchronously: what it publishes before then is missed, the next message is not."""
    controller_fleet = fleet.app.controller.fleet
    async with asyncio.timeout(WAIT_S):
        for n in itertools.count():
            if done():
                return
            start = 20_000 + 100 * n
            await generate(fleet, generate_request(f"p{n}", list(range(start, start + 40))))
            with contextlib.suppress(TimeoutError):  # not yet: one more prompt
                await controller_fleet.wait_for(done, 0.2)


class ZmqOnly(Forwarding):
    """An engine without SubscribeKvEvents (UNIMPLEMENTED) that advertises its ZMQ publisher:
    the controller falls back to following that."""

    async def SubscribeKvEvents(
        self, request: pb.SubscribeKvEventsRequest, context: Context
    ) -> AsyncIterator[pb.SubscribeKvEventsResponse]:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no SubscribeKvEvents here")
        yield pb.SubscribeKvEventsResponse()  # (never reached: makes this a stream)

    async def GetKvEventSources(
        self, request: pb.GetKvEventSourcesRequest, context: Context
    ) -> Any:
        return await self.inner.GetKvEventSources(request)


@pytest.mark.parametrize("followed", ["kv_events: zmq", "fallback from SubscribeKvEvents"])
async def test_an_engine_restarted_between_polls_on_its_zmq_endpoints_is_read_again(
    followed: str,
) -> None:
    """As above, with the engine's KV events followed on ZMQ (configured, or as the fallback
    of an engine without SubscribeKvEvents): the new process publishes on the same endpoints
    from seq 0 again (WIRE.md: a seq reset), which is all that says it restarted. Its identity
    is read again at once: admin `workers` shows the new block size, and prompts are matched
    in it."""
    if followed == "kv_events: zmq":
        engine = await start_zmq_engine("a", block_size=16)
        fleet: EngineFleet[Any] = await zmq_fleet([engine], health=HOURLY)
    else:
        front = await start_fronted_engine(
            "a", ZmqOnly, kv_events=zmq_events_config(), block_size=16
        )
        engine = front.inner
        fleet = await make_fleet(engines=[front], health=HOURLY)
    try:
        address = fleet.address(fleet.engines[0])
        _, holder = await index_through_zmq(fleet, 1000)
        assert holder == address
        publisher = engine.publisher
        assert publisher is not None and publisher.bound_replay_endpoint is not None
        endpoints = (publisher.bound_endpoint, publisher.bound_replay_endpoint)
        await engine.close()
        restarted = await start_zmq_engine("a", engine.port, endpoints=endpoints, block_size=32)
        if followed == "kv_events: zmq":
            fleet.engines[0] = restarted
        else:
            front.inner = restarted
        registry = fleet.app.controller.fleet.registry

        def read_again() -> bool:
            identity = registry.get(address).identity
            return identity is not None and identity.block_size == 32

        await publish_until(fleet, read_again)
        workers = await fleet.admin.ListWorkers(apb.ListWorkersRequest())
        assert [(w.instance_id, w.block_size) for w in workers.workers] == [("a", 32)]
        await fleet.app.controller.fleet.wait_for(lambda: registry.get(address).routable, WAIT_S)
        prefix, holder = await index_through_zmq(fleet, 10_000, block_size=32)
        assert holder == address  # its cache, in blocks of 32
        match = await fleet.admin.Match(apb.PromptQuery(token_ids=pb.TokenIds(ids=prefix)))
        assert (match.block_size, match.num_blocks) == (32, 2)
    finally:
        await close_fleet(fleet)


async def test_a_new_process_named_by_get_load_takes_no_traffic_until_its_identity_is_in() -> None:
    """GetLoad names a new process (restarted faster than a poll): until its identity is read
    and the old process's blocks are dropped, those blocks would draw requests to it. A long
    `rpc_timeout_s` keeps the held identity fetch from failing as a timeout meanwhile."""
    engine = await start_fronted_engine("r", Replaceable)
    fleet = await make_fleet(engines=[engine], health={"rpc_timeout_s": 60})
    try:
        address = f"127.0.0.1:{engine.port}"
        await generate(fleet, generate_request("warm", [*PREFIX, 1]))
        assert await holder_of(fleet, PREFIX, 4) == address  # its blocks would draw requests
        engine.servicer.release.clear()
        engine.servicer.identity_asked.clear()
        engine.servicer.replace("p2")
        await engine.servicer.identity_asked.wait()  # the new process's identity is being read
        registry = fleet.app.controller.fleet.registry
        assert not registry.get(address).routable
        route = fleet.admin.Route(apb.PromptQuery(token_ids=pb.TokenIds(ids=[*PREFIX, 3])))
        assert await status_of(route) == grpc.StatusCode.UNAVAILABLE
        engine.servicer.release.set()
        await fleet.app.controller.fleet.wait_for(
            lambda: registry.get(address).engine_id == "p2" and registry.get(address).routable,
            WAIT_S,
        )
    finally:
        engine.servicer.release.set()
        await close_fleet(fleet)


async def test_an_engine_restarted_with_another_config_as_its_poll_fails_is_a_new_process() -> None:
    """A rolling config change: the engine restarts under the instance id its config sets,
    with other `num_kv_blocks`. The poll that meets the old process shutting down fails
    CANCELLED (an error answer, not a lost connection), and the identity read after it
    reaches the new process before the KV-event stream breaks sequence. The changed identity
    makes it a new process all the same: the router forgets the old one's sessions (their
    cache went with it), so a session bound there is routed afresh."""
    engine = await start_fronted_engine("a", CancelsAPoll)
    fleet = await make_fleet(engines=[engine], router={"session_metadata_key": "session"})
    try:
        address = fleet.address(engine)
        await generate(fleet, generate_request("warm", [*PREFIX, 1], session="alice"))
        query = apb.PromptQuery(token_ids=pb.TokenIds(ids=[*PREFIX, 5]), session_key="alice")
        bound = await fleet.admin.Route(query)
        assert (bound.engine, bound.reason) == (address, "session")

        async def restart() -> None:
            await engine.inner.close()
            engine.inner = await start_sim_engine("a", port=engine.inner.port, num_kv_blocks=128)

        engine.servicer.then = restart
        registry = fleet.app.controller.fleet.registry

        async def restarted() -> bool:
            workers = await fleet.admin.ListWorkers(apb.ListWorkersRequest())
            [worker] = workers.workers
            following = worker.kv_events_state == "following"
            return worker.total_kv_blocks == 128 and worker.routable and following

        await eventually(restarted, WAIT_S)
        assert registry.get(address).engine_id == "a"
        route = await fleet.admin.Route(query)
        assert (route.engine, route.reason) == (address, "only")  # no longer "session"
    finally:
        await close_fleet(fleet)


async def test_an_engine_replaced_by_an_incompatible_build_leaves_the_index_at_once() -> None:
    """Its old process's blocks, KV-event subscription and in-flight accounting go when it is
    rejected (admin `workers` shows no INDEXED blocks for it), not when a compatible process
    comes back; that one is a new process, its cache followed afresh."""
    engine = await start_fronted_engine("r", Replaceable)
    fleet = await make_fleet(engines=[engine])
    try:
        address = f"127.0.0.1:{engine.port}"
        await generate(fleet, generate_request("warm", [*PREFIX, 1]))
        assert await holder_of(fleet, PREFIX, 4) == address
        engine.servicer.replace("p2", revision=2)
        registry = fleet.app.controller.fleet.registry
        await fleet.app.controller.fleet.wait_for(
            lambda: registry.get(address).state is EngineState.INCOMPATIBLE, WAIT_S
        )
        assert address not in await indexed_workers(fleet)
        load = await fleet.gateway.GetLoad(pb.GetLoadRequest())
        assert not load.HasField("total_kv_blocks")  # its last load left the fleet's totals
        workers = await fleet.admin.ListWorkers(apb.ListWorkersRequest())
        assert [w.indexed_blocks for w in workers.workers] == [0]
        assert fleet.app.controller.fleet.source_of(address) is None
        engine.servicer.replace("p3")  # a compatible build again: followed from a snapshot
        await fleet.app.controller.fleet.wait_for(lambda: registry.get(address).routable, WAIT_S)
        assert await holder_of(fleet, PREFIX, 4) == address
    finally:
        await close_fleet(fleet)


async def serve_front(
    inner: pb_grpc.OpenEngineAsyncStub, port: int = 0
) -> tuple[grpc.aio.Server, int]:
    """A front server for the sim engine behind `inner`, on `port` (0: a free one): one more
    address of the same engine process."""
    server = grpc.aio.server()
    pb_grpc.add_OpenEngineServicer_to_server(Forwarding(inner), server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


async def test_an_address_that_turns_out_to_be_another_addresses_engine_leaves_the_index() -> None:
    """One engine process reached at two addresses: the second takes over while the first does
    not answer; when the first answers again it is the second's engine, rejected, and what it
    indexed for the process (under its own address) goes with its KV-event subscription: the
    index holds the process's blocks once, under the address that routes to it."""
    engine = await start_fronted_engine("twin", Forwarding)
    first = f"127.0.0.1:{engine.port}"
    fleet = await make_fleet(engines=[engine])
    second_server, second_port = await serve_front(engine.servicer.inner)
    second = f"127.0.0.1:{second_port}"
    registry = fleet.app.controller.fleet.registry
    try:
        await generate(fleet, generate_request("warm", [*PREFIX, 1]))
        assert await holder_of(fleet, PREFIX, 4) == first
        await fleet.admin.RegisterEngine(apb.RegisterEngineRequest(address=second))
        await fleet.app.controller.fleet.wait_for(
            lambda: registry.get(second).state is EngineState.INCOMPATIBLE, WAIT_S
        )
        await engine.server.stop(None)  # the first address stops answering
        await fleet.app.controller.fleet.wait_for(lambda: registry.get(second).routable, WAIT_S)
        assert await holder_of(fleet, PREFIX, 4) == second
        engine.server, _ = await serve_front(engine.servicer.inner, engine.port)
        await fleet.app.controller.fleet.wait_for(
            lambda: registry.get(first).state is EngineState.INCOMPATIBLE, WAIT_S
        )
        assert "the same engine" in registry.get(first).last_error
        assert await indexed_workers(fleet) == {second}
        assert fleet.app.controller.fleet.source_of(first) is None
        # The instance id names the address that answers for the engine.
        await fleet.admin.Cordon(apb.EngineRef(engine="twin"))
        assert registry.get(second).cordoned and not registry.get(second).routable
    finally:
        await second_server.stop(None)
        await close_fleet(fleet)
