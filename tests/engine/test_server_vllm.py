"""vllm.Generate (unary and streaming) over the same core, through real stubs (sim runner)."""

from __future__ import annotations

import asyncio
import math
import re
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.config import EngineRoleName, SimTimingConfig
from engine.core.engine_loop import EngineLoop
from engine.server.engine_service import EngineService
from engine.server.openengine_convert import EngineContext
from engine.server.openengine_servicer import OpenEngineServicer
from engine.server.vllm_servicer import VllmGenerateServicer
from kvplane.server import create_server
from openengine.v1 import openengine_pb2 as oe
from openengine.v1 import openengine_pb2_grpc as oe_grpc
from tests.engine.engine_server_harness import (
    Engine,
    collect,
    generate_request,
    idle,
    metrics_text,
    rpc_error,
    running_engine,
    sim_config,
    stream_error,
)
from tests.polling import eventually
from vllm_grpc import vllm_grpc_pb2 as pb

pytestmark = pytest.mark.timeout(60)

PROMPT = list(range(20, 44))


def _request(**fields: object) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=PROMPT),
        stopping=pb.StoppingCriteria(max_new_tokens=5),
        response=pb.ResponseOptions(output_token_ids=True, prompt_token_ids=True),
    )
    for name, value in fields.items():
        getattr(request, name).CopyFrom(value)
    return request


async def test_stream_two_sequences_with_prompt_info_and_finish_info() -> None:
    async with running_engine() as engine:
        request = _request(sampling=pb.RandomSampling(num_sequences=2))
        responses = [r async for r in engine.vllm.GenerateStream(request)]
    assert responses[0].HasField("prompt_info")
    assert not any(r.HasField("prompt_info") for r in responses[1:])
    assert list(responses[0].prompt_info.token_ids) == PROMPT
    assert responses[0].prompt_info.num_prompt_tokens == len(PROMPT)
    tokens: dict[int, list[int]] = {0: [], 1: []}
    finishes = {}
    for r in responses:
        out = r.outputs
        assert out.num_tokens == len(out.token_ids)
        tokens[out.index].extend(out.token_ids)
        if out.HasField("finish_info"):
            assert out.index not in finishes
            finishes[out.index] = out.finish_info
    assert {i: len(t) for i, t in tokens.items()} == {0: 5, 1: 5}
    assert all(f.finish_reason == pb.FinishInfo.LENGTH for f in finishes.values())
    assert all(f.num_output_tokens == 5 for f in finishes.values())


async def test_unary_generate_matches_openengine_greedy_tokens() -> None:
    async with running_engine() as engine:
        unary = await engine.vllm.Generate(_request())
        openengine = await collect(
            engine.stub,
            generate_request(PROMPT, max_tokens=5, sampling=oe.SamplingParams(temperature=0)),
        )
    oe_tokens = [
        t.token_id for r in openengine if r.WhichOneof("event") == "token" for t in r.token.tokens
    ]
    assert list(unary.outputs.token_ids) == oe_tokens
    assert unary.outputs.num_tokens == 5
    assert unary.outputs.finish_info.num_output_tokens == 5
    assert unary.prompt_info.num_prompt_tokens == len(PROMPT)


async def test_refusals_before_acceptance() -> None:
    async with running_engine() as engine:
        unknown = _request()
        unknown.model = "other"
        assert (await rpc_error(engine.vllm.Generate(unknown))).code() == grpc.StatusCode.NOT_FOUND
        structured = _request(decoding=pb.DecodingParameters(regex="a+"))
        assert (
            await rpc_error(engine.vllm.Generate(structured))
        ).code() == grpc.StatusCode.INVALID_ARGUMENT
        two = _request(sampling=pb.RandomSampling(num_sequences=2))
        assert (
            await rpc_error(engine.vllm.Generate(two))
        ).code() == grpc.StatusCode.INVALID_ARGUMENT
        empty = pb.GenerateRequest()
        assert (
            await rpc_error(engine.vllm.Generate(empty))
        ).code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_an_aborted_stream_finishes_with_aborted() -> None:
    config = sim_config(
        sim=SimTimingConfig(time_scale=0.5, vocab_size=1000), max_model_len=4096, num_kv_blocks=2048
    )
    async with running_engine(config) as engine:
        request = _request()
        request.request_id = "v1"
        request.stopping.max_new_tokens = 3000
        stream = engine.vllm.GenerateStream(request)
        first: Any = await asyncio.wait_for(stream.read(), timeout=20)
        assert first.HasField("prompt_info")
        await engine.stub.Abort(oe.AbortRequest(request_id="v1"))
        last = first
        while True:
            response: Any = await asyncio.wait_for(stream.read(), timeout=20)
            if response is grpc.aio.EOF:
                break
            last = response
        assert last.outputs.finish_info.finish_reason == pb.FinishInfo.ABORTED


