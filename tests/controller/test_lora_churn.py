"""LoRA adapters unloaded while requests naming them are on their way, on real sim engines that
serve LoRA: a request routed to an engine that no longer holds its adapter (the unload landed
while the request was planned, or before the engine read it, or behind the controller's back)
goes to another engine holding it, else gets the fleet's LoRA status, never the engine's bare
refusal."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from engine.config import LoraConfig
from engine.core.api import ErrorKind, FinishReason, RequestOutput, Usage
from engine.core.engine_core import EngineCore
from engine.server.service import EngineApp
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import EngineFleet, close_fleet, make_fleet, start_sim_engine
from tests.controller.fronted_engine import (
    ForwardingLora,
    FrontedEngine,
    start_fronted_engine,
)
from tests.controller.paused_index import PausedIndex
from tests.controller.test_lora_fleet_intent import adapter, generate, on
from tests.polling import eventually

pytestmark = pytest.mark.timeout(60)

Context = grpc.aio.ServicerContext[Any, Any]
LORA = LoraConfig(enabled=True)
GONE = "NOT_FOUND: no engine has LoRA adapter 'x' loaded"


class GatedGenerate(ForwardingLora):
    """The sim engine's LoRA calls and Generate, each Generate held until `gate` opens (a
    request on its way to the engine); the engine's refusals pass as they are."""

    def __init__(self, inner: pb_grpc.OpenEngineAsyncStub) -> None:
        super().__init__(inner)
        self.gate = asyncio.Event()
        self.arrived: list[str] = []

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.arrived.append(request.request_id)
        await self.gate.wait()
        try:
            async for response in self.inner.Generate(request):
                yield response
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "")


async def test_an_unload_while_the_request_is_planned_answers_the_fleets_status(
    tmp_path: Path,
) -> None:
    """x is on e0 alone. A request naming x is planned (e0 its one candidate) and, while the
    index answers, x is unloaded: the request is NOT_FOUND as one planned afterwards, not
    sent to e0 to be refused there."""
    index = PausedIndex()
    engines = [await start_sim_engine(f"e{i}", lora=LORA) for i in range(2)]
    fleet = await make_fleet(engines=engines, index_backend=index)
    try:
        x = adapter(tmp_path, "x", 1)
        await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=x), metadata=on("e0"))
        index.pause("match_prefix_by_tier")
        request = asyncio.ensure_future(generate(fleet, "planned", "x"))
        await index.paused.wait()
        await fleet.gateway.UnloadLora(pb.UnloadLoraRequest(lora_name="x"))
        index.resume.set()
        assert await request == GONE
    finally:
        index.resume.set()
        await close_fleet(fleet)


async def gated_fleet() -> tuple[
    EngineFleet[FrontedEngine[GatedGenerate]], list[FrontedEngine[GatedGenerate]]
]:
    engines = [await start_fronted_engine(f"e{i}", GatedGenerate, lora=LORA) for i in range(2)]
    fleet = await make_fleet(engines=engines)
    return fleet, engines


async def test_an_unload_before_the_engine_reads_the_request_sends_it_elsewhere(
    tmp_path: Path,
) -> None:
    """x is on e0 and e1. A request naming x reaches one of them, and x is unloaded there
    before that engine reads it (`lora unload --engine`): the engine refuses it (NOT_FOUND)
    and the request runs on the other one. Once x is on no engine, a request caught the same
    way is NOT_FOUND as the fleet says, not as the engine does."""
    fleet, engines = await gated_fleet()
    try:
        await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=adapter(tmp_path, "x", 1)))
        for name in ("moved", "nowhere"):
            request = asyncio.ensure_future(generate(fleet, name, "x"))

            def arrived(request_id: str = name) -> bool:
                return any(request_id in e.servicer.arrived for e in engines)

            await eventually(arrived, 30, f"{name} at an engine")
            holder = next(e for e in engines if name in e.servicer.arrived)
            await fleet.gateway.UnloadLora(
                pb.UnloadLoraRequest(lora_name="x"), metadata=on(holder.inner.instance_id)
            )
            for engine in engines:
                engine.servicer.gate.set()
            if name == "moved":
                assert await request == "finished"
                assert all(name in e.servicer.arrived for e in engines)
            else:
                assert await request == GONE
            for engine in engines:
                engine.servicer.gate.clear()
    finally:
        for engine in engines:
            engine.servicer.gate.set()
        await close_fleet(fleet)


