"""The controller in front of bundled sim engines that serve LoRA (`lora.enabled`): `kvplane
admin lora load/list/unload` fan out to the engines that support LoRA and report each one's
outcome, and requests naming an adapter run only on the engines that loaded it (their KV
blocks are cached under the adapter's name there and nowhere else)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest

from controller.registry import EngineState
from engine.config import LoraConfig
from engine.core.api import BlockStored
from engine.server.service import EngineApp
from openengine.v1 import openengine_pb2 as pb
from tests.controller.conftest import close_fleet, generate_request, make_fleet, start_sim_engine
from tests.controller.test_gateway_scripted import cli
from tests.engine.lora_adapters import write_adapter_config

pytestmark = pytest.mark.timeout(60)


async def lora_blocks(engine: EngineApp, name: str) -> int:
    """How many blocks the engine holds cached under adapter `name`."""
    snapshot: list[BlockStored] = await asyncio.wrap_future(
        engine.service.engine_loop.call(lambda core: core.block_manager.snapshot())
    )
    return sum(1 for event in snapshot if event.lora_name == name)


def outcome_lines(output: str) -> dict[str, str]:
    """`  e0 (127.0.0.1:PORT): ok [y]` lines -> {"e0": "ok"}."""
    lines = output.splitlines()[1:]
    return {line.split()[0]: line.split("): ")[1].split(",")[0].split(" [")[0] for line in lines}


async def test_admin_lora_fan_out_and_routing_on_real_engines(tmp_path: Path) -> None:
    lora = LoraConfig(enabled=True)
    engines = [
        await start_sim_engine("e0", lora=lora),
        await start_sim_engine("e1", lora=lora),
        await start_sim_engine("e2"),  # LoRA off: says supports_lora false
    ]
    fleet = await make_fleet(engines=engines)
    try:
        t = ["--target", fleet.target]
        x = str(write_adapter_config(tmp_path / "x"))
        y = str(write_adapter_config(tmp_path / "y", r=4))
        loaded = await cli("lora", "load", "x", x, "--id", "1", "--engine", "e0", *t)
        assert loaded.exit_code == 0, loaded.output
        assert loaded.stdout.splitlines()[0] == "x loaded"
        assert list(outcome_lines(loaded.stdout)) == ["e0"]
        everywhere = await cli("lora", "load", "y", y, "--id", "2", *t)
        assert everywhere.exit_code == 0, everywhere.output
        assert outcome_lines(everywhere.stdout) == {"e0": "ok", "e1": "ok", "e2": "skipped"}
        bad = await cli("lora", "load", "z", str(tmp_path / "nowhere"), "--id", "3", *t)
        assert bad.exit_code != 0 and "INVALID_ARGUMENT" in str(bad.exception)

        listed = await cli("lora", "list", *t, "--output", "json")
        assert listed.exit_code == 0, listed.output
        doc = json.loads(listed.stdout)
        assert [a["lora_name"] for a in doc["adapters"]] == ["x", "y"]
        held = {e["instance_id"]: e["adapters"] for e in doc["engines"] if "adapters" in e}
        assert held["e0"] == ["x", "y"] and held["e1"] == ["y"]

        for i in range(6):
            request = generate_request(f"x{i}", list(range(100 * i, 100 * i + 40)))
            request.lora_name = "x"
            events = [r.WhichOneof("event") async for r in fleet.gateway.Generate(request)]
            assert events[-1] == "finished"
        # Every request naming x ran on e0, the one engine holding it (2 full blocks each).
        assert [await lora_blocks(e, "x") for e in engines] == [12, 0, 0]
        # `route` and `match --lora` see the adapter's engines and its cached prefixes.
        tokens = tmp_path / "tokens.json"
        tokens.write_text(json.dumps(list(range(40))))
        query = ["--tokens-file", str(tokens), "--lora", "x", *t, "--output", "json"]
        routed = await cli("route", *query)
        assert routed.exit_code == 0, routed.output
        assert json.loads(routed.stdout)["instance_id"] == "e0"
        matched = await cli("match", *query)
        assert matched.exit_code == 0, matched.output
        by_engine = {m["instance_id"]: m for m in json.loads(matched.stdout)["matches"]}
        assert by_engine["e0"].get("device_blocks") == 2
        unknown = await cli("route", "--tokens-file", str(tokens), "--lora", "nope", *t)
        assert unknown.exit_code != 0 and "NOT_FOUND" in str(unknown.exception)

        unloaded = await cli("lora", "unload", "x", *t)
        assert unloaded.exit_code == 0, unloaded.output
        assert outcome_lines(unloaded.stdout) == {
            "e0": "ok", "e1": "not_loaded", "e2": "skipped",
        }  # fmt: skip
        request = generate_request("after", list(range(40)))
        request.lora_name = "x"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in fleet.gateway.Generate(request):
                pass
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        remaining = await fleet.gateway.ListLoras(pb.ListLorasRequest())
        assert [a.lora_name for a in remaining.adapters] == ["y"]
    finally:
        await close_fleet(fleet)


async def test_a_failed_lora_fan_out_still_shows_every_engines_outcome(tmp_path: Path) -> None:
    """An operator's bad day: `lora load` where one engine refuses (its adapter slots full)
    and `lora unload` with an engine down fail the call, as they must, and still print every
    engine's outcome, in the table and as JSON (`error` and `engines`), before exiting 1:
    which engines hold the adapter is what the operator acts on. Before, a failed fan-out
    printed one error line and, with `--output json`, nothing a script could parse."""
    engines = [
        await start_sim_engine("e0", lora=LoraConfig(enabled=True, max_loras=1)),
        await start_sim_engine("e1", lora=LoraConfig(enabled=True)),
    ]
    fleet = await make_fleet(engines=engines)
    try:
        t = ["--target", fleet.target]
        w = str(write_adapter_config(tmp_path / "w"))
        y = str(write_adapter_config(tmp_path / "y", r=4))
        assert (await cli("lora", "load", "w", w, "--id", "1", "--engine", "e0", *t)).exit_code == 0

        as_json = await cli("lora", "load", "y", y, "--id", "2", *t, "--output", "json")
        assert as_json.exit_code == 1, as_json.output
        assert str(as_json.exception).startswith(f"{fleet.target}: RESOURCE_EXHAUSTED: ")
        doc = json.loads(as_json.stdout)
        assert doc["error"]["code"] == "RESOURCE_EXHAUSTED", doc
        assert {e["instance_id"]: e["outcome"] for e in doc["engines"]} == {
            "e0": "RESOURCE_EXHAUSTED", "e1": "ok",
        }  # fmt: skip
        table = await cli("lora", "load", "y", y, "--id", "2", *t)
        assert table.exit_code == 1, table.output
        # Not "y failed": e1 did load it, and keeps it (the listing says so).
        first = table.stdout.splitlines()[0]
        assert first == "y loaded on some engines only: RESOURCE_EXHAUSTED", table.stdout
        assert outcome_lines(table.stdout) == {"e0": "RESOURCE_EXHAUSTED", "e1": "ok"}
        listed = json.loads((await cli("lora", "list", *t, "--output", "json")).stdout)
        assert {a["lora_name"] for a in listed["adapters"]} == {"w", "y"}
        # The remedy docs/controller.md gives: free e0's slot, run the same load again.
        freed = await cli("lora", "unload", "w", "--engine", "e0", *t)
        assert freed.exit_code == 0, freed.output
        again = await cli("lora", "load", "y", y, "--id", "2", *t)
        assert again.exit_code == 0, again.output
        assert outcome_lines(again.stdout) == {"e0": "ok", "e1": "ok"}

        # e1, holding y, goes down: the unload cannot reach it and says so, engine by engine.
        registry = fleet.app.controller.fleet.registry
        down = registry.get("e1").address
        await engines[1].close()
        await fleet.app.controller.fleet.wait_for(
            lambda: registry.get(down).state is EngineState.UNREACHABLE, 30
        )
        unloaded = await cli("lora", "unload", "y", *t, "--output", "json")
        assert unloaded.exit_code == 1, unloaded.output
        outcomes = {e["instance_id"]: e["outcome"] for e in json.loads(unloaded.stdout)["engines"]}
        assert outcomes == {"e0": "ok", "e1": "UNAVAILABLE"}, unloaded.stdout
        # Again, as a table: e0 no longer has it, so no engine unloaded it: "failed".
        unloaded = await cli("lora", "unload", "y", *t)
        assert unloaded.exit_code == 1, unloaded.output
        assert unloaded.stdout.splitlines()[0] == "y failed: UNAVAILABLE", unloaded.stdout
        assert outcome_lines(unloaded.stdout) == {"e0": "not_loaded", "e1": "UNAVAILABLE"}
    finally:
        await close_fleet(fleet)


async def test_match_lora_lists_its_holders_out_of_routing(tmp_path: Path) -> None:
    """`match --lora x` when every engine holding `x` is out of routing (draining) lists them,
    marked with why and with what the index holds of them, as `match` does without an
    adapter; it refused the query UNAVAILABLE ("take no traffic now") instead, hiding what
    the drained holder still caches. `route` still refuses: no engine it may choose holds it."""
    lora = LoraConfig(enabled=True)
    engines = [await start_sim_engine("e0", lora=lora), await start_sim_engine("e1", lora=lora)]
    fleet = await make_fleet(engines=engines)
    try:
        t = ["--target", fleet.target]
        x = str(write_adapter_config(tmp_path / "x"))
        assert (await cli("lora", "load", "x", x, "--id", "1", "--engine", "e0", *t)).exit_code == 0
        request = generate_request("x", list(range(40)))
        request.lora_name = "x"
        [r async for r in fleet.gateway.Generate(request)]
        tokens = tmp_path / "tokens.json"
        tokens.write_text(json.dumps(list(range(40))))
        query = ["--tokens-file", str(tokens), "--lora", "x", *t]
        drained = await cli("drain", "e0", "--deadline-ms", "30000", *t)
        assert drained.exit_code == 0, drained.output

        matched = await cli("match", *query, "--output", "json")
        assert matched.exit_code == 0, matched.output
        rows = [
            (m["instance_id"], m["out_of_routing"], m["device_blocks"])
            for m in json.loads(matched.stdout)["matches"]
        ]
        assert rows == [("e0", "draining", 2)]
        table = await cli("match", *query)
        assert table.exit_code == 0, table.output
        assert table.stdout.splitlines()[1].endswith("OUT OF ROUTING")
        routed = await cli("route", *query)
        assert routed.exit_code != 0 and "UNAVAILABLE" in str(routed.exception)
    finally:
        await close_fleet(fleet)
