"""One rule for every path through the gateway (Generate, vllm.Generate, Embed / Classify /
Score): an engine REFUSING what it cannot serve (a prompt or pooling input the gateway did not
measure, maybe past its context; a LoRA adapter it no longer holds) did not fail, so the
request is re-routed past it without spending its one retry, and the engine it goes on to
failing before anything was relayed still has it retried once elsewhere
(`Relay.retries_elsewhere`). Counted apart: `kvplane_controller_retries_total` the retry,
`kvplane_controller_reroutes_total{reason}` the re-route. Before, a context re-route (and a
Generate's LoRA re-route) spent the retry, so that engine's failure was the client's answer,
while a pooling task's LoRA re-route did not, and was counted among the retries. With no
engine left after a re-route, the client gets the failure of the engine that spent the retry
(it took what the others refused), where one did; a decode engine without the request's
adapter is re-routed past like any other.

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
    passed_on,
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
        async for response in super().Generate(_as_tokens(request, text), context):
            yield response


class TokenizingVllm(ScriptedVllm):
    """`vllm.Generate` beside a Tokenizing front: its text prompt alike."""

    async def GenerateStream(
        self, request: vpb.GenerateRequest, context: Context
    ) -> AsyncIterator[vpb.GenerateResponse]:
        text = request.text if request.WhichOneof("prompt") == "text" else None
        stream = super().GenerateStream(_as_tokens(request, text), context)
        async for response in passed_on(stream, context):
            yield response


TokenizingEngine = FrontedEngine[Tokenizing]


async def start_tokenizing(name: str, max_model_len: int, **config: Any) -> TokenizingEngine:
    """A Tokenizing engine (`config`: more of its sim engine's EngineConfig, such as its
    role)."""

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
        **config,
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


@asynccontextmanager
async def tokenizing_in_order(*contexts: tuple[str, int]) -> AsyncIterator[TokenizingFleet]:
    """A Tokenizing engine of each (name, max_model_len) of `contexts`, picked in that
    order; the controller tokenises no text (it has no tokenizer for the sim model, nor would
    it past one character)."""
    engines = [await start_tokenizing(name, context) for name, context in contexts]
    async with picking_in_order(engines, tokenize_max_chars=1) as fleet:
        yield fleet, engines


@pytest.fixture
async def short_mid_long() -> AsyncIterator[TokenizingFleet]:
    """A short engine (SHORT_CONTEXT), then two long ones (LONG_CONTEXT), picked in that
    order (`tokenizing_in_order`)."""
    contexts = ("short", SHORT_CONTEXT), ("mid", LONG_CONTEXT), ("long", LONG_CONTEXT)
    async with tokenizing_in_order(*contexts) as fleet:
        yield fleet


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


async def test_a_prompt_past_every_prefill_engine_counts_as_refused_for_itself() -> None:
    """A text prompt (240 tokens, not tokenised here) past the context of the only prefill
    engine (64), not of the decode engine (1024): the prefill engine refuses it
    (INVALID_ARGUMENT), maybe for its length, and no other prefill engine is left to take
    it. The client gets that refusal as the engine gave it, and the request counts as
    "invalid", as a request refused for itself does. It counted as "engine_error"."""
    engines = [
        await start_tokenizing("p0", SHORT_CONTEXT, role="prefill"),
        await start_tokenizing("d0", LONG_CONTEXT, role="decode"),
    ]
    async with picking_in_order(engines, tokenize_max_chars=1) as fleet:
        request = pb.GenerateRequest(request_id="g", model="sim", prompt=LONG_TEXT)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await generate_routed(fleet, request)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
        assert [e.servicer.generate_calls for e in engines] == [["g"], []]
        requests = fleet.app.controller.metrics.requests
        assert {o: requests.labels(o)._value.get() for o in ("invalid", "engine_error")} == {
            "invalid": 1,
            "engine_error": 0,
        }


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


async def start_lora_engine(name: str, tasks: frozenset[str], **config: Any) -> LoraEngine:
    """A FailsTasks engine serving LoRA and `tasks` (`config`: more of its sim engine's
    EngineConfig, such as its role)."""
    return await start_fronted_engine(
        name,
        lambda inner: FailsTasks(
            inner, GenerateFaults(), advertise_lora=True, lora_enabled=True, tasks=tasks
        ),
        **config,
    )


@asynccontextmanager
async def holding_x(
    tmp_path: Path, engines: list[LoraEngine], lost_on: LoraEngine
) -> AsyncIterator[LoraFleet]:
    """A controller in front of `engines`, picked in order (`picking_in_order`), each
    holding adapter x (loaded through the gateway) but `lost_on`: x unloaded there behind
    the controller's back, so it refuses a request naming x NOT_FOUND."""
    async with picking_in_order(engines) as fleet:
        x = pb.LoraAdapter(lora_id=1, lora_name="x", source_path=str(tmp_path / "x"))
        await fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=x))
        del lost_on.servicer.adapters["x"]
        yield fleet, engines


