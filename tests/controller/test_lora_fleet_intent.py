"""The fleet's LoRA adapters as the operator loaded them through the controller
(controller.lora_intent), on real sim engines that serve LoRA: an engine restarted, or one
registered at run time, gets them back before requests naming them go there; an unload
forgets them; one name stays one adapter across the fleet whatever loads race; an engine out
of LoRA slots keeps what it holds, and routing follows what each engine holds."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import logging
from pathlib import Path
from typing import Any

import grpc
import pytest

from controller.lora_intent import LoraSpec
from controller.outcomes import ENGINE_METADATA_KEY
from controller.registry import EngineState
from controller.service import Controller
from engine.config import LoraConfig
from engine.server.service import EngineApp
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
from tests.controller.fronted_engine import ForwardingLora, FrontedEngine, start_fronted_engine
from tests.controller.test_controller_replicas import close_replica, shared_index
from tests.controller.test_gateway_scripted import outcomes
from tests.engine.lora_adapters import write_adapter_config
from tests.logged_errors import errors_logged
from tests.polling import eventually
from tests.redis_servers import RedisServer, free_port
from tests.tcp_forwarder import TcpForwarder

pytestmark = pytest.mark.timeout(60)

Context = grpc.aio.ServicerContext[Any, Any]

LORA = LoraConfig(enabled=True, max_loras=2)


def adapter(tmp_path: Path, name: str, lora_id: int, directory: str = "") -> pb.LoraAdapter:
    path = write_adapter_config(tmp_path / (directory or name), r=4)
    return pb.LoraAdapter(lora_id=lora_id, lora_name=name, source_path=str(path))


def on(engine: str) -> tuple[tuple[str, str]]:
    """Request metadata that has the controller send a LoRA call to `engine` only."""
    return ((ENGINE_METADATA_KEY, engine),)


async def engine_adapters(engine: EngineApp) -> dict[str, str]:
    """name -> source path, as the engine itself lists them (not through the controller)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{engine.port}") as channel:
        reply = await pb_grpc.OpenEngineStub(channel).ListLoras(pb.ListLorasRequest())
    return {a.lora_name: a.source_path for a in reply.adapters}


async def restored(fleet: Fleet, engine: EngineApp, adapters: dict[str, str]) -> bool:
    """Whether the engine holds exactly `adapters` (name -> path), and the controller knows
    it does (it routes requests naming them there)."""
    record = fleet.app.controller.fleet.registry.get(fleet.address(engine))
    held = await engine_adapters(engine)
    return held == adapters and record.lora_adapters == frozenset(adapters)


def lora_work_done(fleet: Fleet, address: str) -> bool:
    """Whether the engine's LoRA task (its restore, its re-applied unloads) has nothing to
    do: not running, nothing due."""
    engine = fleet.app.controller.fleet._engines[address]
    task = engine.lora_task
    return (task is None or task.done()) and not (engine.restore_due or engine.unloads_due)


async def generate(fleet: EngineFleet[Any], request_id: str, lora_name: str) -> str:
    """How the request ended: its last event's kind, or the gateway's status and details."""
    # Two full blocks: the router asks the index about them.
    request = generate_request(request_id, [*range(40), len(request_id)], max_tokens=2)
    request.lora_name = lora_name
    try:
        events = [r.WhichOneof("event") async for r in fleet.gateway.Generate(request)]
    except grpc.aio.AioRpcError as exc:
        return f"{exc.code().name}: {exc.details()}"
    return str(events[-1])


