"""An engine process killed (SIGKILL) and started again on its port behind a real controller
is back in routing as soon as it answers, not at the next step of the polls' backoff
(`health.backoff_initial_s` doubling to `backoff_max_s`, set long here: 30 s): its channel
reconnects about every second by itself, no call made, and the engine is polled the moment it
connects. It used to be found only by the next poll, up to `backoff_max_s` (30 s by default)
after it was back. A restart is still a flap: three in the flap window hold it down."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path
from typing import Any

import grpc

from controller.registry import EngineState
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from tests.controller.conftest import (
    EngineFleet,
    close_fleet,
    engines_of_kinds,
    generate_request,
    make_fleet,
    start_sim_engine,
)
from tests.controller.fronted_engine import Context, Forwarding, start_fronted_engine
from tests.controller.test_stalled_engines import EngineProcess
from tests.polling import eventually

# The first poll after the kill comes this long after it at the soonest: the fleet must see
# the engine back well before.
BACKOFF_S = 30.0
# The longest the controller may take to route the engine again once it listens (a hang
# guard below the backoff; within about a second in practice).
BACK_WITHIN_S = 15.0


async def _kill_and_restart(
    fleet: EngineFleet[Any], engine: EngineProcess, tmp_path: Path
) -> EngineProcess:
    """Kill the engine's process, wait until the controller finds it unreachable, and start
    it again on its port (the same instance id, as from its config)."""
    registry = fleet.app.controller.fleet.registry
    address = f"127.0.0.1:{engine.port}"
    engine.proc.kill()
    engine.proc.wait()

    def unreachable() -> bool:
        return registry.get(address).state is EngineState.UNREACHABLE

    await fleet.app.controller.fleet.wait_for(unreachable, 30.0)
    return await EngineProcess.start(tmp_path, "e0", port=engine.port)


async def test_a_restarted_engine_is_routed_again_as_soon_as_it_answers(tmp_path: Path) -> None:
    engine = await EngineProcess.start(tmp_path, "e0")
    fleet = await make_fleet(
        engines=[engine], health={"backoff_initial_s": BACKOFF_S, "backoff_max_s": BACKOFF_S}
    )
    try:
        engine = await _kill_and_restart(fleet, engine, tmp_path)
        await fleet.wait_routable(1, timeout_s=BACK_WITHIN_S)
        reply = [r async for r in fleet.gateway.Generate(generate_request("r", [1, 2, 3]))]
        assert reply[-1].WhichOneof("event") == "finished"
        assert reply[-1].finished.reason != pb.FINISH_REASON_UNSPECIFIED
    finally:
        await engine.close()
        await close_fleet(fleet)


async def test_an_engine_restarted_again_and_again_is_held_down(tmp_path: Path) -> None:
    """Back at once each time, each restart is a flap all the same: the third within the
    flap window (`health.hold_down_after_flaps`, 3 in 60 s) holds it down, out of routing
    though it answers (beside another engine: the hold-down's cap routes the only one)."""
    engine = await EngineProcess.start(tmp_path, "e0")
    other = await start_sim_engine("other")
    fleet = await make_fleet(
        engines=engines_of_kinds(engine, other),
        health={"backoff_initial_s": BACKOFF_S, "backoff_max_s": BACKOFF_S},
    )
    registry = fleet.app.controller.fleet.registry
    address = f"127.0.0.1:{engine.port}"
    try:
        for _ in range(2):
            engine = await _kill_and_restart(fleet, engine, tmp_path)
            await fleet.wait_routable(2, timeout_s=BACK_WITHIN_S)
        engine = await _kill_and_restart(fleet, engine, tmp_path)

        def held_down() -> bool:
            return registry.get(address).state is EngineState.HELD_DOWN

        await fleet.app.controller.fleet.wait_for(held_down, BACK_WITHIN_S)
        assert [r.address for r in registry.routable()] == [fleet.address(other)]
    finally:
        await engine.close()
        await close_fleet(fleet)


class AnsweringUnavailable(Forwarding):
    """Health and GetLoad answered UNAVAILABLE once `down` (as a proxy in front of an engine
    whose upstream is gone answers), over a connection that stays up."""

    down = False

    async def Health(self, request: pb.HealthRequest, context: Context) -> Any:
        if self.down:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "upstream connect error")
        return await super().Health(request, context)

    async def GetLoad(self, request: pb.GetLoadRequest, context: Context) -> Any:
        if self.down:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "upstream connect error")
        return await super().GetLoad(request, context)


