"""Outlier ejection, end to end: an engine whose health and load look fine (ready, idle) but
whose every Generate fails, as a worker with a broken device does. To a load-balancing router
it is the best engine there is, so without ejection it would draw ever more traffic. Real gRPC:
a real controller in front of real sim engines, one of them behind a front server that fails
its Generate calls while told to (everything else is the sim engine's own answer)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from typer.testing import CliRunner

from controller.registry import EngineState
from kvplane.cli import app as kvplane_cli
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
from tests.controller.fronted_engine import Forwarding, FrontedEngine, start_fronted_engine
from tests.controller.test_flapping_engines import routed_by_cap
from tests.controller.test_fleet_events import scrape
from tests.polling import eventually

pytestmark = pytest.mark.timeout(90)

Context = grpc.aio.ServicerContext[Any, Any]


class BrokenGenerate(Forwarding):
    """Generate fails with `code` (INTERNAL) while `broken`; every other answer is the sim
    engine's. Counts its Generate calls and the health polls it answers."""

    def __init__(self, inner: pb_grpc.OpenEngineAsyncStub) -> None:
        super().__init__(inner)
        self.broken = True
        self.code = grpc.StatusCode.INTERNAL
        self.calls = 0
        self.health_polls = 0

    async def Health(self, request: pb.HealthRequest, context: Context) -> Any:
        self.health_polls += 1
        return await super().Health(request, context)

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.calls += 1
        if self.broken:
            await context.abort(self.code, "device error")
        async for response in self.inner.Generate(request):
            yield response


# An ejection of 10 minutes (its ceiling too: a first one above the default is refused): a
# test that waits for its end fails instead.
LONG_EJECTION = {"eject_for_s": 600, "eject_max_s": 600}


async def fleet_with_broken(
    num_healthy: int, num_broken: int = 1, **health: Any
) -> tuple[Fleet, FrontedEngine[BrokenGenerate]]:
    """A fleet of `num_broken` engines failing their Generate calls and `num_healthy` sim
    engines; the first broken one."""
    broken = [await start_fronted_engine(f"broken{i}", BrokenGenerate) for i in range(num_broken)]
    healthy = [await start_sim_engine(f"e{i}") for i in range(num_healthy)]
    engines: list[Any] = [*broken, *healthy]  # make_fleet needs `port` and `close()`
    fleet = await make_fleet(engines=engines, metrics_listen="127.0.0.1:0", health=health)
    return fleet, broken[0]


_prompts = iter(range(10**6))


async def generate(fleet: EngineFleet[Any]) -> list[str]:
    """One request with a prompt of its own (no cache pulls it anywhere); its event kinds."""
    n = next(_prompts)
    request = generate_request(f"r{n}", [1000 + n, 7, 7, 7], 2)
    try:
        return [r.WhichOneof("event") or "" async for r in fleet.gateway.Generate(request)]
    except grpc.aio.AioRpcError as exc:
        return [exc.code().name]


async def until_calls(fleet: Fleet, broken: BrokenGenerate, calls: int) -> None:
    """Requests until the broken engine has had `calls` Generate calls; each is served."""
    for _ in range(300):
        if broken.calls >= calls:
            return
        assert await generate(fleet) == ["token", "token", "finished"]
    raise AssertionError(f"the router sent the broken engine {broken.calls} requests")


async def workers(fleet: Fleet) -> dict[str, dict[str, Any]]:
    """`kvplane admin workers --output json`, by engine address: what an operator sees."""
    result = await asyncio.to_thread(
        CliRunner().invoke,
        kvplane_cli,
        ["admin", "--target", fleet.target, "workers", "--output", "json"],
    )
    assert result.exit_code == 0, result.output
    return {w["address"]: w for w in json.loads(result.stdout)["workers"]}


def broken_address(broken: FrontedEngine[BrokenGenerate]) -> str:
    return f"127.0.0.1:{broken.port}"