async def load_on(engine: EngineApp, adapter: pb.LoraAdapter) -> None:
    """Load the adapter on the engine itself (not through the controller)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{engine.port}") as channel:
        await pb_grpc.OpenEngineStub(channel).LoadLora(pb.LoadLoraRequest(adapter=adapter))


async def lora_fleet(count: int) -> Fleet:
    return await make_fleet(
        engines=[await start_sim_engine(f"e{i}", lora=LORA) for i in range(count)]
    )


async def test_a_restarted_or_registered_engine_gets_the_fleets_adapters_back(
    tmp_path: Path,
) -> None:
    """x is loaded on the fleet, y on e1 alone (an unload naming an engine not in the fleet
    changes nothing). e1 restarted (a new process: no adapter) gets both back before its
    next request naming y, which no other engine holds; once x is unloaded, e1 restarted
    again gets y only. An engine registered at run time gets what the fleet holds (z), not
    what another engine holds alone."""
    fleet = await lora_fleet(3)
    try:
        x, y, z = (adapter(tmp_path, n, i) for i, n in enumerate("xyz", start=1))
        await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=x))
        await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=y), metadata=on("e1"))
        e1 = fleet.address(fleet.engines[1])
        with pytest.raises(grpc.aio.AioRpcError) as err:  # an engine not in the fleet
            await fleet.gateway.UnloadLora(pb.UnloadLoraRequest(lora_name="x"), metadata=on("e9"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

        restarted = await fleet.restart_engine(e1, "e1", lora=LORA)
        both = {"x": x.source_path, "y": y.source_path}
        await eventually(lambda: restored(fleet, restarted, both), 15, "x, y restored on e1")
        assert await generate(fleet, "y-after-restart", "y") == "finished"

        await fleet.gateway.UnloadLora(pb.UnloadLoraRequest(lora_name="x"))
        restarted = await fleet.restart_engine(e1, "e1", lora=LORA)
        only_y = {"y": y.source_path}
        await eventually(lambda: restored(fleet, restarted, only_y), 15, "y restored on e1")

        await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=z))
        joined = await start_sim_engine("e3", lora=LORA)
        fleet.engines.append(joined)
        e3 = fleet.address(joined)
        await fleet.admin.RegisterEngine(apb.RegisterEngineRequest(address=e3))
        only_z = {"z": z.source_path}
        await eventually(lambda: restored(fleet, joined, only_z), 15, "z restored on e3")
    finally:
        await close_fleet(fleet)


async def test_a_restarted_controller_takes_the_fleets_adapters_back_from_its_engines(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What a controller killed had loaded: x on every engine, y on e1, w on e0. A new
    controller (a fresh one in front of the same engines) learns it from them: e1 restarted
    gets x and y back; e2, registered holding x and another adapter under w's name, is warned
    about (e0's w, known first, stays the fleet's), takes no request naming w, and,
    restarted, gets x alone; e3
    registered empty gets x alone (the fleet's, held by every engine the controller knew);
    loading w from a third directory is ALREADY_EXISTS."""
    caplog.set_level(logging.WARNING, logger="controller.fleet")
    x, y, w = (adapter(tmp_path, n, i) for i, n in enumerate("xyw", start=1))
    other_w = adapter(tmp_path, "w", 3, directory="other-w")
    engines = [await start_sim_engine(f"e{i}", lora=LORA) for i in range(3)]
    for engine, held in zip(engines, [(x, w), (x, y), (x, other_w)], strict=True):
        for a in held:
            await load_on(engine, a)
    fleet = await make_fleet(engines=engines[:2])
    fleet.engines.append(engines[2])
    try:
        e1, e2 = (fleet.address(e) for e in engines[1:])
        restarted = await fleet.restart_engine(e1, "e1-again", lora=LORA)
        xy = {"x": x.source_path, "y": y.source_path}
        await eventually(lambda: restored(fleet, restarted, xy), 15, "x, y restored on e1")

        await fleet.admin.RegisterEngine(apb.RegisterEngineRequest(address=e2))
        await fleet.wait_routable(3)
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(
            f"{e2} holds LoRA adapter 'w' (id 3, {other_w.source_path}), which conflicts "
            f"with 'w' (id 3, {w.source_path})" in m
            for m in warned
        ), warned
        # e2's w is not the fleet's: a request naming w never runs there (e0 cordoned, no
        # engine takes it), and runs on e0 once it is back.
        e0 = fleet.address(engines[0])
        await fleet.admin.Cordon(apb.EngineRef(engine=e0))
        refused = await generate(fleet, "w-not-on-e2", "w")
        assert refused.startswith("UNAVAILABLE") and "take no traffic now" in refused, refused
        await fleet.admin.Uncordon(apb.EngineRef(engine=e0))
        assert await generate(fleet, "w-on-e0", "w") == "finished"
        restarted = await fleet.restart_engine(e2, "e2-again", lora=LORA)
        only_x = {"x": x.source_path}
        await eventually(lambda: restored(fleet, restarted, only_x), 15, "x restored on e2")

        joined = await start_sim_engine("e3", lora=LORA)
        fleet.engines.append(joined)
        await fleet.admin.RegisterEngine(apb.RegisterEngineRequest(address=fleet.address(joined)))
        await fleet.wait_routable(4)
        # Its restore runs off its poll (its LoRA task): it may be routed to (for requests
        # naming no adapter) before x is loaded there, and routed x once it is.
        await eventually(lambda: restored(fleet, joined, only_x), 15, "x restored on e3")

        third = adapter(tmp_path, "w", 3, directory="third-w")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=third))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert f"conflicts with 'w' (id 3, {w.source_path})" in (err.value.details() or "")
    finally:
        await close_fleet(fleet)


async def test_an_adapter_found_on_engines_that_all_left_is_held_for_no_model(
    tmp_path: Path,
) -> None:
    """e0 (serving `sim`), registered holding x while another engine registered was not read
    yet (down), has x as its own until that one is read. Both removed, x is loaded nowhere:
    loading it on the fleet's one LoRA base model, `other`, loads it there (it was refused
    ALREADY_EXISTS, "loaded for model 'sim'", for the controller's life)."""
    served_other = await start_sim_engine("eo", lora=LORA, served_model_name="other")
    fleet = await make_fleet(engines=[served_other])
    e0 = await start_sim_engine("e0", lora=LORA)
    fleet.engines.append(e0)
    intent = fleet.app.controller.fleet.lora_intent
    try:
        x = adapter(tmp_path, "x", 1)
        await load_on(e0, x)
        down, address = f"127.0.0.1:{free_port()}", fleet.address(e0)
        for registered in (down, address):
            await fleet.admin.RegisterEngine(apb.RegisterEngineRequest(address=registered))
        other_x = LoraSpec(1, "x", str(tmp_path / "other-x"))
        await eventually(lambda: intent.conflict(other_x), 15, "x found on e0")
        for removed in (address, down):
            await fleet.admin.RemoveEngine(apb.EngineRef(engine=removed))
        loaded = await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=x))
        assert not loaded.already_loaded
        assert await engine_adapters(served_other) == {"x": x.source_path}
    finally:
        await close_fleet(fleet)


