"""An engine whose health flaps, through real servers: a scripted OpenEngine server in front
of a sim engine answers READY and NOT_READY at alternate polls, next to a plain sim engine,
behind a real controller. It leaves routing at each NOT_READY (as it must), and without a
hold-down it was put back at each READY, taking requests half the time; now, past
`health.hold_down_after_flaps` flaps in `flap_window_s`, it stays out while it says READY
until its hold-down is over, and operators see why (`kvplane admin workers`, `health`,
/metrics). An engine that leaves ready once (a restart), or that drains, comes back as
before; of engines flapping all at once, half at most are held out, and /metrics counts those
routed all the same. An engine crash-looping faster than a health poll (only a new instance id
between two READY answers) flaps too, and removing a held-down engine and registering it again
keeps its hold-down; a controller fronted as an engine, whose identity changes with its own
fleet under the same instance id, does not flap when its KV-event stream breaks sequence. Time
runs through the config's short poll intervals; nothing here is timed."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from controller.registry import EngineRecord, EngineState
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import (
    EngineFleet,
    Fleet,
    close_fleet,
    engines_of_kinds,
    make_fleet,
    start_sim_engine,
)
from tests.controller.fronted_engine import Forwarding, FrontedEngine, start_fronted_engine
from tests.controller.test_admin_cli_membership import cli_json
from tests.controller.test_fleet_events import sample, scrape
from tests.controller.test_fleet_health import routed, wait_state
from tests.controller.test_nonsense_engines import Scripted
from tests.polling import eventually

pytestmark = pytest.mark.timeout(60)

Context = grpc.aio.ServicerContext[Any, Any]
WAIT_S = 15.0
# A window and a hold-down of 10 minutes: a test that waits for its end fails instead.
LONG_HOLD_DOWN = {"flap_window_s": 600, "hold_down_s": 600, "hold_down_max_s": 600}


class Flapping(Scripted):
    """While `flapping`, Health answers `down` (NOT_READY) at every other poll and the sim
    engine's READY between; otherwise the sim engine's own answer. Counts its polls."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.flapping = False
        self.down = pb.HEALTH_STATE_NOT_READY
        self.polls = 0

    async def Health(self, request: pb.HealthRequest, context: Context) -> Any:
        self.polls += 1
        if self.flapping and self.polls % 2:
            check = pb.HealthCheck(name="scheduler", state=self.down, message="sick")
            return pb.HealthResponse(state=self.down, checks=[check])
        return await super().Health(request, context)


class CrashLooping(Forwarding):
    """The sim engine's answers, but a new process after each `restart`: GetEngineInfo and
    GetLoad name a new instance id, while Health says READY throughout (the process restarts
    between two polls, faster than the controller can see it down)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.restarts = 0

    @property
    def instance_id(self) -> str:
        return f"crashy-{self.restarts}"

    def restart(self) -> str:
        """A new process, its instance id."""
        self.restarts += 1
        return self.instance_id

    async def GetEngineInfo(self, request: pb.GetEngineInfoRequest, context: Context) -> Any:
        info = await super().GetEngineInfo(request, context)
        info.instance_id = self.instance_id
        return info

    async def GetLoad(self, request: pb.GetLoadRequest, context: Context) -> Any:
        load = await super().GetLoad(request, context)
        load.instance_id = self.instance_id
        return load


async def flapping_fleet(**health: Any) -> tuple[EngineFleet[Any], FrontedEngine[Flapping]]:
    flapping = await start_fronted_engine("flappy", Flapping)
    sim = await start_sim_engine("steady")
    fleet = await make_fleet(
        engines=engines_of_kinds(flapping, sim), metrics_listen="127.0.0.1:0", health=health
    )
    return fleet, flapping


def record_of(fleet: EngineFleet[Any], engine: FrontedEngine[Any]) -> EngineRecord:
    return fleet.app.controller.fleet.registry.get(f"127.0.0.1:{engine.port}")


def routed_by_cap(metrics: str, reason: str) -> float | None:
    """`kvplane_controller_routed_by_cap_total` of `reason` in a /metrics scrape."""
    line = rf'^kvplane_controller_routed_by_cap_total{{reason="{reason}"}} (\S+)$'
    match = re.search(line, metrics, re.M)
    return float(match.group(1)) if match else None


def seconds_blanked(message: str) -> str:
    return re.sub(r"\d+ s\b", "N s", message)


async def flap_until(fleet: EngineFleet[Any], engine: FrontedEngine[Flapping], flaps: int) -> None:
    """Flap until the controller has counted `flaps` flaps of it, then answer READY only."""
    record = record_of(fleet, engine)
    engine.servicer.flapping = True
    await fleet.app.controller.fleet.wait_for(lambda: record.num_flaps >= flaps, WAIT_S)
    engine.servicer.flapping = False


async def polled(engine: FrontedEngine[Flapping], polls: int) -> None:
    """Until the controller has polled the engine's health `polls` times more."""
    until = engine.servicer.polls + polls
    await eventually(lambda: engine.servicer.polls >= until, WAIT_S, f"{polls} health polls")


