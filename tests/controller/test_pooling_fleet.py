"""A pooling-only engine (`runner: pooling`: a classifier without an LM head) next to a
generating engine, both serving the same model name behind the controller: the controller
learns from GetModelInfo (tasks advertised, no `generation`) that it does not generate, so
every Generate goes to the generating engine, Classify to the pooling engine, and with the
generating engine out of routing a Generate says why ("pooling only") instead of reaching an
engine that would refuse it."""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from controller.fleet_view import FLEET_VIEW_KEY
from controller.registry import EngineRecord
from engine.config import EngineConfig
from engine.server.service import EngineApp, start_engine
from kvplane.tokenize import INLINE_TOKENIZE_MAX_CHARS
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from tests.controller.conftest import Fleet, close_fleet, make_fleet
from tests.controller.test_gateway import engine_answer, record_routes
from tests.controller.test_gateway_scripted import cli
from tests.engine.test_server_pooling import LABELS
from tests.engine.test_server_pooling_runner import write_headless_classifier
from tests.polling import eventually
from tests.redis_servers import free_port

pytestmark = pytest.mark.timeout(120)

MODEL = "builtin"


def engine_config(model: Path, instance_id: str) -> EngineConfig:
    """An engine of `model` (the builtin decoder generates, the headless classifier pools
    only: `write_headless_classifier` writes both) serving it as MODEL."""
    return EngineConfig(
        model=str(model),
        instance_id=instance_id,
        served_model_name=MODEL,
        listen="127.0.0.1:0",
        num_kv_blocks=64,  # the pooling engine ignores it (one block)
        max_num_batched_tokens=128,
        num_threads=1,
        shutdown_grace_s=0.5,
    )


@asynccontextmanager
async def round_robin_fleet(
    engines: list[EngineApp], model: Path, **controller: Any
) -> AsyncIterator[Fleet]:
    """A round-robin controller in front of `engines`, with `model`'s tokenizer (and more
    ControllerConfig fields, `controller`)."""
    fleet = await make_fleet(
        engines=engines,
        router={"policy": "round_robin"},
        tokenizer=str(model / "tokenizer.json"),
        **controller,
    )
    try:
        yield fleet
    finally:
        await close_fleet(fleet)


@pytest.fixture
async def mixed_fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    headless = write_headless_classifier(tmp_path)
    engines = [
        await start_engine(engine_config(tmp_path / "builtin", "gen")),
        await start_engine(engine_config(headless, "pool")),
    ]
    async with round_robin_fleet(engines, headless) as fleet:
        yield fleet


async def test_a_pooling_only_engine_gets_pooling_traffic_only(mixed_fleet: Fleet) -> None:
    chosen = record_routes(mixed_fleet)
    for n in range(6):  # round robin would alternate between two generating engines
        request = pb.GenerateRequest(
            request_id=f"g{n}",
            model=MODEL,
            token_ids=pb.TokenIds(ids=[5 + n, 6, 7]),
            stopping=pb.StoppingOptions(max_tokens=2, ignore_eos=True),
        )
        responses = [r async for r in mixed_fleet.gateway.Generate(request)]
        assert responses[-1].finished.reason == pb.FINISH_REASON_LENGTH
    gen_address = mixed_fleet.address(mixed_fleet.engines[0])
    assert chosen == [gen_address] * 6
    registry = mixed_fleet.app.controller.fleet.registry
    identities = {r.engine_id: r.identity for r in registry.records()}
    assert identities["pool"] is not None and not identities["pool"].generates
    assert identities["pool"].tasks == {"embed", "classify", "score"}
    assert identities["gen"] is not None and identities["gen"].generates
    classified = await mixed_fleet.gateway.Classify(
        pb.ClassifyRequest(
            context=pb.TaskRequestContext(request_id="c", model=MODEL),
            inputs=[pb.TaskInput(item_id="a", token_ids=pb.TokenIds(ids=[5, 6, 7]))],
        )
    )
    assert list(classified.outputs[0].labels) == LABELS
    # The gateway's ModelInfo is a generating engine's (the pooling one's has no generation).
    info = await mixed_fleet.gateway.GetModelInfo(pb.GetModelInfoRequest(model=MODEL))
    assert info.HasField("generation")


