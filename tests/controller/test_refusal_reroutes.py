"""One rule for every path through the gateway (Generate, vllm.Generate, Embed / Classify /
Score): an engine REFUSING what it cannot serve (a prompt or pooling input the gateway did not
measure, maybe past its context; a LoRA adapter it no longer holds) did not fail, so the
request is re-routed past it without spending its one retry, and the engine it goes on to
failing before anything was relayed still has it retried once elsewhere
(`Relay.retries_elsewhere`). Counted apart: `kvplane_controller_retries_total` the retry,
`kvplane_controller_reroutes_total{reason}` the re-route. Before, a context re-route (and a
Generate's LoRA re-route) spent the retry, so that engine's failure was the client's answer,
while a pooling task's LoRA re-route did not, and was counted among the retries.

Real gRPC end to end: a real controller in front of sim engines behind thin fronts
(`ScriptedServicer`) that play what a sim engine cannot on demand, and real torch pooling
engines for the pooling context."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from controller.route_report import read_route
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import EngineFleet, Fleet, close_fleet, make_fleet
from tests.controller.fronted_engine import Context, FrontedEngine, start_fronted_engine
from tests.controller.test_gateway import generate_routed
from tests.controller.test_gateway_scripted import (
    GenerateFaults,
    ScriptedServicer,
    ScriptedVllm,
    address,
    task_call,
)
from tests.controller.test_pooling_fleet import (
    LONG_INPUT,
    MODEL,
    SHORT_INPUT,
    short_and_long_fleet,
)
from vllm_grpc import vllm_grpc_pb2 as vpb
from vllm_grpc import vllm_grpc_pb2_grpc as vpb_grpc

pytestmark = pytest.mark.timeout(120)

SHORT_CONTEXT, LONG_CONTEXT = 64, 1024
LONG_TEXT = "hello " * 40  # 240 tokens (one a byte): past the short engine's context


Request = TypeVar("Request", pb.GenerateRequest, vpb.GenerateRequest)
T = TypeVar("T")


def _as_tokens(request: Request, text: str | None) -> Request:
    """`request` as a tokenising front sends it to its sim engine: its text prompt `text`
    (None: it has none) as token ids, one a byte."""
    if text is None:
        return request
    tokens = type(request)()
    tokens.CopyFrom(request)
    tokens.token_ids.ids[:] = list(text.encode())
    return tokens


async def _passed_on(stream: AsyncIterator[T], context: Context) -> AsyncIterator[T]:
    """The sim engine's `stream`, its status passed on as the engine said it."""
    try:
        async for response in stream:
            yield response
    except grpc.aio.AioRpcError as refused:
        await context.abort(refused.code(), refused.details() or "")


class Tokenizing(ScriptedServicer):
    """A ScriptedServicer that takes a text prompt (`_as_tokens`: a sim engine has no
    tokenizer), so that its sim engine refuses one past its context as an engine does
    (INVALID_ARGUMENT); the controller, which has no tokenizer for it, cannot tell its length.
    The next Generate calls take its own GenerateFaults."""

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Context) -> Any:
        info = await super().GetModelInfo(request, context)
        info.supports_text_input = True
        return info

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        text = request.prompt if request.WhichOneof("input") == "prompt" else None
        stream = super().Generate(_as_tokens(request, text), context)
        async for response in _passed_on(stream, context):
            yield response


class TokenizingVllm(ScriptedVllm):
    """`vllm.Generate` beside a Tokenizing front: its text prompt alike."""

    async def GenerateStream(
        self, request: vpb.GenerateRequest, context: Context
    ) -> AsyncIterator[vpb.GenerateResponse]:
        text = request.text if request.WhichOneof("prompt") == "text" else None
        stream = super().GenerateStream(_as_tokens(request, text), context)
        async for response in _passed_on(stream, context):
            yield response


TokenizingEngine = FrontedEngine[Tokenizing]


async def start_tokenizing(name: str, max_model_len: int) -> TokenizingEngine:
    def serve_vllm(engine: Tokenizing, server: grpc.aio.Server, inner: grpc.aio.Channel) -> None:
        vpb_grpc.add_GenerateServicer_to_server(
            TokenizingVllm(vpb_grpc.GenerateStub(inner), engine), server
        )

    return await start_fronted_engine(
        name,
        lambda inner: Tokenizing(
            inner, GenerateFaults(), advertise_lora=False, lora_enabled=False, tasks=frozenset()
        ),
        serve_also=serve_vllm,
        max_model_len=max_model_len,
    )


E = TypeVar("E", bound=FrontedEngine[Any])


@asynccontextmanager
async def picking_in_order(engines: list[E], **controller: Any) -> AsyncIterator[EngineFleet[E]]:
    """A controller in front of `engines` (`controller`: more ControllerConfig fields), which
    report 0, 3, 6... running requests (read by the controller before this yields): each
    request's first pick is the first engine, its next the second, and so on."""
    for n, engine in enumerate(engines):
        engine.servicer.load = {"running_requests": 3 * n}
    fleet = await make_fleet(engines=engines, **controller)
    try:
        registry = fleet.app.controller.fleet.registry
        for n, engine in enumerate(engines):

            def reported(engine: E = engine, n: int = n) -> bool:
                return registry.get(address(engine)).load.running_requests == 3 * n

            await fleet.app.controller.fleet.wait_for(reported, 15)
        yield fleet
    finally:
        await close_fleet(fleet)