async def test_a_flapping_engine_says_ready_but_is_held_down_and_operators_see_why() -> None:
    fleet, flapping = await flapping_fleet(
        hold_down_after_flaps=3, hold_down_ready_polls=2, **LONG_HOLD_DOWN
    )
    address = f"127.0.0.1:{flapping.port}"
    record = record_of(fleet, flapping)
    try:
        await flap_until(fleet, flapping, 3)
        await polled(flapping, 3)  # READY at each of them now
        assert record.state is EngineState.HELD_DOWN
        # Every request goes to the steady engine while the flapping one says READY.
        assert set(await routed(fleet, "held", 12)) == {f"127.0.0.1:{fleet.engines[1].port}"}
        shown = next(
            w
            for w in (await cli_json("workers", "--target", fleet.target))["workers"]
            if w["address"] == address
        )
        assert shown["state"] == "held_down" and not shown["routable"]
        assert shown["last_error"].startswith("left ready 3 times in 600 s (hold-down 600 s); ")
        assert "routable in " in shown["last_error"]
        assert shown["last_error"].endswith(" s and 2 more ready polls, if it stays ready")
        health = await cli_json("health", "--target", fleet.target)
        check = next(c for c in health["checks"] if c["name"] == f"engine:{address}")
        assert check["state"] == "HEALTH_STATE_NOT_READY"
        # (Read at another moment: its seconds left may have run on since.)
        assert seconds_blanked(check["message"]) == seconds_blanked(
            f"held_down: {shown['last_error']}"
        )
        flaps = sample(await scrape(fleet), "kvplane_controller_engine_flaps_total", address)
        assert flaps == 3
    finally:
        await close_fleet(fleet)


async def test_a_held_down_engine_is_routed_again_once_it_stays_ready() -> None:
    fleet, flapping = await flapping_fleet(
        hold_down_after_flaps=2, flap_window_s=600, hold_down_s=0.2, hold_down_ready_polls=3
    )
    record = record_of(fleet, flapping)
    try:
        await flap_until(fleet, flapping, 2)
        await wait_state(fleet, record.address, EngineState.HELD_DOWN)
        assert "(hold-down 0.2 s)" in fleet.app.controller.fleet.error_of(record)
        await wait_state(fleet, record.address, EngineState.READY)
        assert record.routable
        # Within a window of being put back, one flap holds it down again, twice as long.
        await flap_until(fleet, flapping, 3)
        await wait_state(fleet, record.address, EngineState.HELD_DOWN)
        assert "(hold-down 0.4 s)" in fleet.app.controller.fleet.error_of(record)
        await wait_state(fleet, record.address, EngineState.READY)
    finally:
        await close_fleet(fleet)


async def test_an_engine_that_leaves_ready_once_or_drains_is_back_at_its_first_ready() -> None:
    """Held down, it would miss the waits for READY."""
    fleet, flapping = await flapping_fleet(
        hold_down_after_flaps=2, hold_down_ready_polls=5, **LONG_HOLD_DOWN
    )
    record = record_of(fleet, flapping)
    try:
        await flap_until(fleet, flapping, 1)  # a restart, say
        await wait_state(fleet, record.address, EngineState.READY)
        # Draining and back, again and again: the drain is no flap.
        flapping.servicer.down = pb.HEALTH_STATE_DRAINING
        flapping.servicer.flapping = True
        await polled(flapping, 8)
        flapping.servicer.flapping = False
        await wait_state(fleet, record.address, EngineState.READY)
        assert record.num_flaps == 1
    finally:
        await close_fleet(fleet)