async def test_an_engine_out_of_lora_slots_stays_consistent_with_the_fleets_view(
    tmp_path: Path,
) -> None:
    """max_loras 2: e1 holds x (the fleet's) and y (its own), so w, loaded on the fleet, is
    refused there (RESOURCE_EXHAUSTED, its outcome) and loaded on e0: the call fails, w's
    requests go to e0 alone, and the gateway's ListLoras agrees with each engine's. A
    restarted e1 gets its adapters back in the order they were loaded (x, y; w refused
    again): it holds what it held, and routing and ListLoras say so."""
    fleet = await lora_fleet(2)
    registry = fleet.app.controller.fleet.registry
    try:
        x, y, w = (adapter(tmp_path, n, i) for i, n in enumerate("xyw", start=1))
        await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=x))
        await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=y), metadata=on("e1"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=w))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        report = {k: v["outcome"] for k, v in outcomes(err.value.trailing_metadata()).items()}
        assert report == {"e0": "ok", "e1": "RESOURCE_EXHAUSTED"}
        for i in range(4):
            assert await generate(fleet, f"w{i}", "w") == "finished"
        assert registry.get(fleet.address(fleet.engines[1])).lora_adapters == frozenset({"x", "y"})

        async def agrees() -> bool:
            listing = fleet.gateway.ListLoras(pb.ListLorasRequest())
            await listing
            held = {
                k: sorted(v["adapters"])
                for k, v in outcomes(await listing.trailing_metadata()).items()
            }
            own = {f"e{i}": sorted(await engine_adapters(e)) for i, e in enumerate(fleet.engines)}
            return held == own

        assert await agrees()
        e1 = fleet.address(fleet.engines[1])
        restarted = await fleet.restart_engine(e1, "e1", lora=LORA)
        both = {"x": x.source_path, "y": y.source_path}
        await eventually(lambda: restored(fleet, restarted, both), 15, "x, y restored on e1")
        assert await agrees()
        for i in range(4):
            assert await generate(fleet, f"y{i}", "y") == "finished"  # on e1, its one holder
    finally:
        await close_fleet(fleet)


async def test_one_name_stays_one_adapter_across_the_fleet(tmp_path: Path) -> None:
    """x is loaded on e0 alone. Loading x from another directory on the fleet is refused
    (ALREADY_EXISTS) before any engine is asked, where e1 and e2 would have loaded the other
    adapter under the same name and requests naming x would run either one. Two loads
    racing for a name the fleet lacks: one wins, everywhere."""
    fleet = await lora_fleet(3)
    try:
        x = adapter(tmp_path, "x", 1)
        await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=x), metadata=on("e0"))
        other = adapter(tmp_path, "x", 1, directory="other")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=other))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "conflicts with 'x' (id 1, " in (err.value.details() or "")
        assert [await engine_adapters(e) for e in fleet.engines] == [
            {"x": x.source_path}, {}, {},
        ]  # fmt: skip
        listed = await fleet.gateway.ListLoras(pb.ListLorasRequest())
        assert [(a.lora_name, a.source_path) for a in listed.adapters] == [("x", x.source_path)]

        first, second = adapter(tmp_path, "r", 2, "r1"), adapter(tmp_path, "r", 2, "r2")
        results = await asyncio.gather(
            fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=first)),
            fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=second)),
            return_exceptions=True,
        )
        won = [r.adapter for r in results if isinstance(r, pb.LoadLoraResponse)]
        lost = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        assert len(won) == 1 and [e.code() for e in lost] == [grpc.StatusCode.ALREADY_EXISTS]
        held = [(await engine_adapters(e)).get("r") for e in fleet.engines]
        assert held == [won[0].source_path] * 3

        # The same directory spelled another way is the same adapter, not a conflict: x
        # goes to the whole fleet (e0 holds it already).
        x_again = pb.LoraAdapter(lora_id=1, lora_name="x", source_path=f"{x.source_path}/")
        loaded = await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=x_again))
        assert not loaded.already_loaded  # e1 and e2 had to load it
        held = [str(Path((await engine_adapters(e))["x"])) for e in fleet.engines]
        assert held == [x.source_path] * 3
    finally:
        await close_fleet(fleet)


def intent_tables(fleet: Fleet) -> dict[str, Any]:
    """A copy of every table of the fleet's LoRA intent, by field name (not its loading
    order's clock: a number)."""
    intent = fleet.app.controller.fleet.lora_intent
    return {
        f.name: copy.deepcopy(getattr(intent, f.name))
        for f in dataclasses.fields(intent)
        if f.name != "clock"
    }