async def test_an_unload_behind_the_controllers_back_is_noticed_at_the_refusal(
    tmp_path: Path,
) -> None:
    """x is unloaded from every engine directly (another client of the engines): the next
    request naming x is refused by its engine, which the controller then asks again for its
    adapters; NOT_FOUND as the fleet says, and no engine is routed x any more."""
    engines = [await start_sim_engine(f"e{i}", lora=LORA) for i in range(2)]
    fleet = await make_fleet(engines=engines)
    registry = fleet.app.controller.fleet.registry
    try:
        await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=adapter(tmp_path, "x", 1)))
        for engine in engines:
            async with grpc.aio.insecure_channel(fleet.address(engine)) as direct:
                stub = pb_grpc.OpenEngineStub(direct)
                await stub.UnloadLora(pb.UnloadLoraRequest(lora_name="x"))
        assert await generate(fleet, "stale-0", "x") == GONE
        assert await generate(fleet, "stale-1", "x") == GONE
        assert not any(r.holds_lora("x") for r in registry.records())
    finally:
        await close_fleet(fleet)


def unload_as_added(engine: EngineApp, lora_name: str, armed: list[bool]) -> None:
    """Pin the race of an engine that checks a request's adapter only when it accepts it: a
    request naming `lora_name` that an engine sharing `armed` accepts while `armed` is not
    empty (taking one from it) has the adapter unloaded in the engine thread behind the
    controller's back, and ends with one EngineError MODEL_NOT_FOUND after acceptance, before
    any output. (kvplane's engine did so before an accepted request held its adapter; it now
    serves it: another OpenEngine server may still answer so.)"""
    loop = engine.service.engine_loop
    submit = loop.submit

    def racing(request: Any, sink: Any, **options: Any) -> None:
        if request.lora_name != lora_name or not armed:
            submit(request, sink, **options)
            return
        armed.pop()

        def unload_and_fail(core: EngineCore) -> None:
            core.unload_lora(lora_name)
            sink(
                RequestOutput(
                    request.request_id,
                    0,
                    finish_reason=FinishReason.ERROR,
                    message=f"LoRA adapter {lora_name!r} is not loaded",
                    error=ErrorKind.NOT_FOUND,
                    usage=Usage(len(request.prompt_token_ids), 0, 0),
                )
            )

        loop.call(unload_and_fail)

    loop.submit = racing  # type: ignore[method-assign]


async def test_an_adapter_unloaded_as_the_engine_adds_the_request_sends_it_elsewhere(
    tmp_path: Path,
) -> None:
    """x is on e0 and e1. A request naming x is accepted by one of them and x is unloaded
    there before its engine thread adds it: that engine ends it MODEL_NOT_FOUND (in-band,
    nothing relayed), and the request runs on the other one. Caught the same way there, the
    next request is NOT_FOUND as the fleet says, not the engine's in-band error."""
    engines = [await start_sim_engine(f"e{i}", lora=LORA) for i in range(2)]
    fleet = await make_fleet(engines=engines)
    registry = fleet.app.controller.fleet.registry
    armed: list[bool] = []
    for engine in engines:
        unload_as_added(engine, "x", armed)
    try:
        await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=adapter(tmp_path, "x", 1)))
        armed.append(True)
        assert await generate(fleet, "moved", "x") == "finished"
        assert not armed  # the race happened
        holders = [r.address for r in registry.records() if r.holds_lora("x")]
        assert len(holders) == 1  # the engine that lost x is known not to hold it
        armed.append(True)
        assert await generate(fleet, "nowhere", "x") == GONE
        assert not armed
        assert not any(r.holds_lora("x") for r in registry.records())
    finally:
        await close_fleet(fleet)