async def test_an_engine_failing_every_request_leaves_routing_and_clients_are_served() -> None:
    fleet, broken = await fleet_with_broken(2, eject_after_failures=3, **LONG_EJECTION)
    try:
        # Each failure is retried once elsewhere: the client sees none of them.
        await until_calls(fleet, broken.servicer, 3)
        shown = (await workers(fleet))[broken_address(broken)]
        assert shown["state"] == "ejected" and not shown["routable"]
        assert "3 requests failed in a row (last: INTERNAL: device error)" in shown["last_error"]
        for _ in range(30):
            assert await generate(fleet) == ["token", "token", "finished"]
        assert broken.servicer.calls == 3
        assert fleet.app.controller.metrics.ejections._value.get() == 1
        # Its health still answers ready: the ejection holds across the polls.
        polls = broken.servicer.health_polls

        async def polled_thrice() -> bool:
            return broken.servicer.health_polls >= polls + 3

        await eventually(polled_thrice)
        assert (await workers(fleet))[broken_address(broken)]["state"] == "ejected"
    finally:
        await close_fleet(fleet)


async def test_an_ejected_engine_comes_back_on_probation_and_a_served_request_clears_it() -> None:
    fleet, broken = await fleet_with_broken(2, eject_after_failures=2, eject_for_s=0.5)
    registry = fleet.app.controller.fleet.registry
    record = registry.get(broken_address(broken))

    def state() -> EngineState:
        """The record's state now (the fleet changes it while the test awaits)."""
        return record.state

    try:
        await until_calls(fleet, broken.servicer, 2)
        assert state() is EngineState.EJECTED
        assert "out of routing for 0.5 s" in registry.error_of(record)
        # Back after its time (its next health poll), on probation: one more failure is
        # enough, and the ejection lasts twice as long.
        await fleet.app.controller.fleet.wait_for(lambda: record.state is EngineState.READY, 30)
        await until_calls(fleet, broken.servicer, 3)
        assert state() is EngineState.EJECTED
        assert "out of routing for 1 s" in registry.error_of(record)
        # Mended: once it serves a request, one failure no longer ejects it.
        broken.servicer.broken = False
        await fleet.app.controller.fleet.wait_for(lambda: record.state is EngineState.READY, 30)
        await until_calls(fleet, broken.servicer, 4)
        broken.servicer.broken = True
        await until_calls(fleet, broken.servicer, 5)
        assert state() is EngineState.READY
    finally:
        await close_fleet(fleet)


async def test_never_more_than_half_of_the_fleet_is_ejected() -> None:
    """When every engine fails, the fault is not an outlier's: one of two stays in routing
    and the clients get its failure rather than no engine at all. /metrics counts each
    failure that would have ejected it."""
    fleet, _ = await fleet_with_broken(0, 2, eject_after_failures=1, **LONG_EJECTION)
    try:
        outcomes = [await generate(fleet) for _ in range(4)]
        assert outcomes == [["INTERNAL"]] * 4
        states = sorted(w["state"] for w in (await workers(fleet)).values())
        assert states == ["ejected", "ready"]
        metrics = await scrape(fleet)
        # Every failure of the engine left in routing: the first request's retry there, and
        # one for each request after it.
        assert routed_by_cap(metrics, "ejection") == 4
        assert routed_by_cap(metrics, "hold_down") == 0
    finally:
        await close_fleet(fleet)


async def test_an_engine_saying_not_now_is_not_ejected() -> None:
    """UNAVAILABLE is how a draining engine refuses a vllm.Generate: retried elsewhere, but
    no fault of the engine's, however many in a row."""
    fleet, broken = await fleet_with_broken(2, eject_after_failures=2, **LONG_EJECTION)
    broken.servicer.code = grpc.StatusCode.UNAVAILABLE
    try:
        await until_calls(fleet, broken.servicer, 6)
        assert (await workers(fleet))[broken_address(broken)]["state"] == "ready"
        assert fleet.app.controller.metrics.ejections._value.get() == 0
    finally:
        await close_fleet(fleet)