# One seat (max_num_seqs 1) and slow passes: a second request waits in the queue.
ONE_SEAT = sim_config(
    sim=SimTimingConfig(time_scale=0.5, vocab_size=1000),
    max_model_len=4096,
    num_kv_blocks=2048,
    max_num_seqs=1,
)


async def _take_the_seat(
    engine: Engine,
) -> grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse]:
    """Start request "running" (3,000 tokens to go) and wait for its first response: the
    seat is taken. Returns its stream (cancel it, or abort "running", to free the seat)."""
    running = _request()
    running.request_id = "running"
    running.stopping.max_new_tokens = 3000
    stream = engine.vllm.GenerateStream(running)
    first = await asyncio.wait_for(stream.read(), timeout=20)
    assert isinstance(first, pb.GenerateResponse) and first.HasField("prompt_info")
    return stream


async def test_a_request_aborted_before_its_prefill_still_sends_prompt_info() -> None:
    """With prompt logprobs asked for, prompt_info waits for them; a request aborted while
    queued never computes them, and its one response still carries prompt_info."""
    async with running_engine(ONE_SEAT) as engine:
        first = await _take_the_seat(engine)
        queued = _request(response=pb.ResponseOptions(prompt_logprobs=True))
        queued.request_id = "queued"
        stream = engine.vllm.GenerateStream(queued)

        async def is_queued() -> bool:
            return (await engine.stub.GetLoad(oe.GetLoadRequest())).queued_requests == 1

        await eventually(is_queued)
        await engine.stub.Abort(oe.AbortRequest(request_id="queued"))
        responses = [r async for r in stream]
        first.cancel()
    assert len(responses) == 1
    assert responses[0].outputs.finish_info.finish_reason == pb.FinishInfo.ABORTED
    assert responses[0].prompt_info.num_prompt_tokens == len(PROMPT)
    assert list(responses[0].prompt_info.logprobs) == []


async def test_a_lower_priority_value_is_handled_first_as_in_vllm() -> None:
    """vLLM's priority: lower means earlier handling (OpenEngine's is the opposite). With one
    seat taken, the queued request with priority -5 starts before the one with priority 5."""
    async with running_engine(ONE_SEAT) as engine:
        first = await _take_the_seat(engine)
        finished: list[str] = []

        async def run(request_id: str, priority: int) -> None:
            request = _request()
            request.request_id, request.priority = request_id, priority
            await engine.vllm.Generate(request)
            finished.append(request_id)

        tasks = [asyncio.create_task(run("later", 5)), asyncio.create_task(run("earlier", -5))]

        async def both_queued() -> bool:
            return (await engine.stub.GetLoad(oe.GetLoadRequest())).queued_requests == 2

        await eventually(both_queued)
        await engine.stub.Abort(oe.AbortRequest(request_id="running"))
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=20)
        first.cancel()
    assert finished == ["earlier", "later"]