async def test_generate_with_only_a_pooling_engine_routable_names_it(mixed_fleet: Fleet) -> None:
    registry = mixed_fleet.app.controller.fleet.registry
    registry.set_cordoned("gen", True)
    request = pb.GenerateRequest(request_id="g", model=MODEL, token_ids=pb.TokenIds(ids=[5, 6, 7]))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        [r async for r in mixed_fleet.gateway.Generate(request)]
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "pool pooling only" in (err.value.details() or "")
    assert "gen cordoned" in (err.value.details() or "")


async def test_generate_where_only_pooling_engines_serve_the_model_is_failed_precondition(
    mixed_fleet: Fleet,
) -> None:
    """Not UNAVAILABLE, which a client would retry: no engine will ever generate there."""
    await mixed_fleet.admin.RemoveEngine(apb.EngineRef(engine="gen"))
    request = pb.GenerateRequest(request_id="g", model=MODEL, token_ids=pb.TokenIds(ids=[5, 6, 7]))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        [r async for r in mixed_fleet.gateway.Generate(request)]
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "pooling-only" in (err.value.details() or "")


@pytest.mark.parametrize("rpc", ["Route", "Match"])
async def test_admin_route_and_match_for_a_pooling_only_model_are_failed_precondition(
    mixed_fleet: Fleet, rpc: str
) -> None:
    """As Generate: a model only pooling-only engines serve is FAILED_PRECONDITION, not
    UNAVAILABLE (Route) or an empty table (Match)."""
    await mixed_fleet.admin.RemoveEngine(apb.EngineRef(engine="gen"))
    query = apb.PromptQuery(model=MODEL, token_ids=pb.TokenIds(ids=[5, 6, 7]))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await getattr(mixed_fleet.admin, rpc)(query)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "pooling-only" in (err.value.details() or "")


async def test_admin_workers_says_which_engine_is_pooling_only(mixed_fleet: Fleet) -> None:
    """`kvplane admin workers`: the pooling engine's role says "pooling only" (it was shown
    as a plain aggregated engine, with a KV of "0/?"), and the JSON has `pooling_only`."""
    result = await cli("workers", "--target", mixed_fleet.target)
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line for line in result.output.splitlines()[2:]}
    assert "aggregated (pooling only)" in rows["pool"] and "0/?" not in rows["pool"]
    assert "pooling only" not in rows["gen"] and "/64" in rows["gen"]
    as_json = await cli("workers", "--target", mixed_fleet.target, "--output", "json")
    pooling = {
        w["instance_id"]: w.get("pooling_only", False)
        for w in json.loads(as_json.output)["workers"]
    }
    assert pooling == {"pool": True, "gen": False}


async def test_admin_workers_against_each_engine_itself_says_the_same(
    mixed_fleet: Fleet,
) -> None:
    """Pointed at an engine rather than the controller, `workers` reads the engine's own
    ModelInfo: the pooling one is "pooling only" with no KV figure, as through the
    controller (it was shown as a plain aggregated engine with a KV of "0/1")."""
    for engine, pooling_only in zip(mixed_fleet.engines, (False, True), strict=True):
        target = f"127.0.0.1:{engine.port}"
        result = await cli("workers", "--target", target)
        assert result.exit_code == 0, result.output
        (row,) = [line for line in result.output.splitlines() if f" {target} " in line]
        assert ("aggregated (pooling only)" in row) is pooling_only
        assert ("0/1" in row) is False and ("/64" in row) is not pooling_only
        as_json = await cli("workers", "--target", target, "--output", "json")
        (worker,) = json.loads(as_json.output)["workers"]
        assert worker["pooling_only"] is pooling_only