async def test_adapters_loaded_and_unloaded_by_the_hundred_leave_nothing_in_the_intent(
    tmp_path: Path,
) -> None:
    """A fleet loading and unloading ever new adapter names (one per tenant, per version),
    fleet-wide and on one engine, and unloading names it never held (NOT_FOUND): once
    every engine answered an unload the intent remembers nothing of it, its tables as they
    were before (it remembered every name unloaded, for the controller's life). A
    fleet-wide adapter kept off one engine stays so: that is intent, not memory."""
    fleet = await lora_fleet(2)
    try:
        kept = adapter(tmp_path, "kept", 1)
        await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=kept))
        await fleet.gateway.UnloadLora(pb.UnloadLoraRequest(lora_name="kept"), metadata=on("e0"))
        before = intent_tables(fleet)
        for i in range(30):
            tenant = adapter(tmp_path, f"tenant-{i}", 100 + i, directory="tenant")
            await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=tenant))
            await fleet.gateway.UnloadLora(pb.UnloadLoraRequest(lora_name=tenant.lora_name))
            own = adapter(tmp_path, f"own-{i}", 200 + i, directory="own")
            await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=own), metadata=on("e1"))
            await fleet.gateway.UnloadLora(
                pb.UnloadLoraRequest(lora_name=own.lora_name), metadata=on("e1")
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await fleet.gateway.UnloadLora(pb.UnloadLoraRequest(lora_name=f"never-{i}"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert intent_tables(fleet) == before
        e0 = fleet.address(fleet.engines[0])
        # Under a new instance id: the controller takes in the new process (its adapters read,
        # any restore due started) before it routes there, where under the old one it might
        # take it for the same process, and an empty e0 would tell nothing.
        restarted = await fleet.restart_engine(e0, "e0-again", lora=LORA)
        await eventually(lambda: lora_work_done(fleet, e0), 15, "e0's LoRA work to end")
        assert await restored(fleet, restarted, {})  # still without kept
        e1 = fleet.address(fleet.engines[1])
        assert await engine_adapters(fleet.engine_at(e1)) == {"kept": kept.source_path}
    finally:
        await close_fleet(fleet)


class CutOff(ForwardingLora):
    """A sim engine serving LoRA that answers nothing but UNAVAILABLE while `cut` (a network
    partition, a wedged server), the same process throughout. While `unloads_hang`, an
    UnloadLora is not answered until `released` (a wedged LoRA worker); each one's name is
    kept in `unloads`. While `listings_held`, a ListLoras reads what the engine holds at once
    (`listed`) and answers it once `listing_released` (a slow answer on the way back)."""

    def __init__(self, inner: pb_grpc.OpenEngineAsyncStub) -> None:
        super().__init__(inner)
        self.cut = False
        self.unloads_hang = False
        self.unloads: list[str] = []
        self.released = asyncio.Event()
        self.listings_held = False
        self.listed = False
        self.listing_released = asyncio.Event()

    async def _answer(self, context: Context) -> None:
        if self.cut:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "cut off")

    async def GetEngineInfo(self, request: pb.GetEngineInfoRequest, context: Context) -> Any:
        await self._answer(context)
        return await super().GetEngineInfo(request, context)

    async def Health(self, request: pb.HealthRequest, context: Context) -> Any:
        await self._answer(context)
        return await super().Health(request, context)

    async def GetLoad(self, request: pb.GetLoadRequest, context: Context) -> Any:
        await self._answer(context)
        return await super().GetLoad(request, context)

    async def UnloadLora(self, request: pb.UnloadLoraRequest, context: Context) -> Any:
        await self._answer(context)
        self.unloads.append(request.lora_name)
        if self.unloads_hang:
            await self.released.wait()  # or until the controller's deadline cancels it
        return await super().UnloadLora(request, context)

    async def ListLoras(self, request: pb.ListLorasRequest, context: Context) -> Any:
        reply = await super().ListLoras(request, context)
        self.listed = True
        if self.listings_held:
            await self.listing_released.wait()
        return reply


async def test_an_engine_cut_off_during_an_unload_drops_the_adapter_once_back(
    tmp_path: Path,
) -> None:
    """x is on e0 and e1; e1 is cut off (the same process throughout) while x is unloaded
    from the fleet, which fails for e1. Once e1 answered again it kept x, and requests
    naming x, until the operator unloaded it again, while the controller remembered the
    unload for it for good. It is unloaded there when the controller reads e1 back, and
    the intent forgets the unload."""
    engines = [await start_fronted_engine(f"e{i}", CutOff, lora=LORA) for i in range(2)]
    fleet = await make_fleet(engines=engines)
    try:
        await fleet.wait_routable(2)
        await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=adapter(tmp_path, "x", 1)))
        e1 = engines[1]
        e1.servicer.cut = True
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await fleet.gateway.UnloadLora(pb.UnloadLoraRequest(lora_name="x"))
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert [list(await engine_adapters(e.inner)) for e in engines] == [[], ["x"]]

        e1.servicer.cut = False
        record = fleet.app.controller.fleet.registry.get(fleet.address(e1))

        async def unloaded() -> bool:
            return not await engine_adapters(e1.inner) and record.lora_adapters == frozenset()

        await eventually(unloaded, 15, "x unloaded from e1, as the controller knows")
        await fleet.wait_routable(2)
        assert (await generate(fleet, "after", "x")).startswith("NOT_FOUND")
        intent = fleet.app.controller.fleet.lora_intent
        assert (intent.unconfirmed, intent.unloaded_from, intent.loads) == ({}, {}, {})
    finally:
        await close_fleet(fleet)


async def test_an_engine_whose_unloads_time_out_is_asked_one_at_a_time(tmp_path: Path) -> None:
    """x and y are unloaded from the fleet while e1 is cut off. Back, e1 answers its polls
    but its UnloadLora hangs: the first unload re-applied that times out ends that poll's
    unloads (as a restore of its loads ends), x is asked again at the next poll, and y is not
    asked meanwhile: each would hold the poll, and every LoRA call of the fleet, for
    `lora_timeout_s` more."""
    engines = [await start_fronted_engine(f"e{i}", CutOff, lora=LORA) for i in range(2)]
    fleet = await make_fleet(engines=engines, lora_timeout_s=2.0)
    try:
        await fleet.wait_routable(2)
        for n, name in enumerate(("x", "y"), 1):
            await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=adapter(tmp_path, name, n)))
        e1 = engines[1].servicer
        e1.cut = True
        for name in ("x", "y"):
            with pytest.raises(grpc.aio.AioRpcError):
                await fleet.gateway.UnloadLora(pb.UnloadLoraRequest(lora_name=name))
        e1.unloads_hang = True
        e1.cut = False
        await eventually(lambda: len(e1.unloads) >= 2, 15, "two unloads re-applied on e1")
        assert e1.unloads[:2] == ["x", "x"]
    finally:
        await close_fleet(fleet)