@pytest.mark.parametrize(
    "options",
    [
        pb.GenerateRequest(temperature=math.inf),
        pb.GenerateRequest(decoding=pb.DecodingParameters(repetition_penalty=math.nan)),
        pb.GenerateRequest(decoding=pb.DecodingParameters(frequency_penalty=math.inf)),
        pb.GenerateRequest(sampling=pb.RandomSampling(num_sequences=9)),  # max_num_seqs 8
        pb.GenerateRequest(stopping=pb.StoppingCriteria(stop_token_ids=[1000])),  # vocab 1000
        pb.GenerateRequest(
            response=pb.ResponseOptions(
                output_logprobs=True,
                output_candidates=pb.CandidateTokens(token_ids=pb.TokenIds(ids=[1000])),
            )
        ),
        pb.GenerateRequest(
            response=pb.ResponseOptions(
                prompt_logprobs=True, prompt_candidates=pb.CandidateTokens(top_n=1001)
            )
        ),
    ],
    ids=[
        "temperature_inf",
        "repetition_penalty_nan",
        "frequency_penalty_inf",
        "num_sequences_above_max",
        "stop_token_id_outside_vocab",
        "candidate_id_outside_vocab",
        "top_n_above_max_top_n",
    ],
)
async def test_out_of_range_options_are_invalid_argument(options: pb.GenerateRequest) -> None:
    async with running_engine() as engine:
        request = _request()
        request.MergeFrom(options)
        events, error = await stream_error(engine.vllm.GenerateStream(request))
        assert events == []  # refused before acceptance
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert await idle(engine)


@pytest.mark.parametrize(
    ("options", "details"),
    [
        (pb.GenerateRequest(temperature=-0.5), "temperature must be >= 0, got -0.5"),
        (
            pb.GenerateRequest(sampling=pb.RandomSampling(top_p=1.5)),
            "top_p must be in (0, 1], got 1.5",
        ),
        (pb.GenerateRequest(sampling=pb.RandomSampling(min_p=2)), "min_p must be in [0, 1], got 2"),
        (
            pb.GenerateRequest(decoding=pb.DecodingParameters(frequency_penalty=2.5)),
            "frequency_penalty must be in [-2, 2], got 2.5",
        ),
        (
            pb.GenerateRequest(decoding=pb.DecodingParameters(presence_penalty=-3)),
            "presence_penalty must be in [-2, 2], got -3",
        ),
        (
            pb.GenerateRequest(decoding=pb.DecodingParameters(repetition_penalty=-1)),
            "repetition_penalty must be > 0, got -1",
        ),
    ],
    ids=["temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition"],
)
async def test_an_out_of_range_sampling_value_is_named_with_what_was_sent(
    options: pb.GenerateRequest, details: str
) -> None:
    """INVALID_ARGUMENT before acceptance, saying which field (in the proto's own name; not
    "frequency/presence penalties") is out of which range, and the value the client sent."""
    async with running_engine() as engine:
        request = _request()
        request.MergeFrom(options)
        error = await rpc_error(engine.vllm.Generate(request))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details() == details
        assert await idle(engine)


@pytest.mark.parametrize("include_stop", [False, True])
async def test_a_matched_stop_token_is_sent_and_counted(include_stop: bool) -> None:
    """As vLLM's output: the matched stop token (EOS or a stop id) ends `token_ids`, with its
    logprob, whether or not include_stop_strings is set (that decides its text only), so the
    chunks add up to FinishInfo.num_output_tokens, which is OpenEngine's completion_tokens."""
    config = sim_config(sim=SimTimingConfig(time_scale=0.0, vocab_size=1000, eos_after=3))
    async with running_engine(config) as engine:
        greedy = await engine.vllm.Generate(_request())  # two tokens, then the EOS
        assert greedy.outputs.finish_info.HasField("eos_token_id")
        assert greedy.outputs.token_ids[-1] == greedy.outputs.finish_info.eos_token_id
        for stop_ids, generated in (((), 3), ((greedy.outputs.token_ids[1],), 2)):
            request = _request(
                stopping=pb.StoppingCriteria(
                    max_new_tokens=5, stop_token_ids=stop_ids, include_stop_strings=include_stop
                ),
                response=pb.ResponseOptions(output_token_ids=True, output_logprobs=True),
            )
            streamed = [r async for r in engine.vllm.GenerateStream(request)]
            token_ids = [t for r in streamed for t in r.outputs.token_ids]
            assert token_ids == list(greedy.outputs.token_ids[:generated])
            assert sum(r.outputs.num_tokens for r in streamed) == generated
            assert sum(len(r.outputs.logprobs) for r in streamed) == generated
            finish = streamed[-1].outputs.finish_info
            assert finish.finish_reason == pb.FinishInfo.STOP
            assert finish.num_output_tokens == generated
            matched = finish.stop_token_id if stop_ids else finish.eos_token_id
            assert finish.WhichOneof("stop_reason") == (
                "stop_token_id" if stop_ids else "eos_token_id"
            )
            assert matched == token_ids[-1]
            openengine = await collect(
                engine.stub,
                oe.GenerateRequest(
                    token_ids=oe.TokenIds(ids=PROMPT),
                    sampling=oe.SamplingParams(temperature=0),
                    stopping=oe.StoppingOptions(
                        max_tokens=5,
                        conditions=[oe.StopCondition(stop_token_id=t) for t in stop_ids],
                        include_stop_in_output=include_stop,
                    ),
                ),
            )
            assert openengine[-1].usage.completion_tokens == generated