async def test_a_drained_controller_refuses_pooling_tasks_too(mixed_fleet: Fleet) -> None:
    """`kvplane admin drain --self`: the controller refuses every new request, Embed,
    Classify and Score as Generate (they were still relayed to the engines)."""
    drain = mixed_fleet.gateway.Drain(pb.DrainRequest(stop_accepting_new_requests=True))
    assert [r.state async for r in drain][-1] == pb.DRAIN_STATE_COMPLETE
    item = pb.TaskInput(item_id="a", token_ids=pb.TokenIds(ids=[5, 6, 7]))
    gateway = mixed_fleet.gateway
    group = pb.ScoreGroup(group_id="g", query=item, candidates=[item])
    for task in ("embed", "classify", "score"):
        task_context = pb.TaskRequestContext(request_id=task, model=MODEL)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            if task == "embed":
                await gateway.Embed(pb.EmbedRequest(context=task_context, inputs=[item]))
            elif task == "classify":
                await gateway.Classify(pb.ClassifyRequest(context=task_context, inputs=[item]))
            else:
                await gateway.Score(pb.ScoreRequest(context=task_context, groups=[group]))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, task
        assert err.value.details() == "the controller is draining"


async def test_abort_of_a_task_that_ended_is_already_finished_as_the_engine_answers(
    mixed_fleet: Fleet,
) -> None:
    """Seed: task request ids share generation's namespace and abort semantics. Once a
    Classify relayed by the gateway has ended, Abort of its id is ALREADY_FINISHED (a
    success) from the gateway as from the engine that ran it, not NOT_FOUND."""
    request = pb.ClassifyRequest(
        context=pb.TaskRequestContext(request_id="done", model=MODEL),
        inputs=[pb.TaskInput(item_id="a", token_ids=pb.TokenIds(ids=[5, 6, 7]))],
    )
    await mixed_fleet.gateway.Classify(request)
    abort = pb.AbortRequest(request_id="done")
    pooling = mixed_fleet.address(mixed_fleet.engines[1])
    expected = await engine_answer(pooling, "Abort", abort)
    assert isinstance(expected, pb.AbortResponse)
    assert expected.status == pb.ABORT_STATUS_ALREADY_FINISHED
    reply = await mixed_fleet.gateway.Abort(abort)
    assert reply.status == pb.ABORT_STATUS_ALREADY_FINISHED


async def test_the_fleets_model_info_advertises_every_task_the_gateway_serves(
    mixed_fleet: Fleet,
) -> None:
    """Seed: a client uses a task only when ModelInfo advertises it. The gateway serves
    Classify for the model (the pooling engine has it), so its ModelInfo says so, with the
    pooling engine's capability, though the generating engine that answers lacks it (it said
    classify unsupported, and a client following the seed never called it)."""
    request = pb.GetModelInfoRequest(model=MODEL)
    generating, pooling = [
        await engine_answer(mixed_fleet.address(e), "GetModelInfo", request)
        for e in mixed_fleet.engines
    ]
    assert isinstance(generating, pb.ModelInfo) and isinstance(pooling, pb.ModelInfo)
    assert not generating.tasks.classify.supported and pooling.tasks.classify.supported
    info = await mixed_fleet.gateway.GetModelInfo(request)
    assert info.tasks.classify == pooling.tasks.classify
    assert info.generation == generating.generation
    assert info.tasks.embed == generating.tasks.embed  # the answering engine's own


