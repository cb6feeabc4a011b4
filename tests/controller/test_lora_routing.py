"""Requests naming a LoRA adapter go only to the engines holding it, as the controller learns
it: ListLoras when it finds an engine, then the outcomes of its own LoadLora/UnloadLora
fan-outs (including `kvplane admin lora load --engine E`, which the controller forwards).

The engines that serve adapters here are ScriptedEngines (test_gateway_scripted.py): a real
sim engine behind a thin OpenEngine server that keeps adapters as the seed says and refuses
a Generate naming one it has not loaded with NOT_FOUND, so that each test can script what an
engine answers. The same fan-out and routing on the bundled engine itself (`lora.enabled`):
test_lora_engines.py."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from controller.outcomes import ENGINE_METADATA_KEY
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import EngineFleet, Fleet, close_fleet, generate_request
from tests.controller.test_gateway_scripted import (
    ScriptedEngine,
    address,
    cli,
    outcomes,
    scripted_fleet,
    start_scripted_engine,
)

pytestmark = pytest.mark.timeout(60)

PROMPT = list(range(40, 80))


def lora_request(request_id: str, lora_name: str) -> pb.GenerateRequest:
    request = generate_request(request_id, PROMPT, max_tokens=2)
    request.lora_name = lora_name
    return request


async def generate(fleet: EngineFleet[Any], request: pb.GenerateRequest) -> list[str | None]:
    """The kinds of the events the gateway relays."""
    return [r.WhichOneof("event") async for r in fleet.gateway.Generate(request)]


async def refusal(fleet: EngineFleet[Any], request: pb.GenerateRequest) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(fleet, request)
    return err.value


def adapter(tmp_path: Path, name: str, lora_id: int) -> pb.LoraAdapter:
    return pb.LoraAdapter(lora_id=lora_id, lora_name=name, source_path=str(tmp_path / name))


def on(engine: str) -> tuple[tuple[str, str]]:
    """Request metadata that has the controller forward a LoRA call to `engine` only."""
    return ((ENGINE_METADATA_KEY, engine),)


@contextmanager
def background_requests(engine: ScriptedEngine, count: int) -> Iterator[None]:
    """`count` long generations on the engine's own sim engine (not through the controller):
    the controller sees them only in its GetLoad polls, as another router's traffic."""
    stub = pb_grpc.OpenEngineStub(engine.channel)
    calls = [
        stub.Generate(generate_request(f"bg{i}", [7, i], max_tokens=400)) for i in range(count)
    ]
    try:
        yield
    finally:
        for call in calls:
            call.cancel()


async def test_lora_requests_go_only_to_the_engine_holding_the_adapter(tmp_path: Path) -> None:
    """x is loaded on e0 alone: requests naming x go to e0 though e0 is the busier engine,
    the admin API's route and match see e0 alone; with e0 cordoned they are UNAVAILABLE; once
    x is unloaded, NOT_FOUND."""
    engines = [
        await start_scripted_engine("e0", advertise_lora=True, lora_enabled=True, time_scale=3.0),
        await start_scripted_engine("e1", advertise_lora=True, lora_enabled=True),
    ]
    fleet = await scripted_fleet(*engines)
    try:
        x = adapter(tmp_path, "x", 1)
        call = fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=x), metadata=on("e0"))
        await call
        assert list(outcomes(await call.trailing_metadata())) == ["e0"]  # e1 was not asked
        assert list(engines[0].servicer.adapters) == ["x"] and not engines[1].servicer.adapters

        with background_requests(engines[0], 4):
            registry = fleet.app.controller.fleet.registry
            e0 = registry.get("e0")
            await fleet.app.controller.fleet.wait_for(
                lambda: (e0.load.running_requests or 0) >= 4, timeout_s=30
            )
            plain = apb.PromptQuery(token_ids=pb.TokenIds(ids=PROMPT), model="sim")
            assert (await fleet.admin.Route(plain)).instance_id == "e1"  # e0 is the busier

            named = apb.PromptQuery(token_ids=pb.TokenIds(ids=PROMPT), model="sim", lora_name="x")
            routed = await fleet.admin.Route(named)
            assert routed.instance_id == "e0"
            assert [c.instance_id for c in routed.costs] == ["e0"]
            assert [m.instance_id for m in (await fleet.admin.Match(named)).matches] == ["e0"]
            for i in range(5):
                assert (await generate(fleet, lora_request(f"x{i}", "x")))[-1] == "finished"
            assert engines[0].servicer.generate_calls == [f"x{i}" for i in range(5)]
            assert engines[1].servicer.generate_calls == []

        await fleet.admin.Cordon(apb.EngineRef(engine="e0"))
        unavailable = await refusal(fleet, lora_request("cordoned", "x"))
        assert unavailable.code() == grpc.StatusCode.UNAVAILABLE
        assert "e0" in (unavailable.details() or "")
        await fleet.admin.Uncordon(apb.EngineRef(engine="e0"))

        await fleet.gateway.UnloadLora(pb.UnloadLoraRequest(lora_name="x"))
        gone = await refusal(fleet, lora_request("after-unload", "x"))
        assert gone.code() == grpc.StatusCode.NOT_FOUND
        assert gone.details() == "no engine has LoRA adapter 'x' loaded"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.admin.Route(named)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert engines[0].servicer.generate_calls == [f"x{i}" for i in range(5)]
        assert engines[1].servicer.generate_calls == []
    finally:
        await close_fleet(fleet)