def moves(fleet: EngineFleet[Any]) -> tuple[float, dict[str, float]]:
    """The retries and the re-routes by reason the controller counted."""
    metrics = fleet.app.controller.metrics
    return metrics.retries._value.get(), {
        reason: child._value.get() for reason, child in metrics.reroutes.items()
    }


TokenizingFleet = tuple[EngineFleet[TokenizingEngine], list[TokenizingEngine]]


@pytest.fixture
async def short_mid_long() -> AsyncIterator[TokenizingFleet]:
    """A short engine (SHORT_CONTEXT), then two long ones (LONG_CONTEXT), picked in that
    order; the controller tokenises no text (it has no tokenizer for the sim model, nor would
    it past one character)."""
    engines = [
        await start_tokenizing("short", SHORT_CONTEXT),
        await start_tokenizing("mid", LONG_CONTEXT),
        await start_tokenizing("long", LONG_CONTEXT),
    ]
    async with picking_in_order(engines, tokenize_max_chars=1) as fleet:
        yield fleet, engines


async def test_a_prompt_refused_for_its_length_is_still_retried_once_after_a_failure(
    short_mid_long: TokenizingFleet,
) -> None:
    """A text prompt past the short engine's context: refused there, re-routed to the mid
    engine (a longer context), which fails before its first token (UNAVAILABLE): retried once,
    on the long engine, which serves it; Generate and vllm.Generate alike. The route names
    both engines it left; one retry and one context re-route counted for each. Before, the
    re-route spent the retry, and the client got the mid engine's UNAVAILABLE."""
    fleet, (short, mid, long) = short_mid_long
    mid.servicer.faults.pending.append("unavailable")
    request = pb.GenerateRequest(
        request_id="g",
        model="sim",
        prompt=LONG_TEXT,
        stopping=pb.StoppingOptions(max_tokens=4, ignore_eos=True),
    )
    reply, route = await generate_routed(fleet, request)
    assert reply[-1].WhichOneof("event") == "finished", reply[-1]
    assert route is not None and route["engine"] == address(long), route
    assert route["retried_from"] == [address(short), address(mid)], route
    assert moves(fleet) == (1, {"lora_adapter": 0, "context": 1})

    mid.servicer.faults.pending.append("prompt_info_then_unavailable")
    vllm_request = vpb.GenerateRequest(
        request_id="v",
        model="sim",
        text=LONG_TEXT,
        stopping=vpb.StoppingCriteria(max_new_tokens=4),
    )
    call = vpb_grpc.GenerateStub(fleet.channel).GenerateStream(vllm_request)
    chunks = [r async for r in call]
    assert chunks[-1].outputs.HasField("finish_info"), chunks[-1]
    vllm_route = read_route(await call.trailing_metadata())
    assert vllm_route is not None and vllm_route["engine"] == address(long), vllm_route
    assert vllm_route["retried_from"] == [address(short), address(mid)], vllm_route
    assert moves(fleet) == (2, {"lora_adapter": 0, "context": 2})
    assert [e.servicer.generate_calls for e in (short, mid, long)] == [["g", "v"]] * 3


async def test_a_failure_after_the_refusal_with_the_retry_spent_is_the_clients_answer(
    short_mid_long: TokenizingFleet,
) -> None:
    """The rule's bound: a re-route leaves the retry, not a second one. The mid engine fails
    the request (retried once, on the long engine), and the long engine fails it too: the
    client gets the long engine's UNAVAILABLE, naming it, and no engine is asked twice."""
    fleet, (short, mid, long) = short_mid_long
    mid.servicer.faults.pending.append("unavailable")
    long.servicer.faults.pending.append("unavailable")
    request = pb.GenerateRequest(request_id="g", model="sim", prompt=LONG_TEXT)
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await generate_routed(fleet, request)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
    details = failed.value.details() or ""
    assert details.startswith(f"engine {address(long)} failed the request: "), details
    assert [e.servicer.generate_calls for e in (short, mid, long)] == [["g"]] * 3


class FailsTasks(ScriptedServicer):
    """A ScriptedServicer whose next `failing_tasks` accepted tasks fail UNAVAILABLE (as an
    engine that cannot be reached), after its own checks (task, model, LoRA adapter)."""

    failing_tasks = 0

    async def _task(
        self, task: str, request_context: pb.TaskRequestContext, context: Context
    ) -> None:
        await super()._task(task, request_context, context)
        if self.failing_tasks:
            self.failing_tasks -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted: not now")


LoraEngine = FrontedEngine[FailsTasks]
LoraFleet = tuple[EngineFleet[LoraEngine], list[LoraEngine]]