async def test_the_fleets_model_info_is_a_generating_engines_or_none(mixed_fleet: Fleet) -> None:
    """With the generating engine out of routing, the pooling-only engine's ModelInfo (no
    `generation`) would say that the model is not generated: GetModelInfo is UNAVAILABLE,
    saying why, and a controller fronting this one reads the model's facts once a generating
    engine answers, and routes its Generates here. It used to answer the pooling engine's,
    and the upper controller, reading it, refused every Generate for the model
    (FAILED_PRECONDITION, "pooling-only") after the generating engine was back."""
    registry = mixed_fleet.app.controller.fleet.registry
    registry.set_cordoned("gen", True)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await mixed_fleet.gateway.GetModelInfo(pb.GetModelInfoRequest(model=MODEL))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # Each engine with its state, in the order they registered in (the fixture's: either).
    states = (err.value.details() or "").split(": ", 1)[-1]
    assert sorted(states.split(", ")) == ["gen cordoned", "pool pooling only"], states
    upper = await make_fleet(0)
    try:
        await upper.admin.RegisterEngine(
            apb.RegisterEngineRequest(address=mixed_fleet.target, kv_events="none")
        )
        lower = upper.app.controller.fleet.registry.get(mixed_fleet.target)
        # The upper has read the model's facts, or been told they cannot be read now.
        await eventually(lambda: lower.identity is not None or "can answer now" in lower.last_error)
        registry.set_cordoned("gen", False)
        await upper.wait_routable(1)
        request = pb.GenerateRequest(
            request_id="via-upper",
            model=MODEL,
            token_ids=pb.TokenIds(ids=[5, 6, 7]),
            stopping=pb.StoppingOptions(max_tokens=2, ignore_eos=True),
        )
        responses = [r async for r in upper.gateway.Generate(request)]
        assert responses[-1].finished.reason == pb.FINISH_REASON_LENGTH
    finally:
        await close_fleet(upper)


async def test_vllm_generate_is_not_serving_while_only_pooling_engines_are_routable(
    tmp_path: Path,
) -> None:
    """`grpc.health.v1` for the controller's `vllm.Generate` (what a load balancer in front
    of the vLLM front end reads) judges the engines that can take a Generate: a fleet whose
    only routable engine is pooling-only is NOT_SERVING there, every vllm.Generate would be
    refused, while OpenEngine Health stays READY (that engine serves Embed, Classify and
    Score); a generating engine registered turns it SERVING."""
    headless = write_headless_classifier(tmp_path)
    fleet = await make_fleet(engines=[await start_engine(engine_config(headless, "pool"))])
    try:
        health = await fleet.gateway.Health(pb.HealthRequest())
        assert health.state == pb.HEALTH_STATE_READY
        watch = health_pb2_grpc.HealthStub(fleet.channel).Watch(
            health_pb2.HealthCheckRequest(service="vllm.Generate")
        )
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING

        generating = await start_engine(engine_config(tmp_path / "builtin", "gen"))
        fleet.engines.append(generating)  # closed with the fleet
        await fleet.admin.RegisterEngine(
            apb.RegisterEngineRequest(address=fleet.address(generating))
        )
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        health = await fleet.gateway.Health(pb.HealthRequest())
        assert health.state == pb.HEALTH_STATE_READY
    finally:
        await close_fleet(fleet)


async def _classified_through(upper: Fleet) -> None:
    """A Classify of MODEL through the controller `upper` fronting the lower fleet is served."""
    classified = await upper.gateway.Classify(
        pb.ClassifyRequest(
            context=pb.TaskRequestContext(request_id="via-upper", model=MODEL),
            inputs=[pb.TaskInput(item_id="a", token_ids=pb.TokenIds(ids=[5, 6, 7]))],
        )
    )
    assert list(classified.outputs[0].labels) == LABELS


async def test_a_pooling_model_is_read_through_a_fronted_fleet_with_an_engine_never_reached(
    tmp_path: Path,
) -> None:
    """A lower controller with a pooling-only engine of MODEL and a second engine registered
    that never answered (its models unknown: it may serve any). GetModelInfo counted that
    engine as one that may generate MODEL and so asked only generating engines: none is
    routable, and it was UNAVAILABLE for as long as the engine stayed away ("pool pooling
    only, 127.0.0.1:P unreachable"); a controller fronting the lower one could not read its
    identity and never routed there. Whether a model is generated is the read engines' to
    say (`fleet_facts`: the fleet view moves when one that generates it is read)."""
    headless = write_headless_classifier(tmp_path)
    lower = await make_fleet(engines=[await start_engine(engine_config(headless, "pool"))])
    upper = await make_fleet(0)
    try:
        await lower.admin.RegisterEngine(
            apb.RegisterEngineRequest(address=f"127.0.0.1:{free_port()}", kv_events="none")
        )
        info = await lower.gateway.GetModelInfo(pb.GetModelInfoRequest(model=MODEL))
        assert not info.HasField("generation") and info.tasks.classify.supported
        await upper.admin.RegisterEngine(
            apb.RegisterEngineRequest(address=lower.target, kv_events="none")
        )
        await upper.wait_routable(1)
        await _classified_through(upper)
    finally:
        await close_fleet(upper)
        await close_fleet(lower)