async def unload_hanging_on_e1(
    tmp_path: Path,
) -> tuple[EngineFleet[FrontedEngine[CutOff]], list[FrontedEngine[CutOff]]]:
    """A fleet of e0 and e1 that loaded x; x unloaded from the fleet while e1 was cut off.
    Back, e1 answers its polls but its UnloadLora hangs until released (no deadline in
    reach): returned once the controller re-applied x's unload there."""
    engines = [await start_fronted_engine(f"e{i}", CutOff, lora=LORA) for i in range(2)]
    fleet = await make_fleet(engines=engines, lora_timeout_s=3600.0)
    await fleet.wait_routable(2)
    await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=adapter(tmp_path, "x", 1)))
    e1 = engines[1].servicer
    e1.cut = True
    with pytest.raises(grpc.aio.AioRpcError):
        await fleet.gateway.UnloadLora(pb.UnloadLoraRequest(lora_name="x"))
    e1.unloads_hang = True
    e1.cut = False
    await eventually(lambda: e1.unloads == ["x"], 15, "x's unload re-applied on e1")
    return fleet, engines


async def test_an_engine_whose_unloads_hang_holds_up_no_lora_call_of_the_others(
    tmp_path: Path,
) -> None:
    """While e1's re-applied unload of x hangs, `lora list` (e1 answers ListLoras) and a
    load on e0 answer, before the hang ends: the wedged engine holds up its own LoRA
    changes only, not the fleet's. Released, x is gone from e1, as the controller knows."""
    fleet, engines = await unload_hanging_on_e1(tmp_path)
    e0, e1 = engines
    try:
        listing = asyncio.ensure_future(fleet.gateway.ListLoras(pb.ListLorasRequest()))
        await eventually(listing.done, 15, "lora list answered while e1's unload hangs")
        assert [a.lora_name for a in listing.result().adapters] == ["x"]  # e1's, still
        y = adapter(tmp_path, "y", 2)
        load = asyncio.ensure_future(
            fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=y), metadata=on("e0"))
        )
        await eventually(load.done, 15, "a load on e0 answered while e1's unload hangs")
        load.result()
        assert not e1.servicer.released.is_set() and e1.servicer.unloads == ["x"]
        assert list(await engine_adapters(e0.inner)) == ["y"]
        e1.servicer.released.set()
        record = fleet.app.controller.fleet.registry.get(fleet.address(e1))

        async def unloaded() -> bool:
            return not await engine_adapters(e1.inner) and record.lora_adapters == frozenset()

        await eventually(unloaded, 15, "x unloaded from e1, as the controller knows")
    finally:
        e1.servicer.released.set()
        await close_fleet(fleet)


async def test_an_engine_whose_unloads_hang_is_polled_meanwhile(tmp_path: Path) -> None:
    """While e1's re-applied unload of x hangs, e1's health and load polls go on: cut off
    (its polls unanswered), it leaves routing, and it is back once it answers again,
    all before the hang ends."""
    fleet, engines = await unload_hanging_on_e1(tmp_path)
    e1 = engines[1]
    record = fleet.app.controller.fleet.registry.get(fleet.address(e1))
    try:
        e1.servicer.cut = True
        await eventually(lambda: not record.routable, 15, "e1 out of routing, cut off")
        assert record.state in (EngineState.UNREACHABLE, EngineState.FAILING)
        e1.servicer.cut = False
        await eventually(lambda: record.routable, 15, "e1 back in routing")
        assert not e1.servicer.released.is_set() and e1.servicer.unloads[0] == "x"
    finally:
        e1.servicer.released.set()
        await close_fleet(fleet)


async def test_a_listing_does_not_undo_an_unload_the_fleet_service_re_applied_meanwhile(
    tmp_path: Path,
) -> None:
    """`lora list` while e1's re-applied unload of x is in progress, its answer back only
    once the unload ended: x, gone from e1, is not taught back to the router by that listing
    from before (requests naming x would be routed to e1, which no longer holds it)."""
    fleet, engines = await unload_hanging_on_e1(tmp_path)
    e1 = engines[1]
    record = fleet.app.controller.fleet.registry.get(fleet.address(e1))
    try:
        for engine in engines:
            engine.servicer.listings_held = True
            engine.servicer.listed = False
        listing = asyncio.ensure_future(fleet.gateway.ListLoras(pb.ListLorasRequest()))
        await eventually(lambda: e1.servicer.listed, 15, "e1 listed, holding x still")
        e1.servicer.released.set()
        await eventually(lambda: record.lora_adapters == frozenset(), 15, "x unloaded from e1")
        for engine in engines:
            engine.servicer.listing_released.set()
        await listing
        assert not await engine_adapters(e1.inner)
        assert record.lora_adapters == frozenset()
    finally:
        for engine in engines:
            engine.servicer.released.set()
            engine.servicer.listing_released.set()
        await close_fleet(fleet)