@pytest.fixture
async def lora_fleet(tmp_path: Path) -> AsyncIterator[LoraFleet]:
    """Three engines serving LoRA and Embed, picked in order, each holding adapter x (loaded
    through the gateway) but the first: x unloaded there behind the controller's back, so it
    refuses a request naming x NOT_FOUND."""
    engines = [
        await start_fronted_engine(
            name,
            lambda inner: FailsTasks(
                inner,
                GenerateFaults(),
                advertise_lora=True,
                lora_enabled=True,
                tasks=frozenset({"embed"}),
            ),
        )
        for name in ("e0", "e1", "e2")
    ]
    async with picking_in_order(engines) as fleet:
        x = pb.LoraAdapter(lora_id=1, lora_name="x", source_path=str(tmp_path / "x"))
        await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=x))
        del engines[0].servicer.adapters["x"]
        yield fleet, engines


async def test_a_request_whose_engine_lost_its_adapter_is_still_retried_once(
    lora_fleet: LoraFleet,
) -> None:
    """A Generate naming x: e0 refuses it (NOT_FOUND, x gone), it is re-routed to e1, which
    fails before its first token (UNAVAILABLE): retried once, on e2, which serves it. Before,
    the LoRA re-route spent the retry, and the client got e1's UNAVAILABLE."""
    fleet, engines = lora_fleet
    engines[1].servicer.faults.pending.append("unavailable")
    request = pb.GenerateRequest(
        request_id="g",
        model="sim",
        token_ids=pb.TokenIds(ids=[1, 2, 3]),
        lora_name="x",
        stopping=pb.StoppingOptions(max_tokens=4, ignore_eos=True),
    )
    reply, route = await generate_routed(fleet, request)
    assert reply[-1].WhichOneof("event") == "finished", reply[-1]
    assert route is not None and route["engine"] == address(engines[2]), route
    assert route["retried_from"] == [address(engines[0]), address(engines[1])], route
    assert moves(fleet) == (1, {"lora_adapter": 1, "context": 0})


async def test_a_task_whose_engine_lost_its_adapter_counts_its_reroute_apart(
    lora_fleet: LoraFleet,
) -> None:
    """An Embed naming x, by the same rule: refused by e0, re-routed to e1, which fails it,
    retried once on e2, which serves it; one re-route and one retry counted. Before, both
    were counted as retries."""
    fleet, engines = lora_fleet
    servicers = [e.servicer for e in engines]
    servicers[1].failing_tasks = 1
    await task_call(fleet.gateway, "embed", "t", "x")
    assert [s.task_calls for s in servicers] == [["embed"]] * 3
    assert moves(fleet) == (1, {"lora_adapter": 1, "context": 0})


@pytest.fixture
async def short_and_two_long(tmp_path: Path) -> AsyncIterator[tuple[Fleet, str]]:
    """Three torch pooling engines of one model, one taking inputs of up to SHORT_INPUT
    tokens, two LONG_INPUT, listed in that order (by address: routing by load picks the
    short one first among idle engines, then the first long one), that long one then
    stopped (its address is returned): a task sent there fails UNAVAILABLE. Slow polls: the
    controller still believes it ready. The controller tokenises no text of more than 10
    characters."""
    lengths = (("short", SHORT_INPUT), ("long-a", LONG_INPUT), ("long-b", LONG_INPUT))
    slow = {"poll_interval_s": 60, "load_poll_interval_s": 60}
    async with short_and_long_fleet(tmp_path, lengths, tokenize_max_chars=10, health=slow) as fleet:
        stopped = fleet.engines[1]
        await stopped.server.stop(None)
        yield fleet, fleet.address(stopped)


async def test_a_text_input_refused_for_its_length_is_still_retried_once_after_a_failure(
    short_and_two_long: tuple[Fleet, str],
) -> None:
    """A text input of more than SHORT_INPUT tokens that the controller does not tokenise:
    refused by the short engine (INVALID_ARGUMENT), re-routed to the first long engine, which
    cannot be reached (UNAVAILABLE): retried once, on the other long engine, which serves
    it. Before, the re-route spent the retry, and the client got that UNAVAILABLE."""
    fleet, stopped = short_and_two_long
    assert fleet.app.controller.fleet.registry.get(stopped).routable
    context = pb.TaskRequestContext(request_id="e", model=MODEL)
    long_text = pb.TaskInput(item_id="long", text="hello " * 12)  # past SHORT_INPUT tokens
    embedded = await fleet.gateway.Embed(pb.EmbedRequest(context=context, inputs=[long_text]))
    assert len(embedded.outputs) == 1
    assert moves(fleet) == (1, {"lora_adapter": 0, "context": 1})
    # Served by the other long engine: it ran the request (the short one refused it, the
    # stopped one never answered).
    served = fleet.address(fleet.engines[2])
    async with grpc.aio.insecure_channel(served) as channel:
        reply = await pb_grpc.OpenEngineStub(channel).Abort(pb.AbortRequest(request_id="e"))
    assert reply.status == pb.ABORT_STATUS_ALREADY_FINISHED