async def test_a_fronted_fleets_model_info_keeps_a_task_whose_engine_is_out_of_routing(
    mixed_fleet: Fleet,
) -> None:
    """The lower fleet's GetModelInfo advertised a pooling task only where an engine with it
    was routable, while its fleet view (which a controller fronting it re-reads the model's
    facts on) counts every read engine, routable or not: the pooling engine cordoned when the
    upper read the lower's identity, the upper never learnt of Classify, and refused it after
    the engine was back, for as long as the lower fleet ran. The answer holds the tasks of
    every read engine, as the view does."""
    pool = "pool"  # its instance id
    request = pb.GetModelInfoRequest(model=MODEL)
    view_before = (await mixed_fleet.gateway.GetLoad(pb.GetLoadRequest())).attributes
    await mixed_fleet.admin.Cordon(apb.EngineRef(engine=pool))
    view_after = (await mixed_fleet.gateway.GetLoad(pb.GetLoadRequest())).attributes
    assert view_after[FLEET_VIEW_KEY] == view_before[FLEET_VIEW_KEY]  # no re-read upstairs
    info = await mixed_fleet.gateway.GetModelInfo(request)
    assert info.tasks.classify.supported
    upper = await make_fleet(0)
    try:
        await upper.admin.RegisterEngine(
            apb.RegisterEngineRequest(address=mixed_fleet.target, kv_events="none")
        )
        await upper.wait_routable(1)
        await mixed_fleet.admin.Uncordon(apb.EngineRef(engine=pool))
        await mixed_fleet.wait_routable(2)
        await _classified_through(upper)
    finally:
        await close_fleet(upper)


SHORT_INPUT, LONG_INPUT = 32, 128  # the two pooling engines' max_model_len


@pytest.fixture
async def short_and_long(tmp_path: Path) -> AsyncIterator[Fleet]:
    """Two pooling-only engines of one model, one taking inputs of up to SHORT_INPUT tokens,
    the other LONG_INPUT, behind a round-robin controller with their tokenizer."""
    async with short_and_long_fleet(tmp_path) as fleet:
        yield fleet


@pytest.fixture
async def short_and_long_untokenised(tmp_path: Path) -> AsyncIterator[Fleet]:
    """`short_and_long`, behind a controller that tokenises no text of more than 10
    characters (`tokenize_max_chars`): it cannot tell such an input's length."""
    async with short_and_long_fleet(tmp_path, tokenize_max_chars=10) as fleet:
        yield fleet


@asynccontextmanager
async def short_and_long_fleet(
    tmp_path: Path,
    lengths: Sequence[tuple[str, int]] = (("short", SHORT_INPUT), ("long", LONG_INPUT)),
    **controller: Any,
) -> AsyncIterator[Fleet]:
    """A pooling-only engine of each (name, max_model_len) of `lengths`, listed (by address)
    in that order: the first, the short one, is what routing by load alone picks among idle
    engines."""
    headless = write_headless_classifier(tmp_path)
    ports = sorted((free_port() for _ in lengths), key=lambda port: f"127.0.0.1:{port}")
    engines = [
        await start_engine(
            engine_config(headless, name).model_copy(
                update={
                    "listen": f"127.0.0.1:{port}",
                    "max_model_len": length,
                    "max_num_batched_tokens": LONG_INPUT,
                }
            )
        )
        for (name, length), port in zip(lengths, ports, strict=True)
    ]
    async with round_robin_fleet(engines, headless, **controller) as fleet:
        yield fleet


