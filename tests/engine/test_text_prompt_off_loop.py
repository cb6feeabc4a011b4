"""A long text prompt is tokenised off the engine's event loop: while it is being tokenised,
another client's health checks are answered (a tokenizer that blocks until the test releases
it; were it on the event loop, nothing could answer until then), and an Abort of the request by
its id, before it is accepted, ends it CANCELLED without running it, even when the conversion
then refuses the request (the abort wins)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Coroutine

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.server.openengine_convert import EngineContext
from engine.server.openengine_servicer import OpenEngineServicer
from engine.server.vllm_servicer import VllmGenerateServicer
from kvplane.server import create_server
from kvplane.tokenize import INLINE_TOKENIZE_MAX_CHARS
from openengine.v1 import openengine_pb2 as oe
from openengine.v1 import openengine_pb2_grpc as oe_grpc
from tests.engine.engine_server_harness import collect, running_engine, sim_config
from vllm_grpc import vllm_grpc_pb2 as vpb
from vllm_grpc import vllm_grpc_pb2_grpc as vpb_grpc

pytestmark = pytest.mark.timeout(120)

PROMPT_IDS = list(range(20, 44))
HUGE_PROMPT = "x" * (INLINE_TOKENIZE_MAX_CHARS * 64)
# Only against a deadlock on the old code (the tokenizer on the event loop blocks the very loop
# that would answer Health): the passing path never waits on it.
DEADLOCK_GUARD_S = 20.0


class BlockingTokenizer:
    """`encode` blocks until `release` is set, records whether it was released (True) or
    gave up on the guard (False), and gives `ids` (PROMPT_IDS unless told)."""

    def __init__(self, ids: list[int] = PROMPT_IDS) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.released: list[bool] = []
        self.ids = ids

    def encode(self, text: str) -> list[int]:
        self.entered.set()
        self.released.append(self.release.wait(DEADLOCK_GUARD_S))
        return self.ids


# A token id outside the sim model's vocabulary (1000): the conversion refuses the prompt
# (INVALID_ARGUMENT) once it is tokenised.
OUT_OF_VOCABULARY = [5, 1_000_000]


def openengine_call(channel: grpc.aio.Channel) -> Callable[[], Coroutine[None, None, list[object]]]:
    request = oe.GenerateRequest(prompt=HUGE_PROMPT, stopping=oe.StoppingOptions(max_tokens=3))

    async def call() -> list[object]:
        return [r async for r in oe_grpc.OpenEngineStub(channel).Generate(request)]

    return call


def vllm_call(channel: grpc.aio.Channel) -> Callable[[], Coroutine[None, None, list[object]]]:
    request = vpb.GenerateRequest(text=HUGE_PROMPT, stopping=vpb.StoppingCriteria(max_new_tokens=3))

    async def call() -> list[object]:
        return [r async for r in vpb_grpc.GenerateStub(channel).GenerateStream(request)]

    return call


@contextlib.asynccontextmanager
async def text_engine(tokenizer: BlockingTokenizer, role: str = "aggregated") -> AsyncIterator[int]:
    """A real engine of `role` whose both front ends tokenise with `tokenizer` (a DECODE
    engine's OpenEngine front end pulls KV sessions with the engine's puller); yields its
    port."""
    async with running_engine(sim_config(role=role)) as engine:
        service = engine.app.service
        ctx = EngineContext(
            model=service.model,
            role=oe.EngineRole.Value(f"ENGINE_ROLE_{role.upper()}"),
            data_parallel_rank=0,
            encode=tokenizer.encode,
        )
        openengine = OpenEngineServicer(
            service, ctx, instance_id="text", token_text=str, kv_puller=engine.app.kv_puller
        )
        vllm = VllmGenerateServicer(service, ctx)
        health_servicer = health.aio.HealthServicer()
        await vllm.report_health(health_servicer)
        await vllm.update_health()
        server, port = await create_server(
            sim_config(), [openengine.service(), vllm.service()], health_servicer=health_servicer
        )
        try:
            yield port
        finally:
            await server.stop(0)


@pytest.mark.parametrize("front_end", [openengine_call, vllm_call])
async def test_health_answers_while_a_huge_text_prompt_is_tokenised(
    front_end: Callable[[grpc.aio.Channel], Callable[[], Coroutine[None, None, list[object]]]],
) -> None:
    tokenizer = BlockingTokenizer()
    async with (
        text_engine(tokenizer) as port,
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as client,
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as other_client,
    ):
        generate = asyncio.create_task(front_end(client)())
        await asyncio.to_thread(tokenizer.entered.wait)
        # The prompt is being tokenised now: another client is answered meanwhile.
        state = await oe_grpc.OpenEngineStub(other_client).Health(oe.HealthRequest())
        probe = health_pb2_grpc.HealthStub(other_client)
        checked = await probe.Check(health_pb2.HealthCheckRequest(service="vllm.Generate"))
        tokenizer.release.set()
        responses = await generate
    assert tokenizer.released == [True], "Health was not answered until the tokenizer returned"
    assert state.state == oe.HEALTH_STATE_READY
    assert checked.status == health_pb2.HealthCheckResponse.SERVING
    assert responses  # the request itself was served, on the prompt the tokenizer gave


# What the tokenizer gives the aborted request: a prompt its conversion takes (its usage counts
# it), or one the conversion refuses, which ends as aborted all the same (the abort wins), with
# no prompt taken.
TOKENISED = [
    pytest.param(PROMPT_IDS, len(PROMPT_IDS), id="converted"),
    pytest.param(OUT_OF_VOCABULARY, 0, id="conversion-refused"),
]


@pytest.mark.parametrize(("ids", "prompt_tokens"), TOKENISED)
async def test_abort_while_the_text_prompt_is_tokenised_ends_it_cancelled_unrun(
    ids: list[int], prompt_tokens: int
) -> None:
    """An Abort by id while the request's prompt is still being tokenised (not accepted yet)
    answers ABORTED, a duplicate id meanwhile is refused, and once tokenised the request ends
    CANCELLED without a token generated, each of its 2 outputs `GenerationFinished(CANCELLED)`
    with status OK, even when the conversion refuses the prompt (not its INVALID_ARGUMENT); a
    second Abort then answers ALREADY_FINISHED."""
    tokenizer = BlockingTokenizer(ids)
    request = oe.GenerateRequest(
        request_id="held",
        prompt=HUGE_PROMPT,
        sampling=oe.SamplingParams(num_sequences=2),
        stopping=oe.StoppingOptions(max_tokens=3),
    )
    duplicate = oe.GenerateRequest(
        request_id="held",
        token_ids=oe.TokenIds(ids=PROMPT_IDS),
        stopping=oe.StoppingOptions(max_tokens=3),
    )
    async with (
        text_engine(tokenizer) as port,
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as client,
    ):
        stub = oe_grpc.OpenEngineStub(client)
        generate = asyncio.create_task(collect(stub, request))
        await asyncio.to_thread(tokenizer.entered.wait)
        aborted = await stub.Abort(oe.AbortRequest(request_id="held"))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(stub, duplicate)
        tokenizer.release.set()
        responses = await generate
        again = await stub.Abort(oe.AbortRequest(request_id="held"))
    assert aborted.status == oe.ABORT_STATUS_ABORTED
    assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert [r.WhichOneof("event") for r in responses] == ["finished", "finished"]
    assert [r.finished.output_index for r in responses] == [0, 1]
    assert {r.finished.reason for r in responses} == {oe.FINISH_REASON_CANCELLED}
    usage = responses[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, 0)
    assert again.status == oe.ABORT_STATUS_ALREADY_FINISHED


async def aborted_while_tokenised(
    client: grpc.aio.Channel, tokenizer: BlockingTokenizer, request: oe.GenerateRequest
) -> tuple[oe.AbortResponse, list[oe.GenerateResponse]]:
    """`request` generated on the engine `client` dials, aborted by its id while `tokenizer`
    tokenises its prompt: the Abort's reply and the request's responses."""
    stub = oe_grpc.OpenEngineStub(client)
    generate = asyncio.create_task(collect(stub, request))
    await asyncio.to_thread(tokenizer.entered.wait)
    aborted = await stub.Abort(oe.AbortRequest(request_id=request.request_id))
    tokenizer.release.set()
    return aborted, await generate


async def test_an_aborted_request_acceptance_would_refuse_ends_as_the_engine_takes_one() -> None:
    """Aborted while its prompt is tokenised, a request asking for more outputs than the
    engine's `max_num_seqs` (8), which acceptance refuses, converts (the conversion does not
    count seats): it ends as one whose conversion refused it, one output finished CANCELLED,
    no prompt taken. It ended with all 9 outputs, a request the engine never takes."""
    tokenizer = BlockingTokenizer()
    request = oe.GenerateRequest(
        request_id="held",
        prompt=HUGE_PROMPT,
        sampling=oe.SamplingParams(num_sequences=sim_config().max_num_seqs + 1),
        stopping=oe.StoppingOptions(max_tokens=3),
    )
    async with (
        text_engine(tokenizer) as port,
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as client,
    ):
        aborted, responses = await aborted_while_tokenised(client, tokenizer, request)
    assert aborted.status == oe.ABORT_STATUS_ABORTED
    assert [(r.finished.output_index, r.finished.reason) for r in responses] == [
        (0, oe.FINISH_REASON_CANCELLED)
    ]
    usage = responses[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (0, 0)


class FailingTokenizer(BlockingTokenizer):
    """A `BlockingTokenizer` that fails once released, as a tokenizer with a bug would."""

    def encode(self, text: str) -> list[int]:
        super().encode(text)
        raise RuntimeError("the tokenizer broke")


async def test_a_conversion_that_breaks_after_an_abort_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The abort wins over a conversion that fails after it, but an error that is no refusal
    (a bug) is not swallowed: it is logged with its traceback, as it is without the Abort (it
    used to vanish)."""
    tokenizer = FailingTokenizer()
    request = oe.GenerateRequest(
        request_id="held", prompt=HUGE_PROMPT, stopping=oe.StoppingOptions(max_tokens=3)
    )
    async with (
        text_engine(tokenizer) as port,
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as client,
    ):
        aborted, responses = await aborted_while_tokenised(client, tokenizer, request)
    assert aborted.status == oe.ABORT_STATUS_ABORTED
    assert [r.finished.reason for r in responses] == [oe.FINISH_REASON_CANCELLED]
    logged = [r for r in caplog.records if r.levelno >= logging.ERROR and r.exc_info]
    assert [str(r.exc_info[1]) for r in logged if r.exc_info] == ["the tokenizer broke"]