async def test_adapters_found_at_discovery_and_kept_after_a_partly_failed_load(
    tmp_path: Path,
) -> None:
    """e1 holds y before the controller starts (ListLoras finds it). Loading x with y's id
    fails on e1 (ALREADY_EXISTS) but succeeds on e0: the call fails, and x's requests go to
    e0, the one engine that has it."""
    engines = [
        await start_scripted_engine("e0", advertise_lora=True, lora_enabled=True),
        await start_scripted_engine("e1", advertise_lora=None, lora_enabled=True),
    ]
    y = adapter(tmp_path, "y", 1)
    async with grpc.aio.insecure_channel(address(engines[1])) as direct:
        await pb_grpc.OpenEngineStub(direct).LoadLora(pb.LoadLoraRequest(adapter=y))
    fleet = await scripted_fleet(*engines)
    try:
        for i in range(3):
            assert (await generate(fleet, lora_request(f"y{i}", "y")))[-1] == "finished"
        assert engines[1].servicer.generate_calls == ["y0", "y1", "y2"]

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=adapter(tmp_path, "x", 1)))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        report = {k: v["outcome"] for k, v in outcomes(err.value.trailing_metadata()).items()}
        assert report == {"e0": "ok", "e1": "ALREADY_EXISTS"}
        for i in range(3):
            assert (await generate(fleet, lora_request(f"x{i}", "x")))[-1] == "finished"
        assert engines[0].servicer.generate_calls == ["x0", "x1", "x2"]
        assert engines[1].servicer.generate_calls == ["y0", "y1", "y2"]
    finally:
        await close_fleet(fleet)


async def test_lora_request_to_a_fleet_without_lora_is_failed_precondition(fleet: Fleet) -> None:
    """The bundled sim engines, with LoRA off (their default), say `supports_lora: false`."""
    refused = await refusal(fleet, lora_request("r", "x"))
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "supports LoRA" in (refused.details() or "")
    query = apb.PromptQuery(token_ids=pb.TokenIds(ids=PROMPT), model="sim", lora_name="x")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await fleet.admin.Route(query)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # Requests without an adapter are served as before.
    assert (await generate(fleet, lora_request("plain", "")))[-1] == "finished"


async def test_engine_refusing_list_loras_counts_as_without_lora() -> None:
    """e0 does not say whether it supports LoRA and has it disabled: no adapter can be on it."""
    engine = await start_scripted_engine("e0", advertise_lora=None, lora_enabled=False)
    fleet = await scripted_fleet(engine)
    try:
        refused = await refusal(fleet, lora_request("r", "x"))
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert engine.servicer.generate_calls == []
    finally:
        await close_fleet(fleet)


async def test_cli_lora_load_on_one_engine_goes_through_the_controller(tmp_path: Path) -> None:
    """`lora load --engine e1` talks to --target only; the controller loads x on e1 alone
    and from then on routes x's requests there; `lora unload --engine e1` undoes it."""
    engines = [
        await start_scripted_engine("e0", advertise_lora=True, lora_enabled=True),
        await start_scripted_engine("e1", advertise_lora=True, lora_enabled=True),
    ]
    fleet = await scripted_fleet(*engines)
    try:
        t = ["--target", fleet.target]
        path = str(tmp_path / "x")
        loaded = await cli("lora", "load", "x", path, "--id", "1", "--engine", "e1", *t)
        assert loaded.exit_code == 0, loaded.output
        assert loaded.output.splitlines()[0] == "x loaded"
        assert [line.split()[0] for line in loaded.output.splitlines()[1:]] == ["e1"]
        assert not engines[0].servicer.adapters and list(engines[1].servicer.adapters) == ["x"]
        for i in range(4):
            assert (await generate(fleet, lora_request(f"x{i}", "x")))[-1] == "finished"
        assert engines[1].servicer.generate_calls == [f"x{i}" for i in range(4)]
        assert engines[0].servicer.generate_calls == []

        unknown = await cli("lora", "load", "x", path, "--id", "1", "--engine", "e9", *t)
        assert unknown.exit_code != 0 and "NOT_FOUND" in str(unknown.exception)
        unloaded = await cli("lora", "unload", "x", "--engine", "e1", *t)
        assert unloaded.exit_code == 0, unloaded.output
        assert not engines[1].servicer.adapters
        refused = await refusal(fleet, lora_request("after", "x"))
        assert refused.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await close_fleet(fleet)
