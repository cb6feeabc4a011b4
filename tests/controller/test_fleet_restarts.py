"""The fleet's view of engine processes through real servers: an engine restarted under the
instance id set in its config is a new process all the same; an engine that names its process
only in GetLoad is polled at its pace, not spun on; a KV-event source that cannot run is said
so; and a removal that meets the handling of a restart still ends."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
import pytest

from controller.config import ControllerConfig
from controller.fleet import Fleet as ControllerFleet
from controller.fleet import _Engine
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
from tests.polling import eventually

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
    fleet = await make_fleet(engines=[engine])
    try:
        await engine.servicer.polled.wait()
        assert engine.servicer.info_calls == 1
        assert fleet.app.controller.fleet.registry.routable()
    finally:
        await close_fleet(fleet)


class UnparsableZmq(Forwarding):
    """An engine advertising a ZMQ KV-event source whose endpoint ZMQ cannot parse."""

    async def GetKvEventSources(
        self, request: pb.GetKvEventSourcesRequest, context: Context
    ) -> pb.GetKvEventSourcesResponse:
        endpoint = pb.KvEndpoint(host="not a host", port=5557, protocol="tcp")
        return pb.GetKvEventSourcesResponse(
            sources=[pb.KvEventSource(transport="zmq", endpoint_addr=endpoint)]
        )


async def test_a_kv_event_source_that_cannot_run_is_an_error_in_the_log(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    engine = await start_fronted_engine("bad-zmq", UnparsableZmq)
    try:
        address = f"127.0.0.1:{engine.port}"
        register = apb.RegisterEngineRequest(address=address, kv_events="zmq")
        await fleet.admin.RegisterEngine(register)

        async def said() -> bool:
            return any(
                r.levelno == logging.ERROR
                and f"engine {address}: KV events not followed" in r.getMessage()
                and "not a host" in r.getMessage()
                for r in caplog.records
            )

        await eventually(said, WAIT_S)
    finally:
        await engine.close()


def attempts_within(elapsed_s: float, initial_s: float, max_s: float) -> int:
    """How many subscription attempts a source backing off from `initial_s`, doubling up to
    `max_s`, can make in `elapsed_s` (the first at once)."""
    attempts, waited, backoff = 1, 0.0, initial_s
    while waited + backoff <= elapsed_s:
        waited += backoff
        backoff = min(backoff * 2, max_s)
        attempts += 1
    return attempts


async def test_kv_event_subscriptions_back_off_as_the_polls_do(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    """A stopped engine's KV-event source retries with the polls' backoff (`health`'s), one
    warning per failed attempt: a handful over seconds, not one every few milliseconds."""
    health = fleet.app.controller.config.health
    engine = fleet.engines[0]
    address = fleet.address(engine)
    loop = asyncio.get_running_loop()

    def warnings() -> int:
        return sum(
            1
            for r in caplog.records
            if r.name == "indexer.sources.openengine" and address in r.getMessage()
        )

    async def retried() -> bool:
        return warnings() >= 3

    caplog.set_level(logging.WARNING, logger="indexer.sources.openengine")
    await engine.close()
    stopped = loop.time()
    await eventually(retried, WAIT_S)  # it does retry
    await asyncio.sleep(4 * health.backoff_max_s)
    elapsed = loop.time() - stopped
    # Slowness only stretches the waits: the schedule bounds the count from above.
    assert warnings() <= attempts_within(elapsed, health.backoff_initial_s, health.backoff_max_s)


async def test_a_poll_cancelled_while_it_stops_an_old_processs_events_stays_cancelled() -> None:
    """RemoveEngine (or close) cancels an engine's poll task, maybe while it waits for the
    KV-event task of the engine's old process to stop: the poll must end there, not go on
    to follow the events again, out of anyone's reach (close would wait for it forever)."""
    fleet = ControllerFleet(ControllerConfig(), None)
    engine = _Engine("127.0.0.1:9")
    started, stopping, release = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def slow_to_stop() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            stopping.set()
            await release.wait()

    engine.events_task = asyncio.create_task(slow_to_stop())
    await started.wait()
    forget = asyncio.create_task(fleet._forget_old_process(engine))
    await stopping.wait()  # the poll waits for the events task to stop
    forget.cancel()
    release.set()
    await asyncio.wait([forget])
    assert forget.cancelled()
    await engine.close()