def _cancelled_futures() -> int:
    """The cancelled futures something still holds (a gRPC core watch, say). Each object's
    type is tested, not the object (`isinstance` asks an object for its `__class__` too,
    which some of what gc holds answer with a FutureWarning: torch's deprecated aliases)."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), asyncio.Future) and o.cancelled())


async def test_polls_answered_unavailable_on_a_live_connection_leave_no_watch_behind() -> None:
    """An engine answering its polls UNAVAILABLE over a connection that stays up (READY): a
    hundred backoff steps leave no wait behind. Each step waited on the channel's next change
    of state (for it to connect again), never coming, and left that wait in gRPC when it
    timed out: a future (and a gRPC core watch) more per step, for as long as the outage."""
    engine = await start_fronted_engine("e0", AnsweringUnavailable)
    health = {"backoff_initial_s": 0.001, "backoff_max_s": 0.002}
    engines: list[Any] = [engine]
    fleet = await make_fleet(engines=engines, health=health)
    try:
        registry = fleet.app.controller.fleet.registry
        address = fleet.address(engine)
        engine.servicer.down = True
        await eventually(lambda: registry.get(address).num_failures >= 100, 60)
        assert registry.get(address).state is EngineState.UNREACHABLE
        assert _cancelled_futures() < 20
    finally:
        await close_fleet(fleet)


async def test_an_engines_kv_event_counters_never_go_back_across_its_restarts(
    tmp_path: Path,
) -> None:
    """The engine's KV-event counters and event-lag histogram on the controller's /metrics,
    series labelled by its address, go on across a new process there, as Prometheus counters
    must (they used to start again at 0: the lag histogram's series were dropped and the
    source counters replaced); they go only when the engine leaves the fleet."""
    engine = await EngineProcess.start(tmp_path, "e0")
    fleet = await make_fleet(
        engines=[engine], health={"backoff_initial_s": BACKOFF_S, "backoff_max_s": BACKOFF_S}
    )
    metrics = fleet.app.controller.metrics.registry
    address = f"127.0.0.1:{engine.port}"

    def value(name: str) -> float | None:
        return metrics.get_sample_value(name, {"engine": address})

    async def lag_counted_beyond(count: float) -> None:
        await eventually(
            lambda: (value("kvplane_controller_event_lag_seconds_count") or 0) > count,
            30.0,
            f"more than {count} KV-event batches in the lag histogram",
        )

    try:
        reply = [r async for r in fleet.gateway.Generate(generate_request("a", list(range(40))))]
        assert reply[-1].WhichOneof("event") == "finished"
        await lag_counted_beyond(0)
        engine = await _kill_and_restart(fleet, engine, tmp_path)
        restarts = value("kvplane_controller_engine_kv_event_restarts_total")
        batches = value("kvplane_controller_event_lag_seconds_count")
        assert restarts is not None and restarts >= 1  # the old process's stream broke
        assert batches is not None
        await fleet.wait_routable(1, timeout_s=BACK_WITHIN_S)  # the new process followed
        assert (value("kvplane_controller_event_lag_seconds_count") or 0) >= batches
        assert (value("kvplane_controller_engine_kv_event_restarts_total") or 0) >= restarts
        reply = [r async for r in fleet.gateway.Generate(generate_request("b", list(range(40))))]
        assert reply[-1].WhichOneof("event") == "finished"
        await lag_counted_beyond(batches)  # the new process's batches counted on
        await fleet.admin.RemoveEngine(apb.EngineRef(engine=address))
        await eventually(
            lambda: value("kvplane_controller_event_lag_seconds_count") is None,
            30.0,
            "the lag histogram's series gone with the engine",
        )
    finally:
        await engine.close()
        await close_fleet(fleet)