async def test_absent_max_new_tokens_is_20_as_the_proto_says() -> None:
    async with running_engine() as engine:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT))
        unary = await engine.vllm.Generate(request)
    assert unary.outputs.finish_info.finish_reason == pb.FinishInfo.LENGTH
    assert unary.outputs.num_tokens == unary.outputs.finish_info.num_output_tokens == 20
    # Neither token ids is sent unless asked for.
    assert list(unary.outputs.token_ids) == [] and list(unary.prompt_info.token_ids) == []


WITH_METRICS = sim_config(metrics_listen="127.0.0.1:0")


def _counter(metrics: str, name: str) -> float:
    """The sim engine's `kvplane_engine_<name>_total` (0 before its first increment)."""
    pattern = rf'^kvplane_engine_{name}_total\{{model="sim"\}} (\S+)$'
    found = re.search(pattern, metrics, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


async def _counted_after(engine: Any, request: pb.GenerateRequest, name: str) -> float:
    """Send `request` (unary), then the counter `name` once the request's prompt is counted:
    the counters are counted from the engine's step report, which may reach the event loop
    after the answer did."""
    prompts = _counter(await metrics_text(engine), "prompt_tokens")
    await engine.vllm.Generate(request)

    async def its_prompt_counted() -> bool:
        return _counter(await metrics_text(engine), "prompt_tokens") > prompts

    await eventually(its_prompt_counted, what="the request's prompt counted")
    return _counter(await metrics_text(engine), name)


def _with_kv_transfer_params() -> pb.GenerateRequest:
    request = pb.GenerateRequest()
    request.kv.kv_transfer_params.update({"do_remote_prefill": True})
    return request


@pytest.mark.parametrize(
    ("options", "code", "needle"),
    [
        (
            pb.GenerateRequest(decoding=pb.DecodingParameters(logit_bias={5000: 1.0})),
            grpc.StatusCode.INVALID_ARGUMENT,
            "logit_bias: token id 5000 >= vocab size 1000",
        ),
        (
            pb.GenerateRequest(decoding=pb.DecodingParameters(allowed_token_ids=[5, 1000])),
            grpc.StatusCode.INVALID_ARGUMENT,
            "allowed_token_ids: token id 1000 >= vocab size 1000",
        ),
        (_with_kv_transfer_params(), grpc.StatusCode.FAILED_PRECONDITION, "kv.session"),
        (pb.GenerateRequest(text="hello"), grpc.StatusCode.INVALID_ARGUMENT, "no tokenizer"),
    ],
    ids=["logit_bias_vocab", "allowed_token_ids_vocab", "kv_transfer_params", "no_tokenizer"],
)
async def test_options_the_engine_does_not_implement_are_refused(
    options: pb.GenerateRequest, code: grpc.StatusCode, needle: str
) -> None:
    """Refused before acceptance, never silently ignored: a bias or an allow-list naming a
    token outside the vocabulary (as vLLM), vLLM's KV connector parameters (KV moves through
    OpenEngine's kv.session), a text prompt on the sim runner (no tokenizer)."""
    async with running_engine() as engine:
        request = _request()
        request.MergeFrom(options)
        events, error = await stream_error(engine.vllm.GenerateStream(request))
        assert events == []
        assert error.code() == code, error
        assert needle in (error.details() or ""), error.details()
        assert await idle(engine)


def with_newer_vllm_fields(request: pb.GenerateRequest) -> pb.GenerateRequest:
    """`request` as a client built on today's vLLM proto sends it, with `lora_name` = "x"
    (GenerateRequest field 15, a string) and `skip_special_tokens` = false (ResponseOptions
    field 8, a bool): fields the seed's schema does not have."""
    newer = pb.GenerateRequest.FromString(request.SerializeToString() + b"\x7a\x01x")
    newer.response.MergeFromString(b"\x40\x00")
    return newer


async def test_fields_of_a_newer_vllm_proto_are_refused_not_ignored() -> None:
    """A LoRA name or a decoding option this server's proto lacks would otherwise be dropped
    by protobuf and the request served as if they were not sent (the base model's answer):
    INVALID_ARGUMENT naming where each one is, before acceptance, unary and streaming."""
    async with running_engine() as engine:
        newer = with_newer_vllm_fields(_request())
        unary = await rpc_error(engine.vllm.Generate(newer))
        events, streamed = await stream_error(engine.vllm.GenerateStream(newer))
        assert events == []
        for error in (unary, streamed):
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "GenerateRequest field 15" in (error.details() or ""), error.details()
            assert "GenerateRequest.response field 8" in (error.details() or "")
        assert await idle(engine)
        served = await engine.vllm.Generate(_request())  # the seed's fields alone: served
    assert served.outputs.finish_info.finish_reason == pb.FinishInfo.LENGTH


async def test_an_empty_kv_transfer_params_is_no_parameter() -> None:
    async with running_engine() as engine:
        request = _request()
        request.kv.kv_transfer_params.SetInParent()
        unary = await engine.vllm.Generate(request)
    assert unary.outputs.finish_info.finish_reason == pb.FinishInfo.LENGTH


@pytest.mark.parametrize(
    ("max_new_tokens", "details"),
    [
        (0, "min_new_tokens 21 exceeds max_new_tokens 0 (0 means 20)"),
        (10, "min_new_tokens 21 exceeds max_new_tokens 10"),
    ],
)
async def test_min_new_tokens_above_max_new_tokens_is_refused_in_the_protos_names(
    max_new_tokens: int, details: str
) -> None:
    async with running_engine() as engine:
        request = _request(
            stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens, min_new_tokens=21)
        )
        error = await rpc_error(engine.vllm.Generate(request))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == details