async def test_a_fleet_wide_blip_holds_down_half_of_the_engines_at_most() -> None:
    """Every engine flapping together (what a blip of the controller's own polls looks like):
    held down, all three would be out of routing, every request refused while each says
    READY. One is held out, the other two take the requests, shown routed despite their
    hold-down."""
    engines = [await start_fronted_engine(f"flappy{n}", Flapping) for n in range(3)]
    fleet = await make_fleet(
        engines=engines_of_kinds(*engines),
        metrics_listen="127.0.0.1:0",
        health={"hold_down_after_flaps": 2, "hold_down_ready_polls": 2, **LONG_HOLD_DOWN},
    )
    records = [record_of(fleet, engine) for engine in engines]
    try:
        for engine in engines:
            engine.servicer.flapping = True
        await fleet.app.controller.fleet.wait_for(
            lambda: all(r.num_flaps >= 2 for r in records), WAIT_S
        )
        for engine in engines:
            engine.servicer.flapping = False
        for engine in engines:
            await polled(engine, 3)  # READY at each of them now
        workers = (await cli_json("workers", "--target", fleet.target))["workers"]
        states = sorted((w["state"], w["routable"]) for w in workers)
        assert states == [("held_down", False), ("ready", True), ("ready", True)]
        routed_anyway = [w["last_error"] for w in workers if w["routable"]]
        assert all(
            e.startswith("held down but routed: more than half of the engines taking ")
            for e in routed_anyway
        )
        assert all(r.hold_s == 600 for r in records)
        health = await cli_json("health", "--target", fleet.target)
        checks = {c["name"]: c for c in health["checks"]}
        for w in workers:
            check = checks[f"engine:{w['address']}"]
            if w["routable"]:
                assert check["state"] == "HEALTH_STATE_READY"
                # The same words; the seconds left are read at two moments.
                assert seconds_blanked(check["message"]) == seconds_blanked(w["last_error"])
        served_by = set(await routed(fleet, "blip", 12))
        assert served_by and served_by <= {w["address"] for w in workers if w["routable"]}
        # Each held-down engine the cap put in routing, counted (at least the two routed now).
        metrics = await scrape(fleet)
        assert (routed_by_cap(metrics, "hold_down") or 0) >= 2
        assert routed_by_cap(metrics, "ejection") == 0
    finally:
        await close_fleet(fleet)


async def restarted(fleet: EngineFleet[Any], engine: FrontedEngine[CrashLooping]) -> None:
    """Restart the crash-looping engine; until the controller has taken the new process and
    its health answer (READY, held down or not)."""
    instance = engine.servicer.restart()
    record = record_of(fleet, engine)
    back = {EngineState.READY, EngineState.HELD_DOWN}
    await fleet.app.controller.fleet.wait_for(
        lambda: record.engine_id == instance and record.state in back, WAIT_S
    )


async def test_an_engine_crash_looping_faster_than_a_health_poll_is_held_down() -> None:
    """Every health poll finds it READY; only GetLoad and GetEngineInfo naming a new process
    show the restarts. Each is a flap, and the third holds it down."""
    crashy = await start_fronted_engine("crashy", CrashLooping)
    sim = await start_sim_engine("steady")
    fleet = await make_fleet(
        engines=engines_of_kinds(crashy, sim),
        health={"hold_down_after_flaps": 3, "hold_down_ready_polls": 2, **LONG_HOLD_DOWN},
    )
    record = record_of(fleet, crashy)
    try:
        for _ in range(3):
            await restarted(fleet, crashy)
        assert record.num_flaps == 3
        assert record.state is EngineState.HELD_DOWN
        assert fleet.app.controller.fleet.error_of(record).startswith(
            "left ready 3 times in 600 s (hold-down 600 s); "
        )
        assert set(await routed(fleet, "crashy", 12)) == {f"127.0.0.1:{fleet.engines[1].port}"}
    finally:
        await close_fleet(fleet)


async def test_a_held_down_engine_removed_and_registered_again_is_still_held_down() -> None:
    """A deregister/register loop (an operator's, a script's) within the flap window is no
    way out of the hold-down: the engine registered again at the address takes its record
    back, flaps and hold-down, and is held out at its first READY."""
    fleet, flapping = await flapping_fleet(
        hold_down_after_flaps=3, hold_down_ready_polls=2, **LONG_HOLD_DOWN
    )
    address = f"127.0.0.1:{flapping.port}"
    try:
        await flap_until(fleet, flapping, 3)
        await wait_state(fleet, address, EngineState.HELD_DOWN)
        await fleet.admin.RemoveEngine(apb.EngineRef(engine=address))
        await fleet.admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
        record = record_of(fleet, flapping)
        back = {EngineState.READY, EngineState.HELD_DOWN}
        await fleet.app.controller.fleet.wait_for(lambda: record.state in back, WAIT_S)
        assert record.state is EngineState.HELD_DOWN
        assert record.num_flaps == 3
        assert set(await routed(fleet, "again", 12)) == {f"127.0.0.1:{fleet.engines[1].port}"}
    finally:
        await close_fleet(fleet)


