"""Engines' own health as the controller polls it, through real servers: an engine that says
NOT_READY or DRAINING leaves routing at its first such answer and comes back when it says
READY; the fleet's Health reflects its engines; an engine that cannot be reached is retried
with exponential backoff until it answers."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from controller.registry import EngineState
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import (
    EngineFleet,
    ServedEngine,
    close_fleet,
    generate_request,
    make_fleet,
    start_sim_engine,
)
from tests.controller.fronted_engine import Forwarding, start_fronted_engine
from tests.controller.paused_index import PausedIndex
from tests.controller.test_gateway import PREFIX, generate, holder_of, record_routes, status_of
from tests.grpc_streams import next_reply, remaining_replies

pytestmark = pytest.mark.timeout(60)

Context = grpc.aio.ServicerContext[Any, Any]
WAIT_S = 15.0


class SaysHealth(Forwarding):
    """Health answers `state` with one failing check saying `message` once `state` is set,
    beside a READY check telling the model's name (information, no error: not part of the
    engine's error); until then, the sim engine's own answer."""

    state: pb.HealthState.ValueType | None = None
    message = ""

    async def Health(self, request: pb.HealthRequest, context: Context) -> Any:
        if self.state is None:
            return await self.inner.Health(request)
        model = pb.HealthCheck(name="model", state=pb.HEALTH_STATE_READY, message="sim")
        check = pb.HealthCheck(name="scheduler", state=self.state, message=self.message)
        return pb.HealthResponse(state=self.state, checks=[model, check])


async def wait_state(fleet: EngineFleet[Any], address: str, state: EngineState) -> None:
    registry = fleet.app.controller.fleet.registry
    await fleet.app.controller.fleet.wait_for(lambda: registry.get(address).state is state, WAIT_S)


async def routed(fleet: EngineFleet[Any], prefix: str, count: int) -> list[str]:
    """The engines `count` requests through the gateway were sent to."""
    chosen = record_routes(fleet)
    for i in range(count):
        request = generate_request(f"{prefix}{i}", [i] * 40, max_tokens=2)
        reply = [r async for r in fleet.gateway.Generate(request)]
        assert reply[-1].WhichOneof("event") == "finished"
    return chosen


async def fleet_health(fleet: EngineFleet[Any]) -> tuple[int, dict[str, tuple[int, str]]]:
    """The gateway's Health: its state, and each engine check's state and message."""
    reply = await fleet.gateway.Health(pb.HealthRequest())
    return reply.state, {c.name: (c.state, c.message) for c in reply.checks}


async def test_a_cordoned_engines_health_check_says_cordoned_then_why_it_is_down() -> None:
    """`kvplane admin health` of a cordoned engine: "cordoned" alone while it is up (it was
    "cordoned " with a trailing space), "cordoned; unreachable: UNAVAILABLE: ..." once its
    process is gone (it ran the two together: "cordoned unreachable: ...")."""
    engines = [await start_sim_engine(f"c{i}") for i in range(2)]
    fleet = await make_fleet(engines=engines)
    c0 = f"127.0.0.1:{engines[0].port}"
    try:
        await fleet.admin.Cordon(apb.EngineRef(engine=c0))
        state, checks = await fleet_health(fleet)
        assert state == pb.HEALTH_STATE_DEGRADED
        assert checks[f"engine:{c0}"] == (pb.HEALTH_STATE_READY, "cordoned")

        await engines[0].close()
        await wait_state(fleet, c0, EngineState.UNREACHABLE)
        message = (await fleet_health(fleet))[1][f"engine:{c0}"][1]
        assert message.startswith("cordoned; unreachable: UNAVAILABLE: "), message
    finally:
        await close_fleet(fleet)


async def test_engines_saying_not_ready_or_draining_leave_routing_until_ready_again() -> None:
    """h0 says NOT_READY (scripted); e1, a real sim engine, is drained by another client
    straight at the engine (not through the controller), so the controller learns it only
    from e1's Health. Round robin: every routable engine takes its turn."""
    scripted = await start_fronted_engine("h0", SaysHealth)
    engines: list[ServedEngine] = [scripted, await start_sim_engine("e1")]
    fleet = await make_fleet(engines=engines, router={"policy": "round_robin"})
    h0, e1 = (f"127.0.0.1:{e.port}" for e in engines)
    registry = fleet.app.controller.fleet.registry
    route = apb.PromptQuery(token_ids=pb.TokenIds(ids=list(range(40))))
    try:
        assert set(await routed(fleet, "a", 2)) == {h0, e1}

        scripted.servicer.state = pb.HEALTH_STATE_NOT_READY
        scripted.servicer.message = "not running"
        await wait_state(fleet, h0, EngineState.NOT_READY)
        assert not registry.get(h0).routable
        assert registry.get(h0).last_error == "scheduler: not running"
        assert set(await routed(fleet, "b", 6)) == {e1}
        assert {c.engine for c in (await fleet.admin.Route(route)).costs} == {e1}
        state, checks = await fleet_health(fleet)
        assert state == pb.HEALTH_STATE_DEGRADED
        assert checks[f"engine:{h0}"] == (pb.HEALTH_STATE_NOT_READY, "scheduler: not running")
        assert checks[f"engine:{e1}"][0] == pb.HEALTH_STATE_READY

        async with grpc.aio.insecure_channel(e1) as direct:
            drain = pb_grpc.OpenEngineStub(direct).Drain(
                pb.DrainRequest(stop_accepting_new_requests=True)
            )
            assert [e.state async for e in drain][-1] == pb.DRAIN_STATE_COMPLETE
        await wait_state(fleet, e1, EngineState.DRAINING)
        assert registry.routable() == []
        state, checks = await fleet_health(fleet)
        assert state == pb.HEALTH_STATE_NOT_READY
        assert checks[f"engine:{e1}"][0] == pb.HEALTH_STATE_DRAINING
        refused = generate_request("c", list(range(40)))
        assert await status_of(fleet.gateway.Generate(refused).read()) == (
            grpc.StatusCode.UNAVAILABLE
        )
        assert await status_of(fleet.admin.Route(route)) == grpc.StatusCode.UNAVAILABLE

        scripted.servicer.state = None  # the sim engine's READY again
        await fleet.wait_routable(1)
        assert registry.get(h0).last_error == ""
        assert set(await routed(fleet, "d", 4)) == {h0}
        assert (await fleet_health(fleet))[0] == pb.HEALTH_STATE_DEGRADED  # e1 still drains
    finally:
        await close_fleet(fleet)