async def test_truncate_prompt_tokens_keeps_the_last_tokens() -> None:
    """vLLM truncates on the left: the request runs on the prompt's last N tokens (the
    controller's gateway routes on those too); N beyond the prompt keeps all of it."""
    async with running_engine(WITH_METRICS) as engine:
        for truncate, kept in ((6, PROMPT[-6:]), (len(PROMPT) + 1, PROMPT)):
            request = _request()
            request.truncate_prompt_tokens = truncate
            before = _counter(await metrics_text(engine), "prompt_tokens")
            computed = await _counted_after(engine, request, "prompt_tokens") - before
            unary = await engine.vllm.Generate(request)
            assert list(unary.prompt_info.token_ids) == kept
            assert unary.prompt_info.num_prompt_tokens == computed == len(kept)


async def test_ignore_eos_and_min_new_tokens_keep_generating_past_the_eos() -> None:
    config = sim_config(sim=SimTimingConfig(time_scale=0.0, vocab_size=1000, eos_after=3))
    async with running_engine(config) as engine:
        plain = await engine.vllm.Generate(_request())
        assert plain.outputs.finish_info.HasField("eos_token_id")  # the third token
        for stopping in (
            pb.StoppingCriteria(max_new_tokens=5, ignore_eos=True),
            pb.StoppingCriteria(max_new_tokens=5, min_new_tokens=4),
        ):
            unary = await engine.vllm.Generate(_request(stopping=stopping))
            assert unary.outputs.finish_info.finish_reason == pb.FinishInfo.LENGTH, stopping
            assert unary.outputs.num_tokens == unary.outputs.finish_info.num_output_tokens == 5