async def test_an_engine_removed_as_the_controller_stops_has_its_lora_task_ended(
    tmp_path: Path,
) -> None:
    """e1 removed (as through another replica: its removal left running) while its
    re-applied unload hangs, and the controller stops at once: its LoRA task, and its polls,
    end with the controller, not left running against the engine."""
    fleet, engines = await unload_hanging_on_e1(tmp_path)
    controller_fleet = fleet.app.controller.fleet
    address = fleet.address(engines[1])
    e1 = controller_fleet._engines[address]
    try:
        controller_fleet.begin_removal(address)
        await controller_fleet.close()
        assert e1.lora_task is not None and e1.lora_task.done()
        assert e1.poll_task is not None and e1.poll_task.done()
    finally:
        engines[1].servicer.released.set()
        await close_fleet(fleet)


async def test_a_restore_that_fails_on_a_bug_is_tried_again_at_the_next_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """x is loaded on the fleet; e1 restarted, its first restore fails on an unexpected
    error (a bug, injected: nothing an engine answers raises one): it is logged, and the
    restore is still due, done at e1's next poll, not only when e1's identity is next read
    (which a process that stays up may never have)."""
    fleet = await lora_fleet(2)
    controller_fleet = fleet.app.controller.fleet
    restore = controller_fleet._restore_loras
    failed: list[str] = []

    async def failing_once(engine: Any) -> None:
        if not failed:
            failed.append(engine.address)
            raise RuntimeError("an injected bug")
        await restore(engine)

    try:
        x = adapter(tmp_path, "x", 1)
        await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=x))
        monkeypatch.setattr(controller_fleet, "_restore_loras", failing_once)
        e1 = fleet.address(fleet.engines[1])
        restarted = await fleet.restart_engine(e1, "e1", lora=LORA)
        await eventually(lambda: restored(fleet, restarted, {"x": x.source_path}), 15, "x back")
        assert failed == [e1]
        assert "its LoRA adapters not brought up to date" in caplog.text
    finally:
        await close_fleet(fleet)


async def test_a_restore_that_keeps_failing_on_a_bug_logs_its_traceback_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """x is loaded on the fleet; e1 restarted, and every restore of it fails on the same
    unexpected error (a bug, injected), tried again at each of its polls: the first failure
    is logged with its traceback, the ones after it are not (a counted line at most every
    10 s), so a persistent bug does not fill the log with a traceback a poll."""
    fleet = await lora_fleet(2)
    controller_fleet = fleet.app.controller.fleet
    failed: list[str] = []

    async def failing(engine: Any) -> None:
        failed.append(engine.address)
        raise RuntimeError("an injected bug")

    try:
        x = adapter(tmp_path, "x", 1)
        await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=x))
        monkeypatch.setattr(controller_fleet, "_restore_loras", failing)
        e1 = fleet.address(fleet.engines[1])
        await fleet.restart_engine(e1, "e1", lora=LORA)
        await eventually(lambda: len(failed) >= 4, 15, "four restores of e1 to fail")
    finally:
        await close_fleet(fleet)
    said = [r for r in caplog.records if "its LoRA adapters not brought up to date" in r.message]
    assert [r.exc_info is not None for r in said] == [True] + [False] * (len(said) - 1)
    assert "an injected bug" in said[0].getMessage()


async def test_an_engine_removed_while_its_restore_waits_ends_it_without_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """e1 restarted while a LoRA call holds the fleet's LoRA changes: its restore of x waits
    for them. e1 is removed as they are let go: its LoRA task ends without a word of error
    (an ordinary removal, not a bug), and nothing is loaded on the process removed."""
    fleet = await lora_fleet(2)
    controller_fleet = fleet.app.controller.fleet
    try:
        await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=adapter(tmp_path, "x", 1)))
        address = fleet.address(fleet.engines[1])
        async with controller_fleet.lora_changes:  # a gateway LoRA call in progress
            restarted = await fleet.restart_engine(address, "e1", lora=LORA)
            engine = controller_fleet._engines[address]

            def waiting() -> bool:
                task = engine.lora_task
                return task is not None and not task.done() and not engine.restore_due

            await eventually(waiting, 15, "e1's restore waiting for the fleet's LoRA changes")
            caplog.clear()
        # Let go (its restore's turn comes first), then removed before the restore runs.
        _, removal = controller_fleet.begin_removal(address)
        await removal
        assert engine.lora_task is not None and engine.lora_task.done()
        assert errors_logged(caplog) == []
        assert await engine_adapters(restarted) == {}
    finally:
        await close_fleet(fleet)


async def test_a_refresh_does_not_undo_an_unload_the_fleet_service_re_applied_meanwhile(
    tmp_path: Path,
) -> None:
    """e1, asked to read its adapters again (a request refused for naming x), lists them
    while its re-applied unload of x is in progress, the answer back only once the unload
    ended: x, gone from e1, is not taught back to the router by that listing from before."""
    fleet, engines = await unload_hanging_on_e1(tmp_path)
    e1 = engines[1]
    controller_fleet = fleet.app.controller.fleet
    address = fleet.address(e1)
    record = controller_fleet.registry.get(address)
    try:
        e1.servicer.listings_held = True
        e1.servicer.listed = False
        refresh = asyncio.ensure_future(controller_fleet.refresh_loras(address))
        await eventually(lambda: e1.servicer.listed, 15, "e1 listed, holding x still")
        e1.servicer.released.set()
        await eventually(lambda: record.lora_adapters == frozenset(), 15, "x unloaded from e1")
        e1.servicer.listing_released.set()
        await refresh
        assert not await engine_adapters(e1.inner)
        assert record.lora_adapters == frozenset()
    finally:
        e1.servicer.released.set()
        e1.servicer.listing_released.set()
        await close_fleet(fleet)