@pytest.fixture
async def lora_fleet(tmp_path: Path) -> AsyncIterator[LoraFleet]:
    """Three engines serving LoRA and Embed, e0, e1, e2, x lost on e0 (`holding_x`)."""
    engines = [await start_lora_engine(f"e{n}", frozenset({"embed"})) for n in range(3)]
    async with holding_x(tmp_path, engines, lost_on=engines[0]) as fleet:
        yield fleet


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


@asynccontextmanager
async def pooling_one_stopped(
    tmp_path: Path, lengths: tuple[tuple[str, int], ...], stopped: str
) -> AsyncIterator[tuple[Fleet, str]]:
    """A torch pooling engine of each (name, max_model_len) of `lengths`, of one model,
    listed (by address) in that order, which routing by load picks among idle engines; the
    one named `stopped` then stopped (its address is yielded): a task sent there fails
    UNAVAILABLE. Slow polls: the controller still believes it ready. The controller
    tokenises no text of more than 10 characters."""
    slow = {"poll_interval_s": 60, "load_poll_interval_s": 60}
    async with short_and_long_fleet(tmp_path, lengths, tokenize_max_chars=10, health=slow) as fleet:
        engine = fleet.engines[[name for name, _ in lengths].index(stopped)]
        await engine.server.stop(None)
        yield fleet, fleet.address(engine)


@pytest.fixture
async def short_and_two_long(tmp_path: Path) -> AsyncIterator[tuple[Fleet, str]]:
    """Three pooling engines, one taking inputs of up to SHORT_INPUT tokens, two LONG_INPUT,
    picked in that order, the first long one stopped (`pooling_one_stopped`)."""
    lengths = (("short", SHORT_INPUT), ("long-a", LONG_INPUT), ("long-b", LONG_INPUT))
    async with pooling_one_stopped(tmp_path, lengths, "long-a") as stopped:
        yield stopped


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


# ---- what the client gets when no engine is left after a re-route ----


def _failed_on(failure: grpc.aio.AioRpcError, engine: FrontedEngine[Any]) -> None:
    """`failure` is `engine`'s UNAVAILABLE, as the gateway names it."""
    assert failure.code() == grpc.StatusCode.UNAVAILABLE, failure
    details = failure.details() or ""
    assert details.startswith(f"engine {address(engine)} failed the request: "), details


@pytest.fixture
async def long_then_short() -> AsyncIterator[TokenizingFleet]:
    """A long engine (LONG_CONTEXT), then a short one (SHORT_CONTEXT), picked in that order
    (`tokenizing_in_order`)."""
    async with tokenizing_in_order(("long", LONG_CONTEXT), ("short", SHORT_CONTEXT)) as fleet:
        yield fleet


async def test_a_refusal_past_a_failed_retry_leaves_the_failing_engines_answer(
    long_then_short: TokenizingFleet,
) -> None:
    """A text prompt past the short engine's context: the long engine, its first pick, fails
    before its first token (UNAVAILABLE), its one retry goes to the short engine, which
    refuses it for its length; the one engine that takes it longer failed it already, so
    the client gets that failure, naming the long engine (sent again, it may succeed), not
    the short engine's INVALID_ARGUMENT (as if its prompt were too long for the fleet);
    Generate and vllm.Generate alike. The re-route found no engine: only the retry counted.
    It was the short engine's refusal."""
    fleet, (long, short) = long_then_short
    long.servicer.faults.pending.append("unavailable")
    request = pb.GenerateRequest(request_id="g", model="sim", prompt=LONG_TEXT)
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await generate_routed(fleet, request)
    _failed_on(failed.value, long)
    assert moves(fleet) == (1, {"lora_adapter": 0, "context": 0})

    long.servicer.faults.pending.append("prompt_info_then_unavailable")
    vllm_request = vpb.GenerateRequest(request_id="v", model="sim", text=LONG_TEXT)
    call = vpb_grpc.GenerateStub(fleet.channel).GenerateStream(vllm_request)
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        [r async for r in call]
    _failed_on(failed.value, long)
    assert [e.servicer.generate_calls for e in (long, short)] == [["g", "v"]] * 2