async def test_duplicate_id_then_client_cancel_frees_the_engine() -> None:
    """A request id already running is refused (ALREADY_EXISTS); a client that cancels its
    GenerateStream, or a unary Generate still queued, cancels the request."""
    async with running_engine(ONE_SEAT) as engine:
        running = await _take_the_seat(engine)
        duplicate = _request()
        duplicate.request_id = "running"
        refused = await rpc_error(engine.vllm.Generate(duplicate))
        assert refused.code() == grpc.StatusCode.ALREADY_EXISTS, refused
        queued_request = _request()
        queued_request.request_id = "queued"
        queued = engine.vllm.Generate(queued_request)

        async def is_queued() -> bool:
            return (await engine.stub.GetLoad(oe.GetLoadRequest())).queued_requests == 1

        await eventually(is_queued, what="the unary request queued")
        queued.cancel()
        running.cancel()
        await eventually(lambda: idle(engine), what="engine idle after the clients cancelled")
        # Both ids are free again: the engine forgot them.
        for request_id in ("running", "queued"):
            again = _request()
            again.request_id = request_id
            finished = await engine.vllm.Generate(again)
            assert finished.outputs.finish_info.finish_reason == pb.FinishInfo.LENGTH


async def _read_to_the_end(stream: Any) -> None:
    while await asyncio.wait_for(stream.read(), timeout=20) is not grpc.aio.EOF:
        pass


async def test_runner_failure_after_acceptance_is_internal() -> None:
    """This proto has no error event: a failure after acceptance is the INTERNAL status (before
    or after responses were sent), one line without a traceback, and nothing is left behind."""
    async with running_engine(ONE_SEAT) as engine:
        runner = engine.app.service.engine_loop.core.runner
        healthy = runner.execute

        def broken(batch: object) -> list[object]:
            raise RuntimeError("device lost")

        running = await _take_the_seat(engine)  # its first responses were sent
        runner.execute = broken  # type: ignore[method-assign,assignment]
        mid_stream = await rpc_error(lambda: _read_to_the_end(running))
        unary = await rpc_error(engine.vllm.Generate(_request()))
        for error in (mid_stream, unary):
            assert error.code() == grpc.StatusCode.INTERNAL, error
            assert "Traceback" not in (error.details() or "")
        runner.execute = healthy  # type: ignore[method-assign]
        ok = await engine.vllm.Generate(_request())
        assert ok.outputs.finish_info.finish_reason == pb.FinishInfo.LENGTH
        await eventually(lambda: idle(engine), what="engine idle after the failed steps")


async def test_cache_salt_and_bypass_prefix_cache() -> None:
    """`kv.cache_salt` namespaces the prefix cache (what a request computes is reused only by
    requests with the same salt); `kv.bypass_prefix_cache` reuses nothing but still caches,
    as vLLM's skip_reading_prefix_cache."""
    async with running_engine(WITH_METRICS) as engine:
        salted = _request(kv=pb.KVCacheParameters(cache_salt="tenant-a"))
        await engine.vllm.Generate(salted)

        async def openengine_cached(salt: str) -> int:
            responses = await collect(
                engine.stub, generate_request(PROMPT, kv=oe.KvOptions(cache_salt=salt))
            )
            return int(responses[-1].usage.cached_prompt_tokens)

        assert await openengine_cached("") == 0  # the salted blocks are not for others
        assert await openengine_cached("tenant-a") == 20  # all but the last token's block

        # The unsalted prompt is cached now (by the OpenEngine request above).
        before = _counter(await metrics_text(engine), "cached_prompt_tokens")
        bypassed = _request(kv=pb.KVCacheParameters(bypass_prefix_cache=True))
        assert await _counted_after(engine, bypassed, "cached_prompt_tokens") == before
        assert await _counted_after(engine, _request(), "cached_prompt_tokens") == before + 20


async def test_a_draining_engine_refuses_new_work_and_aborts_at_its_deadline() -> None:
    """Drain (OpenEngine's) covers vllm.Generate too: a new request is UNAVAILABLE (retryable,
    as a gateway reads it) and a running stream ends ABORTED when the drain aborts it."""
    async with running_engine(ONE_SEAT) as engine:
        running = await _take_the_seat(engine)
        drain = oe.DrainRequest(
            stop_accepting_new_requests=True, deadline_ms=0, abort_after_deadline=True
        )
        states = [r.state async for r in engine.stub.Drain(drain)]
        assert states[-1] == oe.DRAIN_STATE_COMPLETE
        last: pb.GenerateResponse | None = None
        while (response := await asyncio.wait_for(running.read(), timeout=20)) is not grpc.aio.EOF:
            assert isinstance(response, pb.GenerateResponse)
            last = response
        assert last is not None
        assert last.outputs.finish_info.finish_reason == pb.FinishInfo.ABORTED
        refused = await rpc_error(engine.vllm.Generate(_request()))
        assert refused.code() == grpc.StatusCode.UNAVAILABLE, refused
        _, streamed = await stream_error(engine.vllm.GenerateStream(_request()))
        assert streamed.code() == grpc.StatusCode.UNAVAILABLE, streamed
        assert await idle(engine)


