"""An engine that answers the controller's polls with errors (its process up, and broken) is
`failing`, told apart from an `unreachable` one (its polls do not reach it) wherever an
operator looks: `kvplane admin workers` (through the CLI against a real controller), the
gateway's Health, /metrics, `kvplane up`'s live status. Both are out of routing; each turns
into the other and back to ready as the engine does, and one whose connection was lost is a
new process when back."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controller.registry import EngineState
from kvplane.up.config import FleetConfig
from kvplane.up.fleet import Fleet as LocalFleet
from kvplane.up.status import collect_status
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
from tests.controller.test_admin_cli import cli
from tests.controller.test_admin_cli_membership import cli_json
from tests.controller.test_fleet_events import scrape
from tests.controller.test_fleet_health import fleet_health, routed

pytestmark = pytest.mark.timeout(60)

Context = grpc.aio.ServicerContext[Any, Any]
WAIT_S = 15.0
SCRIPTED = "scripted: broken"


class FailsPolls(Forwarding):
    """The RPCs named in `failing` (of those the controller polls) answer `code` while it is
    set; otherwise, the sim engine's own answers. UNAVAILABLE is how a proxy in front of a
    down engine answers: to the controller, a poll that did not reach the engine."""

    def __init__(self, inner: pb_grpc.OpenEngineAsyncStub) -> None:
        super().__init__(inner)
        self.code: grpc.StatusCode | None = None
        self.failing = frozenset({"GetEngineInfo", "Health", "GetLoad"})

    async def _maybe_fail(self, rpc: str, context: Context) -> None:
        if self.code is not None and rpc in self.failing:
            await context.abort(self.code, SCRIPTED)

    async def GetEngineInfo(self, request: pb.GetEngineInfoRequest, context: Context) -> Any:
        await self._maybe_fail("GetEngineInfo", context)
        return await self.inner.GetEngineInfo(request)

    async def Health(self, request: pb.HealthRequest, context: Context) -> Any:
        await self._maybe_fail("Health", context)
        return await self.inner.Health(request)

    async def GetLoad(self, request: pb.GetLoadRequest, context: Context) -> Any:
        await self._maybe_fail("GetLoad", context)
        return await self.inner.GetLoad(request)


async def wait_state(fleet: EngineFleet[Any], address: str, state: EngineState) -> None:
    registry = fleet.app.controller.fleet.registry
    await fleet.app.controller.fleet.wait_for(lambda: registry.get(address).state is state, WAIT_S)


async def worker(fleet: EngineFleet[Any], address: str) -> dict[str, Any]:
    """The engine's row of `kvplane admin workers --output json`."""
    listed = await cli_json("workers", "--target", fleet.target)
    return next(w for w in listed["workers"] if w["address"] == address)


async def table_row(fleet: Fleet, address: str) -> str:
    """The engine's line of the `kvplane admin workers` table."""
    table = await cli("workers", "--target", fleet.target)
    assert table.exit_code == 0, table.output
    return next(line for line in table.stdout.splitlines() if f" {address} " in line)


async def states_exported(fleet: Fleet) -> dict[str, str]:
    """Each engine's state as /metrics says it (the `state` whose series is 1)."""
    families = text_string_to_metric_families(await scrape(fleet))
    return {
        s.labels["engine"]: s.labels["state"]
        for family in families
        for s in family.samples
        if s.name == "kvplane_controller_engine_state" and s.value == 1
    }


@pytest.mark.parametrize(
    ("rpc", "code"),
    [("Health", grpc.StatusCode.INTERNAL), ("GetLoad", grpc.StatusCode.RESOURCE_EXHAUSTED)],
)
async def test_an_engine_answering_its_polls_with_errors_is_failing_not_unreachable(
    rpc: str, code: grpc.StatusCode
) -> None:
    """h0's `rpc` answers `code`: failing, with that status in the ERROR column, and no
    traffic; ready again (the same process) once it answers; unreachable once it is gone."""
    scripted = await start_fronted_engine("h0", FailsPolls)
    scripted.servicer.failing = frozenset({rpc})
    engines: list[Any] = [scripted, await start_sim_engine("e1")]
    fleet = await make_fleet(
        engines=engines, router={"policy": "round_robin"}, metrics_listen="127.0.0.1:0"
    )
    h0, e1 = (f"127.0.0.1:{e.port}" for e in engines)
    registry = fleet.app.controller.fleet.registry
    error = f"{code.name}: {SCRIPTED}"
    try:
        epoch = registry.get(h0).epoch
        scripted.servicer.code = code
        await wait_state(fleet, h0, EngineState.FAILING)
        # Backed off: its failures add up (with GetLoad failing, the Health answered before
        # it must not count as recovery, nor put the engine in routing for an instant).
        await fleet.app.controller.fleet.wait_for(
            lambda: registry.get(h0).num_failures >= 3, WAIT_S
        )
        row = await worker(fleet, h0)
        assert (row["state"], row.get("routable", False), row["last_error"]) == (
            "failing",
            False,
            error,
        )
        line = await table_row(fleet, h0)
        assert line.split()[5] == "failing" and line.rstrip().endswith(error), line
        assert set(await routed(fleet, "a", 4)) == {e1}
        checks = (await fleet_health(fleet))[1]
        assert checks[f"engine:{h0}"] == (pb.HEALTH_STATE_NOT_READY, f"failing: {error}")
        assert await states_exported(fleet) == {h0: "failing", e1: "ready"}

        scripted.servicer.code = None
        await fleet.wait_routable(2)
        row = await worker(fleet, h0)
        assert (row["state"], row["last_error"]) == ("ready", "")
        assert set(await routed(fleet, "b", 4)) == {h0, e1}
        # It answered all along: the same process, its index entries kept.
        assert registry.get(h0).epoch == epoch

        await scripted.server.stop(None)  # the engine is gone: its port refuses connections
        await wait_state(fleet, h0, EngineState.UNREACHABLE)
        row = await worker(fleet, h0)
        assert row["state"] == "unreachable" and row["last_error"].startswith("UNAVAILABLE: ")
        assert (await table_row(fleet, h0)).split()[5] == "unreachable"
        assert await states_exported(fleet) == {h0: "unreachable", e1: "ready"}
    finally:
        await close_fleet(fleet)


