"""The fleet's view of engine processes through real servers: an engine restarted under the
instance id set in its config is a new process all the same; an engine that names its process
only in GetLoad is polled at its pace, not spun on."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from controller.registry import EngineState
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import Fleet, close_fleet, make_fleet, start_sim_engine
from tests.controller.fronted_engine import Forwarding, start_fronted_engine
from tests.controller.test_fleet_events import (
    WAIT_S,
    index_holder,
    index_through_zmq,
    start_zmq_engine,
    zmq_fleet,
)

pytestmark = pytest.mark.timeout(60)

Context = grpc.aio.ServicerContext[Any, Any]


async def wait_unreachable(fleet: Fleet, address: str) -> None:
    registry = fleet.app.controller.fleet.registry
    await fleet.app.controller.fleet.wait_for(
        lambda: registry.get(address).state is EngineState.UNREACHABLE, WAIT_S
    )


async def test_an_engine_restarted_under_the_same_instance_id_loses_its_old_blocks() -> None:
    """The restarted process keeps the instance id its config sets, and its ZMQ publisher has
    new ports: the controller lost contact with the engine, so the one that answers again is
    a new process. Its old blocks leave the index before it takes traffic again, and its new
    publisher is followed."""
    fleet = await zmq_fleet()
    try:
        old, other = fleet.engines
        address = fleet.address(old)
        await fleet.admin.Cordon(apb.EngineRef(engine=fleet.address(other)))
        prefix, holder = await index_through_zmq(fleet, 1000)
        assert holder == address
        await old.close()
        await wait_unreachable(fleet, address)
        fleet.engines[0] = await start_zmq_engine(old.instance_id, old.port)
        registry = fleet.app.controller.fleet.registry
        await fleet.app.controller.fleet.wait_for(lambda: registry.get(address).routable, WAIT_S)
        assert registry.get(address).engine_id == old.instance_id
        assert await index_holder(fleet, [*prefix, 2], 1) is None
        _, holder = await index_through_zmq(fleet, 10_000)
        assert holder == address
    finally:
        await close_fleet(fleet)


async def test_an_engine_drained_through_the_controller_takes_traffic_once_restarted() -> None:
    """A drain sticks until the engine restarts, also when its instance id is fixed."""
    fleet = await make_fleet(2)
    try:
        old = fleet.engines[0]
        address = fleet.address(old)
        drain = apb.DrainEngineRequest(engine=address)
        events = [e async for e in fleet.admin.DrainEngine(drain)]
        assert events[-1].state == pb.DRAIN_STATE_COMPLETE
        await old.close()
        await wait_unreachable(fleet, address)
        fleet.engines[0] = await start_sim_engine(old.instance_id, port=old.port)
        await fleet.wait_routable(2)
    finally:
        await close_fleet(fleet)


class NamedOnlyByLoad(Forwarding):
    """An engine whose GetEngineInfo leaves `instance_id` empty (GetLoad names the process);
    counts the polls."""

    def __init__(self, inner: pb_grpc.OpenEngineAsyncStub) -> None:
        super().__init__(inner)
        self.info_calls = 0
        self.load_calls = 0
        self.polled = asyncio.Event()

    async def GetEngineInfo(self, request: pb.GetEngineInfoRequest, context: Context) -> Any:
        self.info_calls += 1
        info = await self.inner.GetEngineInfo(request)
        info.instance_id = ""
        return info

    async def GetLoad(self, request: pb.GetLoadRequest, context: Context) -> Any:
        self.load_calls += 1
        if self.load_calls == 5:
            self.polled.set()
        return await self.inner.GetLoad(request)


async def test_an_engine_named_only_by_get_load_is_no_restart_at_every_poll() -> None:
    engine = await start_fronted_engine("named-by-load", NamedOnlyByLoad)
    fleet = await make_fleet(engines=[engine])  # type: ignore[list-item]
    try:
        await engine.servicer.polled.wait()
        assert engine.servicer.info_calls == 1
        assert fleet.app.controller.fleet.registry.routable()
    finally:
        await close_fleet(fleet)