async def test_an_aborted_unary_generate_answers_aborted_not_an_error() -> None:
    """Abort by request id ends a unary Generate with its response (status OK), finish reason
    ABORTED, as vLLM's server answers an aborted request."""
    async with running_engine(ONE_SEAT) as engine:
        running = await _take_the_seat(engine)
        queued = _request()
        queued.request_id = "queued"
        call = engine.vllm.Generate(queued)

        async def is_queued() -> bool:
            return (await engine.stub.GetLoad(oe.GetLoadRequest())).queued_requests == 1

        await eventually(is_queued, what="the unary request queued")
        await engine.stub.Abort(oe.AbortRequest(request_id="queued"))
        unary = await asyncio.wait_for(call, timeout=20)
        running.cancel()
    assert unary.outputs.finish_info.finish_reason == pb.FinishInfo.ABORTED
    assert unary.outputs.finish_info.num_output_tokens == unary.outputs.num_tokens == 0
    assert unary.prompt_info.num_prompt_tokens == len(PROMPT)


async def _vllm_health(engine: Engine) -> int:
    reply = await health_pb2_grpc.HealthStub(engine.channel).Check(
        health_pb2.HealthCheckRequest(service="vllm.Generate")
    )
    return int(reply.status)


@pytest.mark.parametrize("how", ["drain", "engine_thread_ends"])
async def test_grpc_health_of_vllm_generate_turns_not_serving_once_no_request_is_taken(
    how: str,
) -> None:
    """This proto has no health of its own: as vLLM's server turns its service NOT_SERVING when
    its engine fails or shuts down, `grpc.health.v1` says NOT_SERVING for `vllm.Generate` once
    the engine takes no new requests (drained, or its engine thread gone). The empty name
    stays SERVING (the process is up: what `kvplane up` and a liveness probe ask)."""
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    async with running_engine() as engine:
        assert await _vllm_health(engine) == serving
        if how == "drain":
            drain = oe.DrainRequest(stop_accepting_new_requests=True, deadline_ms=0)
            assert [r.state async for r in engine.stub.Drain(drain)][-1] == (
                oe.DRAIN_STATE_COMPLETE
            )
        else:
            await asyncio.to_thread(engine.app.service.engine_loop.stop, 10.0)

        async def not_serving_now() -> bool:
            return bool(await _vllm_health(engine) == not_serving)

        await eventually(not_serving_now, what="vllm.Generate NOT_SERVING")
        refused = await rpc_error(engine.vllm.Generate(_request()))
        assert refused.code() == grpc.StatusCode.UNAVAILABLE, refused
        whole = await health_pb2_grpc.HealthStub(engine.channel).Check(
            health_pb2.HealthCheckRequest()
        )
        assert whole.status == serving


@pytest.mark.parametrize("role", [EngineRoleName.prefill, EngineRoleName.decode])
async def test_grpc_health_of_vllm_generate_is_not_serving_on_a_disaggregated_engine(
    role: EngineRoleName,
) -> None:
    """`vllm.Generate` runs on an AGGREGATED engine only: a PREFILL or DECODE engine refuses
    every request it gets, so its `vllm.Generate` health says NOT_SERVING (a probe pointed at
    it must not send it traffic) while its process, and OpenEngine Health, are up."""
    async with running_engine(sim_config(role=role)) as engine:
        assert await _vllm_health(engine) == health_pb2.HealthCheckResponse.NOT_SERVING
        refused = await rpc_error(engine.vllm.Generate(_request()))
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION, refused
        assert "AGGREGATED engine only" in (refused.details() or "")
        health_reply = await engine.stub.Health(oe.HealthRequest())
        assert health_reply.state == oe.HEALTH_STATE_READY
        whole = await health_pb2_grpc.HealthStub(engine.channel).Check(
            health_pb2.HealthCheckRequest()
        )
        assert whole.status == health_pb2.HealthCheckResponse.SERVING


