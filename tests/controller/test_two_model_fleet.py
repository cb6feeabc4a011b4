"""A fleet of sim engines serving two models (two engines of `a`, one of `b` with another
block size) behind the controller, through real servers: a request is routed to its own
model's engines only, and a request naming no model, which such a fleet would answer with
whichever model the router picked, is refused until it names one; an adapter loaded on one
model's engine serves that model only; a controller fronting another follows the models its
fleet gains and loses, also read after a failed poll, as the same process."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import grpc
import pytest

from controller.fleet import PromptView
from controller.outcomes import ENGINE_METADATA_KEY
from controller.registry import EngineRecord
from engine.config import LoraConfig
from engine.server.service import EngineApp
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from tests.controller.conftest import (
    Fleet,
    ServedEngine,
    close_fleet,
    generate_request,
    make_fleet,
    start_sim_engine,
)
from tests.controller.fronted_engine import (
    CancelsAPoll,
    served_in_front_of,
    start_fronted_engine,
)
from tests.controller.test_fleet_health import SaysHealth
from tests.controller.test_gateway import generate_routed
from tests.controller.test_gateway_scripted import cli
from tests.controller.test_lora_engines import outcome_lines
from tests.controller.test_lora_fleet_intent import engine_adapters, load_on
from tests.engine.lora_adapters import write_adapter_config
from tests.polling import eventually

pytestmark = pytest.mark.timeout(60)

PROMPT = list(range(300, 364))  # four blocks of 16, two of 32


@pytest.fixture
async def two_models() -> AsyncIterator[Fleet]:
    engines = [
        await start_sim_engine("a0", served_model_name="a"),
        await start_sim_engine("a1", served_model_name="a"),
        await start_sim_engine("b0", served_model_name="b", block_size=32),
    ]
    fleet = await make_fleet(engines=engines)
    try:
        yield fleet
    finally:
        await close_fleet(fleet)


async def front(upper: Fleet, lower: Fleet, routable: int) -> None:
    """Register the lower controller as an engine of the upper one, until the upper routes
    to `routable` engines (its own and the lower one)."""
    await upper.admin.RegisterEngine(
        apb.RegisterEngineRequest(address=lower.target, kv_events="none")
    )
    await upper.wait_routable(routable)


def request_for(model: str, request_id: str) -> pb.GenerateRequest:
    request = generate_request(request_id, PROMPT)
    request.model = model
    return request


async def test_each_models_requests_go_to_its_own_engines_only(two_models: Fleet) -> None:
    fleet = two_models
    served_by = {"a": {"a0", "a1"}, "b": {"b0"}}
    for model, engines in served_by.items():
        for i in range(4):
            reply, route = await generate_routed(fleet, request_for(model, f"{model}{i}"))
            assert reply[-1].WhichOneof("event") == "finished"
            assert route is not None and route["instance_id"] in engines


async def test_a_request_naming_no_model_is_refused_until_it_names_one(
    two_models: Fleet,
) -> None:
    """It went to any engine: the same client was answered by `a` or by `b` (and matched in
    a block size that was not always its engine's). Now every path that routes it says
    INVALID_ARGUMENT, naming the models; `match` and `route` too."""
    from vllm_grpc import vllm_grpc_pb2 as vpb
    from vllm_grpc import vllm_grpc_pb2_grpc as vpb_grpc

    fleet = two_models
    refusals = []
    with pytest.raises(grpc.aio.AioRpcError) as generate:
        await generate_routed(fleet, request_for("", "unnamed"))
    refusals.append(generate.value)
    vllm = vpb.GenerateRequest(
        request_id="unnamed-vllm", token_ids=vpb.TokenIds(ids=PROMPT),
        stopping=vpb.StoppingCriteria(max_new_tokens=2, ignore_eos=True),
    )  # fmt: skip
    with pytest.raises(grpc.aio.AioRpcError) as vllm_generate:
        await vpb_grpc.GenerateStub(fleet.channel).Generate(vllm)
    refusals.append(vllm_generate.value)
    query = apb.PromptQuery(token_ids=pb.TokenIds(ids=PROMPT))
    for call in (fleet.admin.Route, fleet.admin.Match):
        with pytest.raises(grpc.aio.AioRpcError) as explained:
            await call(query)
        refusals.append(explained.value)
    for refusal in refusals:
        assert refusal.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "name a model" in (refusal.details() or "")
        assert "(a, b)" in (refusal.details() or "")
    # Named, each is served as before.
    _, route = await generate_routed(fleet, request_for("b", "named"))
    assert route is not None and route["instance_id"] == "b0"


async def test_a_fleet_of_one_model_serves_a_request_naming_none() -> None:
    """Engines that serve one default model alike (one of them serving a second model
    besides, by an alias) answer a request naming none as before."""
    engines = [
        await start_sim_engine("a0", served_model_name="a"),
        await start_sim_engine("a1", served_model_name="a", served_model_aliases=["a-chat"]),
    ]
    fleet = await make_fleet(engines=engines)
    try:
        for i in range(3):
            reply, _ = await generate_routed(fleet, request_for("", f"n{i}"))
            assert reply[-1].WhichOneof("event") == "finished"
        explained = await fleet.admin.Route(apb.PromptQuery(token_ids=pb.TokenIds(ids=PROMPT)))
        assert explained.engine
    finally:
        await close_fleet(fleet)


async def test_an_adapter_on_one_models_engine_serves_that_model_only(
    tmp_path: Path,
) -> None:
    """An adapter loaded on `a0` only (`lora load --engine`): a request for `a` naming it
    goes there, every time; one for `b` naming it is NOT_FOUND, and says where the adapter
    is (it said "no engine has LoRA adapter 'x' loaded", while an engine had it)."""
    engines = [
        await start_sim_engine("a0", served_model_name="a", lora=LoraConfig(enabled=True)),
        await start_sim_engine("a1", served_model_name="a", lora=LoraConfig(enabled=True)),
        await start_sim_engine("b0", served_model_name="b", lora=LoraConfig(enabled=True)),
    ]
    fleet = await make_fleet(engines=engines)
    try:
        adapter = pb.LoraAdapter(
            lora_id=1, lora_name="x", source_path=str(write_adapter_config(tmp_path / "x"))
        )
        a0 = fleet.address(engines[0])
        await fleet.gateway.LoadLora(
            pb.LoadLoraRequest(adapter=adapter), metadata=((ENGINE_METADATA_KEY, a0),)
        )
        for i in range(3):
            request = request_for("a", f"x{i}")
            request.lora_name = "x"
            _, route = await generate_routed(fleet, request)
            assert route is not None and route["instance_id"] == "a0"
        request = request_for("b", "xb")
        request.lora_name = "x"
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await generate_routed(fleet, request)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        assert refused.value.details() == (
            "no engine has LoRA adapter 'x' loaded (engines not serving 'b' hold it: a0)"
        )
    finally:
        await close_fleet(fleet)


async def test_a_session_asking_both_models_stays_on_one_engine_of_each() -> None:
    """One session (`session_id`) alternating between `a` and `b`: each model's turns stay
    on the engine its first turn went to. (The session followed its latest route: each `b`
    turn stuck it to `b0`, so the next `a` turn was routed afresh, to either `a` engine.)
    The prompts share nothing, so only the session can keep them together."""
    engines = [
        await start_sim_engine("a0", served_model_name="a"),
        await start_sim_engine("a1", served_model_name="a"),
        await start_sim_engine("b0", served_model_name="b", block_size=32),
    ]
    fleet = await make_fleet(
        engines=engines, router={"policy": "round_robin", "session_metadata_key": "session_id"}
    )
    try:
        served: dict[str, set[str]] = {"a": set(), "b": set()}
        for i in range(6):
            for model in ("a", "b"):
                request = generate_request(f"{model}{i}", [1000 * i + len(model), i], 1)
                request.model = model
                request.metadata["session_id"] = "s"
                _, route = await generate_routed(fleet, request)
                assert route is not None
                served[model].add(route["instance_id"])
        assert len(served["a"]) == 1 and served["b"] == {"b0"}
    finally:
        await close_fleet(fleet)


async def test_a_second_default_model_joining_while_a_request_is_planned_refuses_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A session's request naming no model passed the model check with one default model,
    and an engine of another joined before it was planned (its session key names the
    default model): INVALID_ARGUMENT naming both, as had it come a moment later, where
    INTERNAL "routing failed" was said. The engine joins inside the plan, after the check."""
    engines = [await start_sim_engine(f"a{i}", served_model_name="a") for i in range(2)]
    fleet = await make_fleet(engines=engines, router={"session_metadata_key": "session_id"})
    late = await start_sim_engine("b0", served_model_name="b")
    fleet.engines.append(late)  # closed with the fleet
    controller = fleet.app.controller
    planned = controller.fleet.prompt_view

    async def joined_then_planned(*args: Any, **kwargs: Any) -> PromptView:
        await fleet.admin.RegisterEngine(
            apb.RegisterEngineRequest(address=fleet.address(late), kv_events="none")
        )
        registry = controller.fleet.registry
        await controller.fleet.wait_for(lambda: len(registry.base_models()) == 2, 15.0)
        return await planned(*args, **kwargs)

    monkeypatch.setattr(controller.fleet, "prompt_view", joined_then_planned)
    try:
        request = request_for("", "unnamed")
        request.metadata["session_id"] = "s"
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await generate_routed(fleet, request)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "name a model" in (refused.value.details() or "")
        assert "(a, b)" in (refused.value.details() or "")
    finally:
        await close_fleet(fleet)


async def test_a_controller_fronting_both_models_makes_a_request_naming_none_refused() -> None:
    """An upper controller fronting a lower one (engines of `a` and `b`) and an engine of
    its own serving the model the lower one lists first: a request naming no model is
    refused by the upper one, every time. (The lower controller's first model was taken
    for its default: round robin sent such a request to the upper's own engine, served,
    then to the lower controller, refused.)"""
    lower = await make_fleet(
        engines=[
            await start_sim_engine("a0", served_model_name="a"),
            await start_sim_engine("b0", served_model_name="b"),
        ]
    )
    first = (await lower.gateway.GetEngineInfo(pb.GetEngineInfoRequest())).supported_models[0]
    upper = await make_fleet(
        engines=[await start_sim_engine("own", served_model_name=first)],
        router={"policy": "round_robin"},
    )
    try:
        await front(upper, lower, 2)
        for i in range(4):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await generate_routed(upper, request_for("", f"n{i}"))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "(a, b)" in (refused.value.details() or "")
        for model in ("a", "b"):
            reply, _ = await generate_routed(upper, request_for(model, f"named-{model}"))
            assert reply[-1].WhichOneof("event") == "finished"
    finally:
        await close_fleet(upper)
        await close_fleet(lower)


async def test_draining_the_only_engine_of_a_model_says_so_everywhere(two_models: Fleet) -> None:
    """`b0`, the only engine of `b`, drained: a Generate, GetModelInfo and admin `route` for
    `b` are UNAVAILABLE naming it (`route` said only "no engine available to route to"),
    and `a` is served as before."""
    fleet = two_models
    b0 = fleet.address(fleet.engines[2])
    events = [e async for e in fleet.admin.DrainEngine(apb.DrainEngineRequest(engine=b0))]
    assert events[-1].state == pb.DRAIN_STATE_COMPLETE
    query = apb.PromptQuery(token_ids=pb.TokenIds(ids=PROMPT), model="b")
    calls: dict[str, Awaitable[object]] = {
        "generate": generate_routed(fleet, request_for("b", "drained")),
        "model info": fleet.gateway.GetModelInfo(pb.GetModelInfoRequest(model="b")),
        "route": fleet.admin.Route(query),
    }
    for what, call in calls.items():
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, what
        assert "b0 draining" in (refused.value.details() or ""), (what, refused.value.details())
    _, route = await generate_routed(fleet, request_for("a", "still"))
    assert route is not None and route["instance_id"] in {"a0", "a1"}


async def test_health_naming_a_model_is_of_that_models_engines(two_models: Fleet) -> None:
    """Health with a `model` answers for it, as an engine's Health is of the model it
    serves: with `b0`, the only engine of `b`, cordoned, `b` is NOT_READY (every Generate
    for it is UNAVAILABLE) and `a` READY, each with its own engines' checks; the fleet
    (no model) is DEGRADED. Both used to say the fleet's DEGRADED: a readiness probe naming
    `b` kept sending it traffic that no engine took."""
    fleet = two_models
    await fleet.admin.Cordon(apb.EngineRef(engine="b0"))
    await fleet.wait_routable(2)

    async def health(model: str) -> tuple[int, list[str]]:
        reply = await fleet.gateway.Health(pb.HealthRequest(model=model))
        return reply.state, [c.name.removeprefix("engine:") for c in reply.checks]

    a = sorted(fleet.address(e) for e in fleet.engines[:2])
    b0 = fleet.address(fleet.engines[2])
    assert await health("b") == (pb.HEALTH_STATE_NOT_READY, [b0])
    assert await health("a") == (pb.HEALTH_STATE_READY, a)
    assert await health("") == (pb.HEALTH_STATE_DEGRADED, sorted([*a, b0]))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await generate_routed(fleet, request_for("b", "cordoned"))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def lora_engines_of_two_models() -> list[EngineApp]:
    """a0 and a1 serving `a`, b0 serving `b` (blocks of 32), all taking LoRA adapters."""
    lora = LoraConfig(enabled=True)
    return [
        await start_sim_engine("a0", served_model_name="a", lora=lora),
        await start_sim_engine("a1", served_model_name="a", lora=lora),
        await start_sim_engine("b0", served_model_name="b", block_size=32, lora=lora),
    ]


async def test_a_fleet_wide_adapter_is_loaded_for_one_model_only(tmp_path: Path) -> None:
    """`lora load` for the whole fleet went to every LoRA-capable engine, whatever model it
    serves: `x`, trained for `a`, was attached to `b0` too, and to a `b` engine registered
    later. Now a load naming no model is refused, naming the base models; `--model a` loads
    it on `a`'s engines only, and of the engines registered later only `a`'s gets it. A load
    of it on one engine of `b` (`--engine b0`) went through unchecked: refused too."""
    lora = LoraConfig(enabled=True)
    engines = await lora_engines_of_two_models()
    fleet = await make_fleet(engines=engines)
    try:
        t = ["--target", fleet.target]
        x = str(write_adapter_config(tmp_path / "x"))
        refused = await cli("lora", "load", "x", x, "--id", "1", *t)
        assert refused.exit_code != 0
        assert "INVALID_ARGUMENT" in str(refused.exception)
        assert "different base models (a, b)" in str(refused.exception)
        assert [await engine_adapters(e) for e in engines] == [{}, {}, {}]

        loaded = await cli("lora", "load", "x", x, "--id", "1", "--model", "a", *t)
        assert loaded.exit_code == 0, loaded.output
        assert outcome_lines(loaded.output) == {"a0": "ok", "a1": "ok"}
        assert [list(await engine_adapters(e)) for e in engines] == [["x"], ["x"], []]

        joined = [
            await start_sim_engine("a2", served_model_name="a", lora=lora),
            await start_sim_engine("b1", served_model_name="b", block_size=32, lora=lora),
        ]
        fleet.engines.extend(joined)
        for engine in joined:
            await fleet.admin.RegisterEngine(
                apb.RegisterEngineRequest(address=fleet.address(engine))
            )
        # Routable once its first poll, which restores the fleet's adapters, is done.
        await fleet.wait_routable(5)
        assert [list(await engine_adapters(e)) for e in joined] == [["x"], []]

        both = await cli("lora", "load", "x", x, "--id", "1", "--model", "b", *t)
        assert both.exit_code != 0 and "loaded for model 'a'" in str(both.exception)
        # Nor on one engine of `b`, named with its model or not (its base model decides).
        for named in ([], ["--model", "b"]):
            on_b = await cli("lora", "load", "x", x, "--id", "1", "--engine", "b0", *named, *t)
            assert on_b.exit_code != 0, (named, on_b.output)
            assert "ALREADY_EXISTS" in str(on_b.exception)
            assert "loaded for model 'a'" in str(on_b.exception)
        assert list(await engine_adapters(engines[2])) == []
        unknown = await cli("lora", "load", "y", x, "--id", "2", "--model", "c", *t)
        assert unknown.exit_code != 0 and "NOT_FOUND" in str(unknown.exception)
        with_engine = await cli(
            "lora", "load", "y", x, "--id", "2", "--model", "a", "--engine", "b0", *t
        )
        assert with_engine.exit_code != 0 and "INVALID_ARGUMENT" in str(with_engine.exception)
        assert "engine b0 does not serve model 'a'" in str(with_engine.exception)
    finally:
        await close_fleet(fleet)


async def test_an_adapter_loaded_on_one_engine_is_held_for_that_engines_model(
    tmp_path: Path,
) -> None:
    """`x` loaded on `a0` alone (`lora load --engine a0`) is `a`'s: loading it for `b`, on
    the fleet or on `b0`, is refused ALREADY_EXISTS, as it is once loaded on the fleet for
    `a` (both went through: `x`, trained for `a`, attached to `b0`); for `a` it loads."""
    engines = await lora_engines_of_two_models()
    fleet = await make_fleet(engines=engines)
    try:
        t = ["--target", fleet.target]
        x = str(write_adapter_config(tmp_path / "x"))
        on_a0 = await cli("lora", "load", "x", x, "--id", "1", "--engine", "a0", *t)
        assert on_a0.exit_code == 0, on_a0.output
        for where in (["--model", "b"], ["--engine", "b0"]):
            refused = await cli("lora", "load", "x", x, "--id", "1", *where, *t)
            assert refused.exit_code != 0, (where, refused.output)
            assert "ALREADY_EXISTS" in str(refused.exception), where
            assert "loaded for model 'a'" in str(refused.exception), where
        assert [list(await engine_adapters(e)) for e in engines] == [["x"], [], []]
        for_a = await cli("lora", "load", "x", x, "--id", "1", "--model", "a", *t)
        assert for_a.exit_code == 0, for_a.output
        assert [list(await engine_adapters(e)) for e in engines] == [["x"], ["x"], []]
    finally:
        await close_fleet(fleet)


async def test_match_for_a_model_with_no_routable_engine_uses_its_block_size(
    two_models: Fleet,
) -> None:
    """`b0`, the only engine of `b` (blocks of 32), drained: admin `match` for `b` showed
    the prompt in blocks of 16 (the config's default, as no engine was left to route to);
    it shows them as `b0` caches them, and `b0` itself, out of routing: draining."""
    fleet = two_models
    b0 = fleet.address(fleet.engines[2])
    query = apb.PromptQuery(token_ids=pb.TokenIds(ids=PROMPT), model="b")
    before = await fleet.admin.Match(query)
    assert (before.block_size, before.num_blocks) == (32, 2)
    events = [e async for e in fleet.admin.DrainEngine(apb.DrainEngineRequest(engine=b0))]
    assert events[-1].state == pb.DRAIN_STATE_COMPLETE
    drained = await fleet.admin.Match(query)
    assert (drained.block_size, drained.num_blocks) == (32, 2)
    assert [(m.instance_id, m.out_of_routing) for m in drained.matches] == [("b0", "draining")]


async def test_the_fleets_kv_load_is_not_summed_across_block_sizes(two_models: Fleet) -> None:
    """GetLoad summed the KV blocks of `a`'s engines (16 tokens each) and `b0`'s (32) into
    one count of nothing: the fleet's block counts are absent, its KV in tokens is in the
    attributes, with the block sizes, and each engine's detail names its own."""
    fleet = two_models
    await fleet.wait_routable(3)
    load = await fleet.gateway.GetLoad(pb.GetLoadRequest())
    assert not load.HasField("used_kv_blocks") and not load.HasField("total_kv_blocks")
    assert load.attributes["kv_block_size"] == "16,32"
    assert load.attributes["total_kv_tokens"] == str(256 * 16 * 2 + 256 * 32)
    assert load.attributes["used_kv_tokens"] == "0"
    b0 = fleet.address(fleet.engines[2])
    assert "kv=0/256 block_size=32" in load.attributes[f"engine.{b0}"]
    # One model's engines alike: their blocks add up, as before.
    a0 = fleet.address(fleet.engines[0])
    await fleet.admin.RemoveEngine(apb.EngineRef(engine=b0))
    load = await fleet.gateway.GetLoad(pb.GetLoadRequest())
    assert (load.used_kv_blocks, load.total_kv_blocks) == (0, 512)
    assert load.attributes["kv_block_size"] == "16"
    assert "block_size=16" in load.attributes[f"engine.{a0}"]


async def test_a_fronted_fleet_of_two_block_sizes_counts_in_the_upper_fleets_kv() -> None:
    """An upper controller fronting a lower one whose engines of `a` cache in blocks of 16
    and 32 (its GetLoad tells its KV in tokens only), and an engine of its own: the upper's
    KV in tokens left the fronted fleet out, as if it had no KV. It counts, its block sizes
    are the upper's too, and the upper's block counts are absent."""
    lower = await make_fleet(
        engines=[
            await start_sim_engine("a0", served_model_name="a"),
            await start_sim_engine("a1", served_model_name="a", block_size=32),
        ]
    )
    upper: Fleet = await make_fleet(engines=[await start_sim_engine("u0", served_model_name="a")])
    try:
        await lower.wait_routable(2)
        await front(upper, lower, 2)
        fronted = 256 * 16 + 256 * 32
        total = str(256 * 16 + fronted)

        async def counted() -> bool:
            load = await upper.gateway.GetLoad(pb.GetLoadRequest())
            return load.attributes.get("total_kv_tokens") == total

        await eventually(counted, 15, f"total_kv_tokens {total}")
        load = await upper.gateway.GetLoad(pb.GetLoadRequest())
        assert not load.HasField("used_kv_blocks") and not load.HasField("total_kv_blocks")
        assert load.attributes["used_kv_tokens"] == "0"
        assert load.attributes["kv_block_size"] == "16,32"
        detail = load.attributes[f"engine.{lower.target}"]
        assert f"kv=?/? kv_tokens=0/{fronted} block_size=16,32" in detail, detail
    finally:
        await close_fleet(upper)
        await close_fleet(lower)


def models_of(record: EngineRecord) -> tuple[str, ...]:
    return () if record.identity is None else record.identity.models


@contextlib.asynccontextmanager
async def fronting_a_fleet_of_a(
    b0: ServedEngine,
) -> AsyncIterator[tuple[Fleet, Fleet, EngineRecord]]:
    """An upper controller (no engine of its own) fronting a lower one with an engine of
    `a`, and the upper's record of the lower; `b0` (an engine of `b`, not registered) is
    closed with them."""
    lower = await make_fleet(engines=[await start_sim_engine("a0", served_model_name="a")])
    upper: Fleet = await make_fleet(engines=[])
    try:
        await lower.wait_routable(1)
        await front(upper, lower, 1)
        yield upper, lower, upper.app.controller.fleet.registry.get(lower.target)
    finally:
        await b0.close()
        await close_fleet(upper)
        await close_fleet(lower)


async def served_when_read(upper: Fleet, record: EngineRecord, model: str, request_id: str) -> None:
    """Once the upper has read `model` among the lower's models (`record`), it serves it."""
    await upper.app.controller.fleet.wait_for(
        lambda: record.routable and model in models_of(record), 15
    )
    reply, route = await generate_routed(upper, request_for(model, request_id))
    assert reply[-1].WhichOneof("event") == "finished"
    assert route is not None and route["engine"] == record.address


async def test_an_upper_controller_follows_the_models_its_fronted_fleet_gains_and_loses() -> None:
    """An upper controller fronting a lower one (an engine of `a`): an engine of `b` joins
    the lower fleet, and the upper, which read the lower's models at first contact only,
    refused a request for `b` (NOT_FOUND) for as long as the lower controller ran. The
    lower's GetLoad tells its fleet view (`kvplane-fleet-view`), and the upper reads its
    models again when that moves: it routes `b` there, and once the last engine of `b` left
    the lower fleet refuses `b` itself, the lower controller never taken for restarted."""
    b0 = await start_sim_engine("b0", served_model_name="b")
    b0_address = f"127.0.0.1:{b0.port}"
    async with fronting_a_fleet_of_a(b0) as (upper, lower, record):
        epoch = record.epoch
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await generate_routed(upper, request_for("b", "before"))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

        await lower.admin.RegisterEngine(
            apb.RegisterEngineRequest(address=b0_address, kv_events="none")
        )
        await served_when_read(upper, record, "b", "joined")

        await lower.admin.RemoveEngine(apb.EngineRef(engine=b0_address))
        await upper.app.controller.fleet.wait_for(lambda: models_of(record) == ("a",), 15)
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await generate_routed(upper, request_for("b", "left"))
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
        assert "'b'" in (gone.value.details() or "")
        await served_when_read(upper, record, "a", "still")
        # The same process throughout: no index entries or accounting dropped, no flap.
        assert record.epoch == epoch and record.num_flaps == 0


async def test_a_fronted_controller_whose_models_changed_as_a_poll_failed_is_the_same_process() -> (
    None
):
    """The upper controller's poll of the lower one fails (CANCELLED, through a proxy) while
    an engine of `b` joins the lower fleet: the identity read after the failure shows
    another model list under the same instance id, which for an engine would be a new
    process, but a controller's identity moves with its fleet: the same process (no index
    entries or accounting dropped), `b` served there."""
    b0 = await start_sim_engine("b0", served_model_name="b")
    lower = await make_fleet(engines=[await start_sim_engine("a0", served_model_name="a")])
    upper: Fleet = await make_fleet(engines=[])
    try:
        async with served_in_front_of(lower.target, CancelsAPoll) as (proxy, address):
            await upper.admin.RegisterEngine(
                apb.RegisterEngineRequest(address=address, kv_events="none")
            )
            await upper.wait_routable(1)
            record = upper.app.controller.fleet.registry.get(address)
            epoch = record.epoch

            async def b_joins() -> None:
                await lower.admin.RegisterEngine(
                    apb.RegisterEngineRequest(address=f"127.0.0.1:{b0.port}", kv_events="none")
                )
                await lower.wait_routable(2)

            proxy.then = b_joins
            await served_when_read(upper, record, "b", "joined")
            assert record.epoch == epoch
    finally:
        await b0.close()
        await close_fleet(upper)
        await close_fleet(lower)


async def test_a_model_joining_a_fronted_fleet_not_ready_yet_leaves_the_upper_routing_as_it_was(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An engine of `b` joins the lower fleet saying NOT_READY: the lower controller lists
    `b` but cannot answer GetModelInfo for it (UNAVAILABLE). The upper, reading the lower's
    models again as its fleet view moved, keeps its old ones meanwhile (it routes `a` there
    as before, the lower not taken for unreachable) and takes `b` in once it can be read."""
    b0 = await start_fronted_engine("b0", SaysHealth, served_model_name="b")
    b0.servicer.state = pb.HEALTH_STATE_NOT_READY
    async with fronting_a_fleet_of_a(b0) as (upper, lower, record):
        epoch = record.epoch
        await lower.admin.RegisterEngine(
            apb.RegisterEngineRequest(address=f"127.0.0.1:{b0.port}", kv_events="none")
        )
        await eventually(
            lambda: "changed its fleet view, which could not be read" in caplog.text,
            15,
            "the upper failing to read the lower's models while b0 is not ready",
        )
        assert record.routable and models_of(record) == ("a",)
        await served_when_read(upper, record, "a", "meanwhile")

        b0.servicer.state = None  # the sim engine's own answer: READY
        await served_when_read(upper, record, "b", "ready")
        assert record.epoch == epoch and record.num_flaps == 0


async def test_admin_workers_shows_each_engines_models(two_models: Fleet) -> None:
    """The table had no MODELS column (only the JSON named them): which engine serves `b`
    was not to be seen. Many models are shown as fit, the rest counted."""
    from kvplane.cli_common import models_cell

    fleet = two_models
    await fleet.wait_routable(3)
    table = await cli("workers", "--target", fleet.target)
    assert table.exit_code == 0, table.output
    _, header, *rows = table.stdout.splitlines()
    assert header.split()[3] == "MODELS"
    assert sorted(row.split()[:1] + row.split()[3:4] for row in rows) == [
        ["a0", "a"],
        ["a1", "a"],
        ["b0", "b"],
    ]
    many = [f"model-{i:02}" for i in range(8)]
    assert models_cell(many) == "model-00,model-01,model-02,model-03,+4"
    assert models_cell(["x" * 50, "y"]) == "x" * 50 + ",+1"


async def test_a_load_for_one_model_reaches_that_models_engines_behind_a_fronted_controller(
    tmp_path: Path,
) -> None:
    """An upper controller fronting a lower one (engines of `a` and `b`): the upper's fleet
    serves both, so a load naming no model is refused there too; `--model a` is passed on,
    and the lower controller loads it on its engine of `a` only."""
    lora = LoraConfig(enabled=True)
    engines = [
        await start_sim_engine("a0", served_model_name="a", lora=lora),
        await start_sim_engine("b0", served_model_name="b", lora=lora),
    ]
    lower = await make_fleet(engines=engines)
    upper: Fleet = await make_fleet(engines=[])
    try:
        await front(upper, lower, 1)
        x = str(write_adapter_config(tmp_path / "x"))
        t = ["--target", upper.target]
        refused = await cli("lora", "load", "x", x, "--id", "1", *t)
        assert refused.exit_code != 0 and "(a, b)" in str(refused.exception)
        loaded = await cli("lora", "load", "x", x, "--id", "1", "--model", "a", *t)
        assert loaded.exit_code == 0, loaded.output
        assert [list(await engine_adapters(e)) for e in engines] == [["x"], []]
    finally:
        await close_fleet(upper)
        await close_fleet(lower)


async def test_a_restarted_controller_takes_an_adapter_back_for_the_model_that_holds_it(
    tmp_path: Path,
) -> None:
    """`x` loaded for `a` (`--model a`) on `a0` and `a1`, not on `b0`; a new controller in
    front of them (the old one killed) took it for `a0`'s and `a1`'s own, as `b0` was read
    without it, so an engine of `a` registered later was not given it. It is `a`'s again:
    the `a` engine registered later gets it, the `b` one does not."""
    lora = LoraConfig(enabled=True)
    engines = [
        await start_sim_engine("a0", served_model_name="a", lora=lora),
        await start_sim_engine("a1", served_model_name="a", lora=lora),
        await start_sim_engine("b0", served_model_name="b", block_size=32, lora=lora),
    ]
    x = pb.LoraAdapter(
        lora_id=1, lora_name="x", source_path=str(write_adapter_config(tmp_path / "x"))
    )
    for engine in engines[:2]:
        await load_on(engine, x)
    fleet = await make_fleet(engines=engines)
    try:
        await fleet.wait_routable(3)
        joined = [
            await start_sim_engine("a2", served_model_name="a", lora=lora),
            await start_sim_engine("b1", served_model_name="b", block_size=32, lora=lora),
        ]
        fleet.engines.extend(joined)
        for engine in joined:
            address = fleet.address(engine)
            await fleet.admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
        await fleet.wait_routable(5)  # each restored before it is routed to
        assert [list(await engine_adapters(e)) for e in joined] == [["x"], []]
        assert fleet.app.controller.fleet.lora_intent.models == {"x": "a"}
    finally:
        await close_fleet(fleet)


async def test_a_restarted_controller_finding_an_adapter_on_two_models_refuses_loads_of_it(
    tmp_path: Path,
) -> None:
    """`x` held by `a0`, `a1` (of `a`) and `b0` (of `b`), as engines loaded directly: a new
    controller in front of them took it for the fleet's, for the model of the engine it read
    first, forgetting the others' (a load of it for that model went through, `b0` kept an
    adapter held for `a`, or `a0` and `a1` one held for `b`). A load of it for either model
    is ALREADY_EXISTS until it is unloaded from one model's engines."""
    engines = await lora_engines_of_two_models()
    x = pb.LoraAdapter(
        lora_id=1, lora_name="x", source_path=str(write_adapter_config(tmp_path / "x"))
    )
    for engine in engines:
        await load_on(engine, x)
    fleet = await make_fleet(engines=engines)
    try:
        await fleet.wait_routable(3)
        t = ["--target", fleet.target]
        for model in "ab":
            refused = await cli(
                "lora", "load", "x", x.source_path, "--id", "1", "--model", model, *t
            )
            assert refused.exit_code != 0, (model, refused.output)
            assert "ALREADY_EXISTS" in str(refused.exception), model
            assert f"loaded for model '{'ba'[model == 'b']}'" in str(refused.exception), model
        unloaded = await cli("lora", "unload", "x", "--engine", "b0", *t)
        assert unloaded.exit_code == 0, unloaded.output
        for_a = await cli("lora", "load", "x", x.source_path, "--id", "1", "--model", "a", *t)
        assert for_a.exit_code == 0, for_a.output
        assert [list(await engine_adapters(e)) for e in engines] == [["x"], ["x"], []]
        assert fleet.app.controller.fleet.lora_intent.models == {"x": "a"}
    finally:
        await close_fleet(fleet)


@contextlib.asynccontextmanager
async def fronted_beside_a9(
    lower_engines: list[EngineApp],
) -> AsyncIterator[tuple[Fleet, Fleet, EngineApp]]:
    """An upper controller with an engine of `a` of its own (`a9`, taking LoRA adapters)
    fronting a lower one of `lower_engines`, both routed; closed with them."""
    lower = await make_fleet(engines=lower_engines)
    own = await start_sim_engine("a9", served_model_name="a", lora=LoraConfig(enabled=True))
    upper: Fleet = await make_fleet(engines=[own])
    try:
        await front(upper, lower, 2)
        yield upper, lower, own
    finally:
        await close_fleet(upper)
        await close_fleet(lower)


async def test_one_fronted_controller_is_given_an_adapter_for_one_of_its_models(
    tmp_path: Path,
) -> None:
    """An upper controller fronting a lower one (engines of `a` and `b`) and an engine of
    `a` of its own: `lora load --engine LOWER --model a` loads it on the lower controller's
    engine of `a` only, and not on the upper's own engine. It was refused either way: the
    model not taken with an engine named, and without it the lower controller, whose
    engines serve two base models, refused a load naming none."""
    lora = LoraConfig(enabled=True)
    engines = [
        await start_sim_engine("a0", served_model_name="a", lora=lora),
        await start_sim_engine("b0", served_model_name="b", lora=lora),
    ]
    async with fronted_beside_a9(engines) as (upper, lower, own):
        x = str(write_adapter_config(tmp_path / "x"))
        t = ["--target", upper.target]
        unnamed = await cli("lora", "load", "x", x, "--id", "1", "--engine", lower.target, *t)
        assert unnamed.exit_code != 0 and "(a, b)" in str(unnamed.exception)
        loaded = await cli(
            "lora", "load", "x", x, "--id", "1", "--engine", lower.target, "--model", "a", *t
        )
        assert loaded.exit_code == 0, loaded.output
        assert [list(await engine_adapters(e)) for e in [*engines, own]] == [["x"], [], []]
        intent = upper.app.controller.fleet.lora_intent
        assert intent.model_of("x", lower.target) == "a"  # named again when restored there


async def test_a_load_naming_no_model_on_a_fronted_controller_is_checked_against_the_held_model(
    tmp_path: Path,
) -> None:
    """`x` loaded on the upper controller's own engine of `a` (`--engine a9`) is `a`'s: a load
    of it on the lower controller it fronts (engine `b0` of `b`) naming no model went through
    unchecked, and the lower controller loaded it for its one model, `b`. It is refused, and
    says to name the model; named, it is checked as any load (the lower serves no `a`)."""
    b0 = await start_sim_engine("b0", served_model_name="b", lora=LoraConfig(enabled=True))
    async with fronted_beside_a9([b0]) as (upper, lower, own):
        x = str(write_adapter_config(tmp_path / "x"))
        t = ["--target", upper.target]
        a9 = upper.address(own)
        on_a9 = await cli("lora", "load", "x", x, "--id", "1", "--engine", a9, *t)
        assert on_a9.exit_code == 0, on_a9.output
        unnamed = await cli("lora", "load", "x", x, "--id", "1", "--engine", lower.target, *t)
        assert unnamed.exit_code != 0, unnamed.output
        assert "INVALID_ARGUMENT" in str(unnamed.exception)
        assert "loaded for model 'a'" in str(unnamed.exception)
        assert "--model a" in str(unnamed.exception)
        named = await cli(
            "lora", "load", "x", x, "--id", "1", "--engine", lower.target, "--model", "a", *t
        )
        assert named.exit_code != 0 and "does not serve model 'a'" in str(named.exception)
        assert [list(await engine_adapters(e)) for e in [own, b0]] == [["x"], []]


async def test_an_adapter_of_no_known_model_reaches_a_fronted_controller_once_named(
    tmp_path: Path,
) -> None:
    """An upper controller found `x` on the one controller it fronts (engines of `a` and
    `b`): fleet-wide, of no known model. A second such controller registered is not given
    it (it refuses a load naming no model, and no rule tells `a` from `b`: a documented
    limit); `lora load --model a` of the same adapter names its model, and it reaches the
    second controller's engine of `a`."""
    lora = LoraConfig(enabled=True)
    first = [
        await start_sim_engine("a0", served_model_name="a", lora=lora),
        await start_sim_engine("b0", served_model_name="b", lora=lora),
    ]
    second = [
        await start_sim_engine("a1", served_model_name="a", lora=lora),
        await start_sim_engine("b1", served_model_name="b", lora=lora),
    ]
    lowers = [await make_fleet(engines=first), await make_fleet(engines=second)]
    upper: Fleet = await make_fleet(engines=[])
    try:
        x = str(write_adapter_config(tmp_path / "x"))
        await lowers[0].wait_routable(2)
        await lowers[1].wait_routable(2)
        loaded = await cli("lora", "load", "x", x, "--id", "1", "--model", "a",
                           "--target", lowers[0].target)  # fmt: skip
        assert loaded.exit_code == 0, loaded.output
        await front(upper, lowers[0], 1)
        intent = upper.app.controller.fleet.lora_intent
        assert list(intent.loads) == [("x", None)] and intent.models == {}
        await front(upper, lowers[1], 2)  # its first poll, with the restore, is done
        assert [await engine_adapters(e) for e in second] == [{}, {}]

        t = ["--target", upper.target]
        named = await cli("lora", "load", "x", x, "--id", "1", "--model", "a", *t)
        assert named.exit_code == 0, named.output
        assert [list(await engine_adapters(e)) for e in [*first, *second]] == [
            ["x"],
            [],
            ["x"],
            [],
        ]
        assert intent.models == {"x": "a"}
    finally:
        await close_fleet(upper)
        for lower in lowers:
            await close_fleet(lower)


async def test_an_upper_controller_follows_the_capacity_an_engine_like_the_others_adds() -> None:
    """An upper controller fronting a lower one with an engine of `a`: a second engine of
    `a` just like it joins the lower fleet, whose GetModelInfo sums the capacity
    (`total_kv_blocks`, `max_running_requests`). The fleet view was a digest of the set of
    distinct engine descriptions, which the twin did not move: the upper kept one engine's
    capacity (and advertised it in its own GetModelInfo) for as long as the lower ran. The
    view now moves with the summed facts: the upper reads them again, on join and leave."""
    a1 = await start_sim_engine("a1", served_model_name="a")
    a1_address = f"127.0.0.1:{a1.port}"
    async with fronting_a_fleet_of_a(a1) as (upper, lower, record):
        one = await lower.gateway.GetModelInfo(pb.GetModelInfoRequest(model="a"))
        fleet = upper.app.controller.fleet

        def capacity() -> tuple[int | None, int | None]:
            facts = record.identity.facts_of("a") if record.identity is not None else None
            return (facts.total_kv_blocks, facts.max_running_requests) if facts else (None, None)

        assert capacity() == (one.total_kv_blocks, one.max_running_requests)
        await lower.admin.RegisterEngine(
            apb.RegisterEngineRequest(address=a1_address, kv_events="none")
        )
        await lower.wait_routable(2)
        two = await lower.gateway.GetModelInfo(pb.GetModelInfoRequest(model="a"))
        summed = (2 * one.total_kv_blocks, 2 * one.max_running_requests)
        assert (two.total_kv_blocks, two.max_running_requests) == summed
        await fleet.wait_for(lambda: capacity() == summed, 15)
        info = await upper.gateway.GetModelInfo(pb.GetModelInfoRequest(model="a"))
        assert (info.total_kv_blocks, info.max_running_requests) == summed

        await lower.admin.RemoveEngine(apb.EngineRef(engine=a1_address))
        alone = (one.total_kv_blocks, one.max_running_requests)
        await fleet.wait_for(lambda: capacity() == alone, 15)
        info = await upper.gateway.GetModelInfo(pb.GetModelInfoRequest(model="a"))
        assert (info.total_kv_blocks, info.max_running_requests) == alone
        assert record.num_flaps == 0


async def test_the_upper_router_counts_a_fronted_fleets_whole_kv_capacity() -> None:
    """A lower controller fronting an engine of `a` and one of `b`: its KV (GetLoad's used
    blocks, the blocks cached there) is both engines', but the upper's router took its
    capacity from GetModelInfo, the default model's (`a`'s engine only), and read the
    lower's cache twice as full as it was. A fronted controller's capacity is its live
    GetLoad sum, which also follows its fleet at every poll."""
    lower = await make_fleet(
        engines=[
            await start_sim_engine("a0", served_model_name="a"),
            await start_sim_engine("b0", served_model_name="b"),
        ]
    )
    upper: Fleet = await make_fleet(engines=[])
    try:
        await lower.wait_routable(2)
        await front(upper, lower, 1)
        fleet = upper.app.controller.fleet
        record = fleet.registry.get(lower.target)
        load = await lower.gateway.GetLoad(pb.GetLoadRequest())
        a_only = await lower.gateway.GetModelInfo(pb.GetModelInfoRequest(model="a"))
        assert load.total_kv_blocks == 2 * a_only.total_kv_blocks
        await fleet.wait_for(lambda: record.load.total_kv_blocks == load.total_kv_blocks, 15)
        assert fleet.candidate(record).capacity_blocks == load.total_kv_blocks
    finally:
        await close_fleet(upper)
        await close_fleet(lower)