def _tokens(n: int) -> pb.TaskInput:
    return pb.TaskInput(item_id=f"t{n}", token_ids=pb.TokenIds(ids=[5 + i % 50 for i in range(n)]))


async def test_a_pooling_input_goes_to_the_engine_whose_context_takes_it(
    short_and_long: Fleet,
) -> None:
    """An input of 64 tokens, which the short engine refuses (INVALID_ARGUMENT), goes to the
    long engine and is served, in an Embed, a Classify and a Score alike (pooling tasks used
    to be routed by load alone: to the short engine, the least loaded first)."""
    gateway = short_and_long.gateway
    for n in range(2):
        context = pb.TaskRequestContext(request_id=f"e{n}", model=MODEL)
        embedded = await gateway.Embed(pb.EmbedRequest(context=context, inputs=[_tokens(64)]))
        assert len(embedded.outputs) == 1
        context = pb.TaskRequestContext(request_id=f"c{n}", model=MODEL)
        classified = await gateway.Classify(
            pb.ClassifyRequest(context=context, inputs=[_tokens(3), _tokens(64)])
        )
        assert len(classified.outputs) == 2
        context = pb.TaskRequestContext(request_id=f"s{n}", model=MODEL)
        group = pb.ScoreGroup(group_id="g", query=_tokens(4), candidates=[_tokens(64)])
        scored = await gateway.Score(pb.ScoreRequest(context=context, groups=[group]))
        assert len(scored.groups) == 1