class BreakingController(Forwarding):
    """A lower controller's gateway passed on, with a KV-event stream of its own (a gateway
    serves none): each subscription opens with a snapshot, then sends a batch numbered past
    one that never comes (the stream breaks sequence, as one that lost its place in it does)
    each time `break_sequence` is called."""

    def __init__(self, inner: pb_grpc.OpenEngineAsyncStub) -> None:
        super().__init__(inner)
        self.sequence_number = 0
        self.breaks: asyncio.Queue[None] = asyncio.Queue()

    def break_sequence(self) -> None:
        self.breaks.put_nowait(None)

    async def GetEngineInfo(self, request: pb.GetEngineInfoRequest, context: Context) -> Any:
        call = self.inner.GetEngineInfo(request)
        info = await call
        context.set_trailing_metadata(tuple(await call.trailing_metadata()))  # whom it fronts
        return info

    async def SubscribeKvEvents(
        self, request: pb.SubscribeKvEventsRequest, context: Context
    ) -> AsyncIterator[pb.SubscribeKvEventsResponse]:
        cleared = pb.KvEvent(all_blocks_cleared=pb.AllBlocksCleared())
        snapshot = pb.KvEventBatch(sequence_number=self.sequence_number, events=[cleared])
        yield pb.SubscribeKvEventsResponse(batch=snapshot)
        while True:
            await self.breaks.get()
            self.sequence_number += 2
            batch = pb.KvEventBatch(sequence_number=self.sequence_number)
            yield pb.SubscribeKvEventsResponse(batch=batch)


async def test_a_fronted_controller_changing_with_its_fleet_is_no_flap() -> None:
    """An upper controller fronts a lower one (an engine of `a`) through a server passing its
    calls on that adds a KV-event stream. Each time an engine of `b` joins or leaves the lower
    fleet, and the stream breaks sequence, the upper reads the lower's identity again: another
    one (its models) under the same instance id. It is taken as a new process (out of routing
    until the identity is in), but no flap: counted as one, three within the window held the
    whole lower fleet out of routing while it said READY."""
    lower = await make_fleet(engines=[await start_sim_engine("a0", served_model_name="a")])
    upper: Fleet = await make_fleet(
        engines=[await start_sim_engine("u0", served_model_name="a")],
        health={"hold_down_after_flaps": 3, "hold_down_ready_polls": 2, **LONG_HOLD_DOWN},
    )
    channel = grpc.aio.insecure_channel(lower.target)
    front = BreakingController(pb_grpc.OpenEngineStub(channel))
    server = grpc.aio.server()
    pb_grpc.add_OpenEngineServicer_to_server(front, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    b0 = await start_sim_engine("b0", served_model_name="b")
    b0_address = f"127.0.0.1:{b0.port}"
    fleet = upper.app.controller.fleet
    try:
        await upper.admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
        await upper.wait_routable(2)
        record = fleet.registry.get(address)
        lower_id = lower.app.controller.instance_id
        for joins in (True, False, True):  # b0 joins the lower fleet, leaves it, joins again
            if joins:
                await lower.admin.RegisterEngine(apb.RegisterEngineRequest(address=b0_address))
            else:
                await lower.admin.RemoveEngine(apb.EngineRef(engine=b0_address))
            models = ("a", "b") if joins else ("a",)

            async def lower_serves(models: tuple[str, ...] = models) -> bool:
                info = await lower.gateway.GetEngineInfo(pb.GetEngineInfoRequest())
                return tuple(sorted(info.supported_models)) == models

            await eventually(lower_serves, WAIT_S, f"the lower controller serving {models}")
            front.break_sequence()

            def read_again(models: tuple[str, ...] = models) -> bool:
                identity = record.identity
                back = record.state in (EngineState.READY, EngineState.HELD_DOWN)
                return back and identity is not None and tuple(sorted(identity.models)) == models

            await fleet.wait_for(read_again, WAIT_S)
            assert record.engine_id == lower_id  # the same process throughout
        assert record.state is EngineState.READY and record.routable
        assert record.num_flaps == 0
    finally:
        await server.stop(None)
        await channel.close()
        await b0.close()
        await close_fleet(upper)
        await close_fleet(lower)