async def test_a_lost_adapter_past_a_failed_retry_leaves_the_failing_engines_answer(
    lora_fleet: LoraFleet,
) -> None:
    """x gone from e2 too: a Generate naming x is refused by e0 (re-routed), fails on e1
    (retried), is refused by e2 (re-routed): e1, which holds x, is the one engine that could
    serve it, and its failure is the client's answer. It was e2's bare NOT_FOUND. Each move
    but the last, which found no engine, counted."""
    fleet, engines = lora_fleet
    del engines[2].servicer.adapters["x"]
    engines[1].servicer.faults.pending.append("unavailable")
    request = pb.GenerateRequest(
        request_id="g", model="sim", token_ids=pb.TokenIds(ids=[1, 2, 3]), lora_name="x"
    )
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await generate_routed(fleet, request)
    _failed_on(failed.value, engines[1])
    assert [e.servicer.generate_calls for e in engines] == [["g"]] * 3
    assert moves(fleet) == (1, {"lora_adapter": 1, "context": 0})


async def test_a_task_whose_adapter_is_lost_past_a_failed_retry_gets_the_failing_engines_answer(
    lora_fleet: LoraFleet,
) -> None:
    """The same for an Embed naming x (e0 refuses, e1 fails, e2 refuses): e1's failure. It
    was UNAVAILABLE saying "the embed engines with LoRA adapter 'x' loaded take no traffic
    now: e1", e1 taking traffic."""
    fleet, engines = lora_fleet
    del engines[2].servicer.adapters["x"]
    engines[1].servicer.failing_tasks = 1
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await task_call(fleet.gateway, "embed", "t", "x")
    _failed_on(failed.value, engines[1])
    assert [e.servicer.task_calls for e in engines] == [["embed"]] * 3
    assert moves(fleet) == (1, {"lora_adapter": 1, "context": 0})


@pytest.fixture
async def long_then_short_pooling(tmp_path: Path) -> AsyncIterator[tuple[Fleet, str]]:
    """Two pooling engines, a long one (LONG_INPUT) then a short one (SHORT_INPUT), picked
    in that order, the long one stopped (`pooling_one_stopped`)."""
    lengths = (("long", LONG_INPUT), ("short", SHORT_INPUT))
    async with pooling_one_stopped(tmp_path, lengths, "long") as stopped:
        yield stopped


async def test_a_text_input_refused_past_a_failed_retry_gets_the_failing_engines_answer(
    long_then_short_pooling: tuple[Fleet, str],
) -> None:
    """A text input past the short engine's context, not tokenised here: the long engine
    fails it (UNAVAILABLE), its retry goes to the short engine, which refuses it
    (INVALID_ARGUMENT): the long engine, the one that takes it, failed it, and its failure is
    the answer, as a Generate's. It was UNAVAILABLE saying "no embed engine takes traffic
    now", the long engine ready."""
    fleet, stopped = long_then_short_pooling
    assert fleet.app.controller.fleet.registry.get(stopped).routable
    context = pb.TaskRequestContext(request_id="e", model=MODEL)
    long_text = pb.TaskInput(item_id="long", text="hello " * 12)  # past SHORT_INPUT tokens
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await fleet.gateway.Embed(pb.EmbedRequest(context=context, inputs=[long_text]))
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
    details = failed.value.details() or ""
    assert details.startswith(f"engine {stopped} failed the request: "), details
    assert moves(fleet) == (1, {"lora_adapter": 0, "context": 0})


# ---- a decode hop's engine without the request's adapter ----