class UnreachableUntilAllowed(Forwarding):
    """GetEngineInfo (the first call of every attempt to reach an engine) refused with
    UNAVAILABLE, as a proxy in front of a down engine answers, until `allowed`; the loop
    time of each refused attempt is kept, and `refused` is set at the fifth."""

    def __init__(self, inner: pb_grpc.OpenEngineAsyncStub) -> None:
        super().__init__(inner)
        self.allowed = False
        self.attempts: list[float] = []
        self.refused = asyncio.Event()

    async def GetEngineInfo(self, request: pb.GetEngineInfoRequest, context: Context) -> Any:
        if not self.allowed:
            self.attempts.append(asyncio.get_running_loop().time())
            if len(self.attempts) == 5:
                self.refused.set()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted: down")
        return await self.inner.GetEngineInfo(request)


async def test_an_unreachable_engine_is_retried_with_exponential_backoff() -> None:
    """make_fleet's backoff: 0.1 s doubling up to 1 s. The waits between attempts are at least
    0.1, 0.2, 0.4 and 0.8 s (a poll at the load interval, 0.1 s, would retry every 0.1 s);
    once the engine answers it is routable, its failures forgotten."""
    fleet = await make_fleet(1)
    engine = await start_fronted_engine("late", UnreachableUntilAllowed)
    address = f"127.0.0.1:{engine.port}"
    registry = fleet.app.controller.fleet.registry
    try:
        await fleet.admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
        await asyncio.wait_for(engine.servicer.refused.wait(), WAIT_S)
        record = registry.get(address)
        assert record.state is EngineState.UNREACHABLE and not record.routable
        assert record.last_error == "UNAVAILABLE: scripted: down"
        times = engine.servicer.attempts[:5]
        waits = [later - earlier for earlier, later in itertools.pairwise(times)]
        for waited, backoff in zip(waits, [0.1, 0.2, 0.4, 0.8], strict=True):
            assert waited >= 0.9 * backoff, waits
        engine.servicer.allowed = True
        await fleet.wait_routable(2)
        assert registry.get(address).num_failures == 0
    finally:
        await close_fleet(fleet)
        await engine.close()