async def test_an_adapter_loaded_through_one_controller_replica_is_routed_by_the_other(
    redis: RedisServer, tmp_path: Path
) -> None:
    """Two replicas behind one load balancer: a LoadLora lands on a, which loads x on every
    engine; b, which listed the engines' adapters before, routes a request naming x (before,
    b refused it NOT_FOUND "no engine has LoRA adapter 'x' loaded", for good: nothing made
    b list the adapters again), and still refuses a name no engine holds."""
    engines = [await start_sim_engine(f"e{i}", lora=LORA) for i in range(2)]
    a = await make_fleet(engines=engines, index=shared_index(redis))
    b = await make_fleet(engines=engines, index=shared_index(redis))
    try:
        await eventually(lambda: listed(a), 15, "a to list the engines' adapters")
        await eventually(lambda: listed(b), 15, "b to list the engines' adapters")
        await a.gateway.LoadLora(pb.LoadLoraRequest(adapter=adapter(tmp_path, "x", 1)))
        assert await generate(a, "through-a", "x") == "finished"
        assert await generate(b, "through-b", "x") == "finished"
        assert (await generate(b, "unknown", "y")).startswith("NOT_FOUND")
    finally:
        await close_replica(b)
        await close_fleet(a)


async def listed(fleet: Fleet) -> bool:
    """Whether the replica has listed every engine's adapters (it knows they hold none)."""
    records = fleet.app.controller.fleet.registry.records()
    return all(r.lora_adapters is not None for r in records)


async def test_an_adapter_unloaded_through_one_replica_is_not_restored_by_the_other(
    redis: RedisServer, tmp_path: Path
) -> None:
    """x is loaded on the fleet through a, then unloaded through b, and y loaded through a;
    e1 restarts. Neither replica gives it x back: the fleet's LoRA intent is shared through
    the membership hash (each LoRA call reads it first, as an admin change does). Before,
    a's intent still held x, and a loaded it on e1 again (ahead of y, loaded after it)."""
    engines = [await start_sim_engine(f"e{i}", lora=LORA) for i in range(2)]
    a = await make_fleet(engines=engines, index=shared_index(redis))
    b = await make_fleet(engines=engines, index=shared_index(redis))
    e1 = a.address(engines[1])
    try:
        x, y = adapter(tmp_path, "x", 1), adapter(tmp_path, "y", 2)
        await a.gateway.LoadLora(pb.LoadLoraRequest(adapter=x))
        await unload_x_through_b_and_restart_e1(a, b, e1, y)
    finally:
        await close_replica(b)
        await close_fleet(a)


async def test_an_adapter_found_on_the_engines_and_unloaded_through_one_replica_is_not_restored(
    redis: RedisServer, tmp_path: Path
) -> None:
    """x was loaded on every engine before the replicas started (or before they last
    restarted: a controller rebuilds its intent from the engines), so both find it there and
    hold it for the fleet, with nothing of it in the membership hash. Unloaded through b, it
    is not loaded back on e1 restarted by a. Before, b's unload left no field (it deletes the
    field of an adapter loaded nowhere, and there was none), a's intent kept x, and a loaded
    it on e1's new process. The unload's marker (`l:x`, `{"unloaded": ...}`) then leaves the
    hash with its stamp once its lifetime (ten read intervals) is over, at a later change of
    the hash, and x stays unloaded. Before, the marker stayed until x was loaded again: one
    field for every name ever unloaded so."""
    engines = [await start_sim_engine(f"e{i}", lora=LORA) for i in range(2)]
    x, y = adapter(tmp_path, "x", 1), adapter(tmp_path, "y", 2)
    for engine in engines:
        await load_on(engine, x)
    a = await make_fleet(engines=engines, index=shared_index(redis))
    b = await make_fleet(engines=engines, index=shared_index(redis))
    e0, e1 = (a.address(engine) for engine in engines)
    membership, client = "kvplane:{default:0}:fm", redis.client()
    try:
        for replica in (a, b):
            await eventually(functools.partial(holds_x, replica), 15, "x found on the fleet")
        await unload_x_through_b_and_restart_e1(a, b, e1, y)

        async def unload_gone() -> bool:
            await a.admin.Uncordon(apb.EngineRef(engine=e0))  # a change: expired ones go
            # (The uncordon's own tombstone, fresh, stays.)
            kept = {b"v", b"#v", b"#", b"l:y", b"#l:y", f"#c:{e0}".encode()}
            return set(client.hkeys(membership)) == kept

        await eventually(unload_gone, 15, "the unload of x out of the membership hash")
        for replica in (a, b):
            await replica.app.controller.membership.refresh()
            assert ("x", None) not in replica.app.controller.fleet.lora_intent.loads
    finally:
        client.close()
        await close_replica(b)
        await close_fleet(a)


async def holds_x(fleet: EngineFleet[Any]) -> bool:
    """Whether the replica's LoRA intent holds adapter x for the whole fleet."""
    return ("x", None) in fleet.app.controller.fleet.lora_intent.loads