async def test_grpc_health_of_vllm_generate_is_not_serving_before_the_engine_thread_runs() -> None:
    """A probe must never read SERVING for `vllm.Generate` before OpenEngine Health says
    READY: the status is set before the server starts (`Service.reports_own_health`), NOT_SERVING
    while the engine thread has not started, and turns SERVING once it runs. As `start_engine`
    builds an engine, but with the servers up before the engine thread starts, which in a real
    process is too short a moment to probe: an engine service over a second engine loop on a
    running engine's core, started only once the first loop stopped."""
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    async with running_engine() as engine:
        app = engine.app
        service = EngineService(
            EngineLoop(app.service.engine_loop.core),
            app.service.model,
            app.service.kv_log,
            app.service.runtime_events,
            None,
        )
        ctx = EngineContext(
            model=app.service.model,
            role=oe.ENGINE_ROLE_AGGREGATED,
            data_parallel_rank=0,
            encode=None,
        )
        openengine = OpenEngineServicer(service, ctx, instance_id="idle", token_text=str)
        vllm = VllmGenerateServicer(service, ctx)
        health_servicer = health.aio.HealthServicer()
        await vllm.report_health(health_servicer)
        server, port = await create_server(
            sim_config(),
            [openengine.service(), vllm.service()],
            health_servicer=health_servicer,
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                probe = health_pb2_grpc.HealthStub(channel)
                watch = probe.Watch(health_pb2.HealthCheckRequest(service="vllm.Generate"))
                assert (await watch.read()).status == not_serving
                health_reply = await oe_grpc.OpenEngineStub(channel).Health(oe.HealthRequest())
                assert health_reply.state == oe.HEALTH_STATE_NOT_READY

                await asyncio.to_thread(app.service.engine_loop.stop, 10.0)
                service.engine_loop.start()  # as start_engine does, the servers up
                await vllm.update_health()
                assert (await watch.read()).status == serving
                health_reply = await oe_grpc.OpenEngineStub(channel).Health(oe.HealthRequest())
                assert health_reply.state == oe.HEALTH_STATE_READY
                watch.cancel()
                whole = await probe.Check(health_pb2.HealthCheckRequest())
                assert whole.status == serving
        finally:
            await service.close(0)
            await server.stop(0)


async def test_a_minimum_the_context_cannot_hold_is_refused_not_cut_short() -> None:
    """As vLLM's server (the minimum above the maximum once that is capped at the context):
    a `min_new_tokens` larger than what the context leaves after the prompt could only end
    LENGTH short of it, so it is INVALID_ARGUMENT before acceptance; the most the context
    holds is served."""
    async with running_engine() as engine:  # max_model_len 256, a prompt of 24: room for 232
        request = _request(stopping=pb.StoppingCriteria(max_new_tokens=1000, min_new_tokens=233))
        events, error = await stream_error(engine.vllm.GenerateStream(request))
        assert events == []
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert "232" in (error.details() or ""), error.details()
        assert await idle(engine)
        request.stopping.min_new_tokens = 232
        served = await engine.vllm.Generate(request)
    assert served.outputs.finish_info.num_output_tokens == 232


@pytest.mark.parametrize(
    ("ignore_eos", "reason"), [(False, "eos_token_id"), (True, "stop_token_id")]
)
async def test_the_eos_listed_as_a_stop_id_is_reported_as_the_eos(
    ignore_eos: bool, reason: str
) -> None:
    """vLLM checks the EOS before the stop ids (`check_stop`), so a client that also lists the
    EOS in `stop_token_ids` is told `eos_token_id`; with `ignore_eos` the EOS is only a stop id
    and so reported."""
    config = sim_config(sim=SimTimingConfig(time_scale=0.0, vocab_size=1000, eos_after=3))
    async with running_engine(config) as engine:
        eos = (await engine.vllm.Generate(_request())).outputs.finish_info.eos_token_id
        request = _request(
            stopping=pb.StoppingCriteria(
                max_new_tokens=5, stop_token_ids=[eos], ignore_eos=ignore_eos
            )
        )
        finish = (await engine.vllm.Generate(request)).outputs.finish_info
    assert finish.finish_reason == pb.FinishInfo.STOP
    assert finish.WhichOneof("stop_reason") == reason
    assert getattr(finish, reason) == eos