class FailsHealthHoldingStreams(Forwarding):
    """Once `failing`, Health answers INTERNAL (an engine that answers, with an error), each
    such answer's loop time kept; Generate relays the sim engine's stream up to its first
    token and the rest once `released`."""

    def __init__(self, inner: pb_grpc.OpenEngineAsyncStub) -> None:
        super().__init__(inner)
        self.failing = False
        self.failed_at: list[float] = []
        # Set by a failed answer `failed_since_s` or more after the first.
        self.failed_since = asyncio.Event()
        self.failed_since_s = float("inf")
        self.released = asyncio.Event()

    async def Health(self, request: pb.HealthRequest, context: Context) -> Any:
        if not self.failing:
            return await self.inner.Health(request)
        self.failed_at.append(asyncio.get_running_loop().time())
        if self.failed_at[-1] - self.failed_at[0] >= self.failed_since_s:
            self.failed_since.set()
        await context.abort(grpc.StatusCode.INTERNAL, "scripted: health check crashed")

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        async for response in self.inner.Generate(request):
            yield response
            if response.WhichOneof("event") == "token":
                await self.released.wait()


async def test_an_engine_answering_health_with_an_error_keeps_its_streams() -> None:
    """`health.abandon_streams_after_s` ends the streams of an engine that cannot be reached
    (test_stalled_engines.py); one whose Health answers INTERNAL is reachable, and its stream
    goes on relaying however long that lasts. It is out of routing meanwhile."""
    abandon_after_s = 0.5
    scripted = await start_fronted_engine("h0", FailsHealthHoldingStreams)
    fleet = await make_fleet(
        engines=[scripted],
        health={"abandon_streams_after_s": abandon_after_s},
    )
    address = f"127.0.0.1:{scripted.port}"
    try:
        stream = fleet.gateway.Generate(generate_request("held", [1, 2, 3], max_tokens=8))
        first = await next_reply(stream)
        while first.WhichOneof("event") != "token":
            first = await next_reply(stream)
        scripted.servicer.failed_since_s = 2 * abandon_after_s
        scripted.servicer.failing = True
        # Health answered with errors for twice the limit: long past the abandonment that an
        # outage that long would have brought (it happens before the poll after it is due).
        await asyncio.wait_for(scripted.servicer.failed_since.wait(), WAIT_S)
        assert not fleet.app.controller.fleet.registry.get(address).routable
        scripted.servicer.released.set()
        async with asyncio.timeout(WAIT_S):  # a hang guard; the outcome is what is asserted
            responses = [first, *await remaining_replies(stream)]
        assert responses[-1].WhichOneof("event") == "finished", responses[-1]
        assert not [r for r in responses if r.WhichOneof("event") == "error"]
        assert sum(len(r.token.tokens) for r in responses if r.HasField("token")) == 8
    finally:
        await close_fleet(fleet)


async def test_an_engine_cordoned_while_a_request_is_matched_in_the_index_does_not_get_it() -> None:
    """The request's candidates were the routable engines when its match began; the engine
    holding its prefix is cordoned before the index answers, and gets no traffic all the
    same."""
    index = PausedIndex()
    fleet = await make_fleet(2, index_backend=index)
    try:
        await generate(fleet, generate_request("warm", [*PREFIX, 1]))
        holder = await holder_of(fleet, PREFIX, 4)
        chosen = record_routes(fleet)
        index.pause("match_prefix_by_tier")
        request = asyncio.create_task(generate(fleet, generate_request("r", [*PREFIX, 2])))
        await index.paused.wait()
        await fleet.admin.Cordon(apb.EngineRef(engine=holder))
        index.resume.set()
        reply = await request
        assert reply[-1].WhichOneof("event") == "finished"
        assert chosen and holder not in chosen
    finally:
        index.resume.set()
        await close_fleet(fleet)