async def unload_x_through_b_and_restart_e1(a: Fleet, b: Fleet, e1: str, y: pb.LoraAdapter) -> None:
    """Unload x through b, load `y` through a, restart e1: a gives it y back, not x."""
    await b.gateway.UnloadLora(pb.UnloadLoraRequest(lora_name="x"))
    await a.gateway.LoadLora(pb.LoadLoraRequest(adapter=y))
    restarted = await a.restart_engine(e1, "e1-1", lora=LORA)
    only_y = {"y": y.source_path}
    await eventually(lambda: restored(a, restarted, only_y), 15, "y restored on e1, not x")
    assert await engine_adapters(restarted) == only_y


async def test_a_replica_adopting_the_fleets_adapters_restores_them_in_the_order_loaded(
    redis: RedisServer, tmp_path: Path
) -> None:
    """x, found on the engine by replica a, is unloaded through a (its field of the membership
    hash an unload marker), then y and x are loaded through a: x's field, set in place,
    comes first in the hash (kept in insertion order here: Redis's listpack encoding of a
    small hash; past its limits the order is the hash table's), though y was loaded first.
    Replica b, started then, adopts both; a stops, and the engine restarts with one LoRA
    slot: b restores y, loaded first, and x is refused, as a would have. Before, b restored
    them in the hash's field order: the engine got x, and y was refused."""
    client = redis.client()
    client.config_set("hash-max-listpack-value", 4096)  # the adapters' fields fit
    engine = await start_sim_engine("e0", lora=LORA)
    x, y = adapter(tmp_path, "x", 1), adapter(tmp_path, "y", 2)
    await load_on(engine, x)
    a = await make_fleet(engines=[engine], index=shared_index(redis))
    b: Fleet | None = None
    a_open = True
    try:
        await eventually(functools.partial(holds_x, a), 15, "x found on the fleet")
        await a.gateway.UnloadLora(pb.UnloadLoraRequest(lora_name="x"))
        await a.gateway.LoadLora(pb.LoadLoraRequest(adapter=y))
        await a.gateway.LoadLora(pb.LoadLoraRequest(adapter=x))
        fields = [f for f in client.hkeys("kvplane:{default:0}:fm") if f in (b"l:x", b"l:y")]
        assert fields == [b"l:x", b"l:y"]  # not the order they were loaded in
        b = await make_fleet(engines=[engine], index=shared_index(redis))
        await close_replica(a)
        a_open = False
        address = b.address(engine)
        one_slot = LoraConfig(enabled=True, max_loras=1)
        restarted = await b.restart_engine(address, "e0-1", lora=one_slot)
        only_y = {"y": y.source_path}

        async def y_restored() -> bool:
            return lora_work_done(b, address) and await restored(b, restarted, only_y)

        await eventually(y_restored, 15, "y restored on e0 by b, x refused")
        assert await generate(b, "r", "y") == "finished"
    finally:
        client.close()
        if b is not None:
            await close_fleet(b)
        if a_open:
            await close_fleet(a)


async def test_a_replica_started_later_lists_the_engines_adapters_after_reading_the_hash(
    redis: RedisServer, tmp_path: Path
) -> None:
    """x, found on both engines by a, is unloaded through a while b starts. Before, b listed
    the engines' adapters before its first read of the membership hash: its listings read x
    before the unload, its first read found the unload, which it took for older than what it
    found, and b held x for the fleet (it would load it back on an engine that restarts). b
    now reads the hash first and lists the adapters after it: they find no x."""
    engines = [await start_fronted_engine(f"e{i}", CutOff, lora=LORA) for i in range(2)]
    x = adapter(tmp_path, "x", 1)
    for engine in engines:
        await load_on(engine.inner, x)
    a = await make_fleet(engines=engines, index=shared_index(redis))
    forwarder = await TcpForwarder.start(f"127.0.0.1:{redis.port}")
    b: Controller | None = None
    try:
        await eventually(functools.partial(holds_x, a), 15, "a to find x on the fleet")
        for engine in engines:  # b's listings read what the engines hold, answered later
            engine.servicer.listings_held, engine.servicer.listed = True, False
        forwarder.hold_requests(b"\r\nHGETALL\r\n")  # b's reads of the hash wait
        config = a.app.controller.config
        index = config.index.model_copy(
            update={
                "backend": f"redis://{forwarder.address}/0",
                "redis": config.index.redis.model_copy(update={"timeout_s": 60.0}),
            }
        )
        b = Controller(config.model_copy(update={"index": index}))
        starting = asyncio.ensure_future(b.start())
        fleet_b = b.fleet

        def listed_or_held() -> bool:
            listed = all(e.servicer.listed for e in engines)
            return listed or (forwarder.held.is_set() and fleet_b.lora_listings_held)

        await eventually(listed_or_held, 15, "b's listings, or them held until its read")
        await a.gateway.UnloadLora(pb.UnloadLoraRequest(lora_name="x"))
        assert [await engine_adapters(e.inner) for e in engines] == [{}, {}]
        forwarder.let_through()
        await starting
        for engine in engines:
            engine.servicer.listing_released.set()
        await fleet_b.wait_for(lambda: len(fleet_b.registry.routable()) == 2, 15)
        assert fleet_b.lora_intent.shared("x") is None
        assert all(r.lora_adapters == frozenset() for r in fleet_b.registry.records())
    finally:
        for engine in engines:
            engine.servicer.listing_released.set()
        forwarder.let_through()
        if b is not None:
            await b.close()
        await close_fleet(a)
        await forwarder.cut()