async def test_a_pooling_input_past_every_engines_context_is_refused_naming_the_largest(
    short_and_long: Fleet,
) -> None:
    """Refused by the gateway, INVALID_ARGUMENT (as an engine refuses it), naming the
    largest context; GetModelInfo advertises that largest (what routing now honours; it
    used to advertise the smallest)."""
    context = pb.TaskRequestContext(request_id="huge", model=MODEL)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await short_and_long.gateway.Embed(
            pb.EmbedRequest(context=context, inputs=[_tokens(LONG_INPUT + 1)])
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = caught.value.details() or ""
    assert f"has {LONG_INPUT + 1} tokens" in details, details
    assert f"max_context_length any engine serving model {MODEL!r} with embed takes is " \
        f"{LONG_INPUT}" in details, details  # fmt: skip
    info = await short_and_long.gateway.GetModelInfo(pb.GetModelInfoRequest(model=MODEL))
    assert info.max_context_length == LONG_INPUT


async def test_a_text_input_the_short_engine_refuses_unmeasured_goes_to_the_long_one(
    short_and_long_untokenised: Fleet,
) -> None:
    """A text input of more than SHORT_INPUT tokens that the controller does not tokenise:
    the short engine (first by address, chosen among idle engines) refuses it
    (INVALID_ARGUMENT), and it goes to the long engine and is served, in an Embed, a
    Classify and a Score alike, as a Generate's text prompt does; one past both engines
    ends with the long engine's refusal; with the long engine cordoned, UNAVAILABLE naming
    the refusal and both engines. Before, the short engine's refusal was the answer, though
    the long engine would have served it."""
    fleet = short_and_long_untokenised
    gateway = fleet.gateway
    long_text = pb.TaskInput(item_id="long", text="hello " * 12)  # past SHORT_INPUT tokens
    for n in range(2):
        context = pb.TaskRequestContext(request_id=f"e{n}", model=MODEL)
        embedded = await gateway.Embed(pb.EmbedRequest(context=context, inputs=[long_text]))
        assert len(embedded.outputs) == 1
        context = pb.TaskRequestContext(request_id=f"c{n}", model=MODEL)
        classified = await gateway.Classify(
            pb.ClassifyRequest(context=context, inputs=[_tokens(3), long_text])
        )
        assert len(classified.outputs) == 2
        context = pb.TaskRequestContext(request_id=f"s{n}", model=MODEL)
        group = pb.ScoreGroup(group_id="g", query=_tokens(4), candidates=[long_text])
        scored = await gateway.Score(pb.ScoreRequest(context=context, groups=[group]))
        assert len(scored.groups) == 1
    huge = pb.TaskInput(item_id="huge", text="hello " * 60)
    context = pb.TaskRequestContext(request_id="huge", model=MODEL)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await gateway.Embed(pb.EmbedRequest(context=context, inputs=[huge]))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    assert f"more than max_model_len {LONG_INPUT}" in (caught.value.details() or "")

    short, long = (fleet.address(e) for e in fleet.engines)
    fleet.app.controller.fleet.registry.set_cordoned(long, True)
    context = pb.TaskRequestContext(request_id="cordoned", model=MODEL)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await gateway.Embed(pb.EmbedRequest(context=context, inputs=[long_text]))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
    details = caught.value.details() or ""
    assert details.startswith(f"engine {short} refused the request (INVALID_ARGUMENT: "), details
    assert details.endswith(
        "maybe for its length; no embed engine takes traffic now: short "
        f"max_context_length {SHORT_INPUT} < {SHORT_INPUT + 1}, long cordoned"
    ), details


async def test_a_batch_of_short_texts_is_tokenised_off_the_event_loop(
    short_and_long: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many text inputs, each within the inline limit but long together, are tokenised by
    the gateway in a worker thread, as one long prompt is (they used to be tokenised one by
    one on the event loop, stalling every other request meanwhile); the longest, past the
    short engine's context, goes to the long engine."""
    tokenizers = short_and_long.app.controller._tokenizers
    encode, threads = tokenizers.encode, set()

    def recording(prompt: str, model: str) -> list[int] | None:
        threads.add(threading.current_thread())
        return encode(prompt, model)

    monkeypatch.setattr(tokenizers, "encode", recording)  # which thread: instrumentation only
    short, long = "hello world", "hello " * 12
    assert SHORT_INPUT < len(encode(long, MODEL) or ()) <= LONG_INPUT
    texts = [short] * (INLINE_TOKENIZE_MAX_CHARS // len(short)) + [long]
    assert all(len(text) <= INLINE_TOKENIZE_MAX_CHARS for text in texts)
    inputs = [pb.TaskInput(item_id=f"t{i}", text=text) for i, text in enumerate(texts)]
    for n in range(2):
        context = pb.TaskRequestContext(request_id=f"e{n}", model=MODEL)
        embedded = await short_and_long.gateway.Embed(
            pb.EmbedRequest(context=context, inputs=inputs)
        )
        assert len(embedded.outputs) == len(texts)
    assert threads and threading.current_thread() not in threads, threads


async def test_a_pooling_request_costs_no_scan_of_the_engines_while_they_are_alike(
    mixed_fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the engines with a task take inputs alike (one here), whether a request's inputs
    are read is kept until the registry changes: a Classify scans no engine list (each used
    to scan every engine, the per-request cost routing keeps off its path at hundreds of
    engines)."""
    registry = mixed_fleet.app.controller.fleet.registry
    records, scans = registry.records, []

    def counting() -> list[EngineRecord]:
        scans.append(1)
        return records()

    async def classify(request_id: str) -> None:
        classified = await mixed_fleet.gateway.Classify(
            pb.ClassifyRequest(
                context=pb.TaskRequestContext(request_id=request_id, model=MODEL),
                inputs=[pb.TaskInput(item_id="a", token_ids=pb.TokenIds(ids=[5, 6, 7]))],
            )
        )
        assert list(classified.outputs[0].labels) == LABELS

    await classify("first")
    monkeypatch.setattr(registry, "records", counting)  # how many scans: instrumentation only
    version = registry.version
    for n in range(10):
        await classify(f"c{n}")
    # (At most one scan after each change of the fleet meanwhile, if any.)
    assert len(scans) <= registry.version - version, (len(scans), registry.version - version)