@pytest.mark.parametrize("unary", [False, True])
@pytest.mark.parametrize(("ids", "prompt_tokens"), TOKENISED)
async def test_vllm_generate_aborted_while_tokenised_finishes_aborted_unrun(
    ids: list[int], prompt_tokens: int, unary: bool
) -> None:
    """vllm.Generate and GenerateStream: the same race ends the sequence ABORTED, with no
    output token, whether its conversion takes the prompt or refuses it."""
    tokenizer = BlockingTokenizer(ids)
    request = vpb.GenerateRequest(
        request_id="held", text=HUGE_PROMPT, stopping=vpb.StoppingCriteria(max_new_tokens=3)
    )
    async with (
        text_engine(tokenizer) as port,
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as client,
    ):
        stub = vpb_grpc.GenerateStub(client)

        async def call() -> list[vpb.GenerateResponse]:
            if unary:
                return [await stub.Generate(request)]
            return [response async for response in stub.GenerateStream(request)]

        generate = asyncio.create_task(call())
        await asyncio.to_thread(tokenizer.entered.wait)
        aborted = await oe_grpc.OpenEngineStub(client).Abort(oe.AbortRequest(request_id="held"))
        tokenizer.release.set()
        responses = await generate
    assert aborted.status == oe.ABORT_STATUS_ABORTED
    assert responses[0].prompt_info.num_prompt_tokens == prompt_tokens
    finish = responses[-1].outputs.finish_info
    assert finish.finish_reason == vpb.FinishInfo.ABORTED
    assert finish.num_output_tokens == 0
    assert not any(r.outputs.token_ids for r in responses)