@pytest.fixture
async def disaggregated_lora_fleet(tmp_path: Path) -> AsyncIterator[LoraFleet]:
    """A prefill engine, then decode engines d0, d1, d2 picked in that order (sim engines in
    those roles, real KV sessions), x lost on d0 (`holding_x`): d0 refuses a decode naming
    x NOT_FOUND, before it pulls the request's KV session."""
    engines = [await start_lora_engine("p0", frozenset(), role="prefill")]
    engines += [await start_lora_engine(f"d{n}", frozenset(), role="decode") for n in range(3)]
    async with holding_x(tmp_path, engines, lost_on=engines[1]) as fleet:
        yield fleet


def _decode_request(request_id: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        model="sim",
        token_ids=pb.TokenIds(ids=list(range(300, 340))),
        lora_name="x",
        stopping=pb.StoppingOptions(max_tokens=4, ignore_eos=True),
    )


async def test_a_decode_engine_without_the_adapter_leaves_the_retry_unspent(
    disaggregated_lora_fleet: LoraFleet,
) -> None:
    """The decode hop by the rule of every hop: d0 refuses the decode (NOT_FOUND, x gone),
    which is re-routed to d1, which fails before its first token (UNAVAILABLE): retried once,
    on d2, which takes the KV session and serves it. One re-route and one retry counted.
    Before, d0's NOT_FOUND passed for a refused KV session (UNAVAILABLE), which spent the
    retry, and the client got d1's UNAVAILABLE."""
    fleet, (prefill, d0, d1, d2) = disaggregated_lora_fleet
    d1.servicer.faults.pending.append("unavailable")
    reply, route = await generate_routed(fleet, _decode_request("g"))
    assert reply[-1].WhichOneof("event") == "finished", reply[-1]
    assert route is not None and route["engine"] == address(d2), route
    assert route["prefill"]["engine"] == address(prefill), route
    assert [e.servicer.generate_calls for e in (d0, d1, d2)] == [["g"]] * 3
    assert moves(fleet) == (1, {"lora_adapter": 1, "context": 0})


async def test_a_session_ended_on_its_holder_past_a_decode_engine_without_the_adapter(
    disaggregated_lora_fleet: LoraFleet,
) -> None:
    """d0 refuses the decode (NOT_FOUND, x gone), which is re-routed to d1, which finds no
    KV session (NOT_FOUND): the prefill engine ended it (an operator's Abort of it there).
    d0 attached no session, so d1's refusal is judged as a first decode engine's: the
    session's release says it had ended, and the request runs again as a whole, once (one
    retry), its second session decoded on d1. Before, the re-route passed for a decode
    engine that may have attached the session: d1's refusal was retried on d2 with the same
    session, which found none either, and the client got UNAVAILABLE. The run again does not
    ask d0 again: d0's refusal taught the controller that it lacks x. Before, the run
    again's decode hop went to d0 first once more (the plan's decode engines), and was
    re-routed past it a second time."""
    fleet, (prefill, d0, d1, d2) = disaggregated_lora_fleet
    d1.servicer.faults.pending.append("session_ended")
    reply, route = await generate_routed(fleet, _decode_request("g"))
    assert reply[-1].WhichOneof("event") == "finished", reply[-1]
    assert route is not None and route["engine"] == address(d1), route
    assert prefill.servicer.generate_calls == ["g", "g"]
    assert [e.servicer.generate_calls for e in (d0, d1, d2)] == [["g"], ["g", "g"], []]
    assert moves(fleet) == (1, {"lora_adapter": 1, "context": 0})


async def test_a_decode_with_no_decode_engine_holding_the_adapter_gets_the_fleets_answer(
    disaggregated_lora_fleet: LoraFleet,
) -> None:
    """x gone from every decode engine behind the controller's back: each refuses the
    decode, and the client gets the fleet's answer, as at the request's plan (NOT_FOUND "no
    decode engine has LoRA adapter 'x' loaded"). It was UNAVAILABLE, "engine d1 refused the
    KV session: NOT_FOUND ..." (the retry spent on d0's refusal)."""
    fleet, (_, d0, d1, d2) = disaggregated_lora_fleet
    for engine in d1, d2:
        del engine.servicer.adapters["x"]
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await generate_routed(fleet, _decode_request("g"))
    assert failed.value.code() == grpc.StatusCode.NOT_FOUND, failed.value
    assert failed.value.details() == "no decode engine has LoRA adapter 'x' loaded"
    assert [e.servicer.generate_calls for e in (d0, d1, d2)] == [["g"]] * 3
    assert moves(fleet) == (0, {"lora_adapter": 2, "context": 0})