async def test_unreachable_and_failing_follow_each_other_as_the_engine_does() -> None:
    """Not reached (UNAVAILABLE), then answering errors (a new process starting), then ready:
    a new process, as after any lost connection; failing again, then gone: unreachable."""
    scripted: FrontedEngine[FailsPolls] = await start_fronted_engine("h0", FailsPolls)
    fleet = await make_fleet(engines=[scripted])
    h0 = f"127.0.0.1:{scripted.port}"
    registry = fleet.app.controller.fleet.registry
    try:
        epoch = registry.get(h0).epoch
        scripted.servicer.code = grpc.StatusCode.UNAVAILABLE
        await wait_state(fleet, h0, EngineState.UNREACHABLE)
        assert (await worker(fleet, h0))["state"] == "unreachable"

        scripted.servicer.code = grpc.StatusCode.INTERNAL
        await wait_state(fleet, h0, EngineState.FAILING)
        row = await worker(fleet, h0)
        assert (row["state"], row["last_error"]) == ("failing", f"INTERNAL: {SCRIPTED}")

        scripted.servicer.code = None
        await fleet.wait_routable(1)
        assert (await worker(fleet, h0))["state"] == "ready"
        assert registry.get(h0).epoch > epoch  # back after a lost connection: a new process

        scripted.servicer.code = grpc.StatusCode.UNKNOWN
        await wait_state(fleet, h0, EngineState.FAILING)
        await scripted.server.stop(None)
        await wait_state(fleet, h0, EngineState.UNREACHABLE)
        row = await worker(fleet, h0)
        assert row["state"] == "unreachable" and row["last_error"].startswith("UNAVAILABLE: ")
    finally:
        await close_fleet(fleet)


async def test_the_live_status_without_a_controller_tells_failing_from_unreachable(
    tmp_path: Path,
) -> None:
    """`kvplane up` with engines and no controller shows each engine's own answer to GetLoad.
    The members are in-process engines whose addresses the fleet is given, as if it had
    started them: what is under test is the status, not the start-up (tests/foundation)."""
    healthy = await start_sim_engine("healthy")
    scripted: FrontedEngine[FailsPolls] = await start_fronted_engine("broken", FailsPolls)
    scripted.servicer.code = grpc.StatusCode.INTERNAL
    with socket.socket() as probe:  # a port nothing listens on: a dead engine's
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
    addresses = {
        "healthy": f"127.0.0.1:{healthy.port}",
        "broken": f"127.0.0.1:{scripted.port}",
        "dead": dead,
    }
    members = [{"name": name, "kind": "engine", "config": {"model": "sim"}} for name in addresses]
    fleet = LocalFleet(FleetConfig.model_validate({"members": members}), tmp_path)
    for member in fleet.members:
        member.address, member.state = addresses[member.name], "serving"
    try:
        status = await collect_status(fleet)
        states = {e.name: e.state for e in status.engines}
        assert states == {"healthy": "serving", "broken": "failing", "dead": "unreachable"}
    finally:
        await scripted.close()
        await healthy.close()


async def test_registering_a_failing_engine_says_it_answers_with_errors(fleet: Fleet) -> None:
    """`register` waits for the engine as for one not reached yet (it may be starting), then
    says what the controller found: answers, with errors, and the last one."""
    scripted: FrontedEngine[FailsPolls] = await start_fronted_engine("broken", FailsPolls)
    scripted.servicer.code = grpc.StatusCode.INTERNAL
    address = f"127.0.0.1:{scripted.port}"
    try:
        registered = await cli("register", address, "--wait-s", "5", "--target", fleet.target)
        assert registered.exit_code == 1
        assert str(registered.exception) == (
            f"engine {address} registered, but it still answers the controller's polls with "
            f"errors after 5s (INTERNAL: {SCRIPTED}); it keeps retrying (remove it: kvplane "
            f"admin remove {address})"
        )
        assert (await worker(fleet, address))["state"] == "failing"
    finally:
        await scripted.close()


async def test_abort_of_every_request_reaches_a_failing_engines_streams() -> None:
    """Its polls fail, but its process runs the streams it had: `abort --all` is for them too."""
    scripted = await start_fronted_engine("h0", FailsPolls, time_scale=1.0)
    engines: list[Any] = [scripted]
    fleet = await make_fleet(engines=engines)
    h0 = f"127.0.0.1:{scripted.port}"
    try:
        stream = fleet.gateway.Generate(generate_request("long", [1, 2, 3], max_tokens=2000))
        first = await stream.read()
        assert isinstance(first, pb.GenerateResponse) and first.WhichOneof("event") == "token"
        scripted.servicer.code = grpc.StatusCode.INTERNAL
        await wait_state(fleet, h0, EngineState.FAILING)
        everything = await fleet.gateway.Abort(pb.AbortRequest(all_requests=pb.AllRequests()))
        assert everything.status == pb.ABORT_STATUS_ABORTED
        events = []
        while isinstance(response := await stream.read(), pb.GenerateResponse):
            events.append(response.WhichOneof("event"))
        assert events[-1] == "finished" and len(events) < 2000
    finally:
        await close_fleet(fleet)
