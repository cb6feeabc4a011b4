"""OpenEngine Generate through a real gRPC client: streaming contract, errors by phase, abort,
client cancellation and drain (sim runner)."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import grpc
import pytest

from engine.config import EngineConfig, SimTimingConfig
from engine.core.engine_core import EngineCore
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.engine.engine_server_harness import (
    Engine,
    collect,
    engine_thread_held,
    generate_request,
    idle,
    rpc_error,
    running_engine,
    sim_config,
    stream_error,
)
from tests.polling import eventually
from vllm_grpc import vllm_grpc_pb2 as vpb
from vllm_grpc import vllm_grpc_pb2_grpc as vllm_grpc

pytestmark = pytest.mark.timeout(60)

PROMPT = list(range(10, 50))  # 40 tokens = 10 blocks of 4


async def test_stream_contract_with_two_outputs() -> None:
    async with running_engine() as engine:
        responses = await collect(engine.stub, generate_request(PROMPT, max_tokens=5, n=2))
    tokens: Counter[int] = Counter()
    finished: Counter[int] = Counter()
    for i, r in enumerate(responses):
        assert r.request_id == responses[0].request_id != ""
        kind = r.WhichOneof("event")
        if kind == "token":
            assert r.token.HasField("output_index")  # present even for index 0
            assert not finished[r.token.output_index]  # nothing after its GenerationFinished
            tokens[r.token.output_index] += len(r.token.tokens)
        elif kind == "finished":
            assert r.finished.HasField("output_index")
            assert r.finished.reason == pb.FINISH_REASON_LENGTH
            finished[r.finished.output_index] += 1
        else:
            raise AssertionError(f"unexpected event {kind}")
        assert r.HasField("usage") == (i == len(responses) - 1)  # Usage only on the final
    assert tokens == {0: 5, 1: 5}  # deltas: 5 tokens each, never cumulative
    assert finished == {0: 1, 1: 1}
    usage = responses[-1].usage
    assert responses[-1].WhichOneof("event") == "finished"
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (40, 10, 50)
    assert usage.HasField("cached_prompt_tokens")
    # What the prompt found cached: nothing (output 1 takes the blocks output 0 computes in
    # the same step as hits, but the prompt was not cached when it came; vLLM's streamed usage).
    assert usage.cached_prompt_tokens == 0


async def test_cached_prompt_tokens_reports_prefix_hits() -> None:
    async with running_engine() as engine:
        first = await collect(engine.stub, generate_request(PROMPT))
        second = await collect(engine.stub, generate_request([*PROMPT, 7, 8, 9, 1]))
        salted = await collect(
            engine.stub, generate_request(PROMPT, kv=pb.KvOptions(cache_salt="tenant-b"))
        )
        # An empty salt is no namespace: the same block keys (the indexer's and the
        # gateway's view), so the same hits.
        empty_salt = await collect(
            engine.stub, generate_request(PROMPT, kv=pb.KvOptions(cache_salt=""))
        )
        bypass = await collect(
            engine.stub, generate_request(PROMPT, kv=pb.KvOptions(bypass_prefix_cache=True))
        )
        # The seed: bypassing skips reuse but still caches what it computes.
        fresh = list(range(100, 140))
        bypass_fresh = await collect(
            engine.stub, generate_request(fresh, kv=pb.KvOptions(bypass_prefix_cache=True))
        )
        after_bypass = await collect(engine.stub, generate_request(fresh))
        # Two outputs of a new prompt: the second hits what the first computes, but the
        # prompt found nothing cached (what the router predicts, and checks it against).
        other = list(range(200, 240))
        two_fresh = await collect(engine.stub, generate_request(other, n=2))
        two_again = await collect(engine.stub, generate_request(other, n=2))
    assert first[-1].usage.cached_prompt_tokens == 0
    assert two_fresh[-1].usage.cached_prompt_tokens == 0
    assert two_again[-1].usage.cached_prompt_tokens == 36  # all but the last token's block
    assert bypass_fresh[-1].usage.cached_prompt_tokens == 0
    assert after_bypass[-1].usage.cached_prompt_tokens == 36  # all but the last token's block
    # All 10 full prompt blocks of the first request are reused.
    assert second[-1].usage.cached_prompt_tokens == 40
    assert salted[-1].usage.cached_prompt_tokens == 0  # another namespace
    assert empty_salt[-1].usage.cached_prompt_tokens == 36  # all but the last token's block
    assert bypass[-1].usage.cached_prompt_tokens == 0


async def test_output_logprobs_and_prompt_output() -> None:
    async with running_engine() as engine:
        request = generate_request(
            PROMPT[:6],
            max_tokens=2,
            response=pb.ResponseOptions(
                return_prompt_logprobs=True,
                return_output_logprobs=True,
                output_candidates=pb.CandidateTokenSelection(top_n=1),
            ),
        )
        responses = await collect(engine.stub, request)
    prompts = [r.prompt for r in responses if r.WhichOneof("event") == "prompt"]
    assert len(prompts) == 1
    assert [t.token_id for t in prompts[0].tokens] == PROMPT[:6]
    first, rest = prompts[0].tokens[0], prompts[0].tokens[1:]
    assert not first.HasField("logprob") and not first.HasField("rank")  # no conditional prob
    assert all(t.HasField("logprob") and t.HasField("rank") for t in rest)
    out = [t for r in responses if r.WhichOneof("event") == "token" for t in r.token.tokens]
    assert len(out) == 2
    assert all(t.HasField("logprob") and len(t.candidates) == 1 for t in out)


async def test_candidates_follow_the_selection_on_the_sim_runner() -> None:
    """The seed: candidate entries follow the prompt or output candidate selection. The sim's
    distribution puts -1.0 on the token at each position (rank 1) and spreads the rest over
    the other tokens (a tie at rank 2): top_n gives n, most likely first, explicit ids
    exactly those, `all` the whole vocabulary, and logprobs asked without a selection none."""

    async def tokens(response: pb.ResponseOptions) -> tuple[list[Any], list[Any]]:
        request = generate_request(PROMPT[:4], max_tokens=2, response=response)
        events = await collect(engine.stub, request)
        prompt = [t for e in events if e.HasField("prompt") for t in e.prompt.tokens]
        output = [t for e in events if e.HasField("token") for t in e.token.tokens]
        return prompt[1:], output  # the first prompt token has no conditional probability

    async with running_engine() as engine:  # a vocabulary of 1000
        prompt, output = await tokens(
            pb.ResponseOptions(
                prompt_candidates=pb.CandidateTokenSelection(token_ids=pb.TokenIds(ids=[5, 12])),
                output_candidates=pb.CandidateTokenSelection(top_n=3),
            )
        )
        everything, plain = await tokens(
            pb.ResponseOptions(
                prompt_candidates=pb.CandidateTokenSelection(all=pb.AllCandidates()),
                return_output_logprobs=True,
            )
        )
    other = math.log((1 - math.exp(-1)) / 999)
    for token in prompt:  # explicit ids: exactly those, in order; 12 is the token at position 2
        got = [(c.token_id, c.rank) for c in token.candidates]
        assert got == [(5, 1 if token.token_id == 5 else 2), (12, 1 if token.token_id == 12 else 2)]
        for c in token.candidates:
            assert c.logprob == pytest.approx(-1.0 if c.token_id == token.token_id else other)
    assert len(output) == 2
    for token in output:
        assert (token.logprob, token.rank) == (-1.0, 1)
        assert [c.rank for c in token.candidates] == [1, 2, 2]
        assert token.candidates[0].token_id == token.token_id
        assert len({c.token_id for c in token.candidates}) == 3
    for token in everything:
        assert sorted(c.token_id for c in token.candidates) == list(range(1000))
        assert math.fsum(math.exp(c.logprob) for c in token.candidates) == pytest.approx(1.0)
    assert all(t.HasField("logprob") and not t.candidates for t in plain)


@pytest.mark.parametrize(
    ("request_fields", "code"),
    [
        ({"model": "no-such-model"}, grpc.StatusCode.NOT_FOUND),
        ({"sampling": pb.SamplingParams(num_sequences=0)}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"sampling": pb.SamplingParams(top_p=0.0)}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"prompt": "text needs a tokenizer"}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"guided": pb.GuidedDecoding(regex="a+")}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"media": [pb.MediaItem(url="http://x/y.png")]}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"lora_name": "adapter"}, grpc.StatusCode.FAILED_PRECONDITION),
        (
            {"kv": pb.KvOptions(session=pb.KvSessionRef(session_id="s"))},
            grpc.StatusCode.FAILED_PRECONDITION,  # a DECODE-role request on an AGGREGATED engine
        ),
        (
            {"kv": pb.KvOptions(data_parallel_rank=3)},
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        # Candidates with their logprobs explicitly refused (false is a value, not the
        # default): a contradiction, not logprobs sent against the flag.
        (
            {
                "response": pb.ResponseOptions(
                    return_prompt_logprobs=False,
                    prompt_candidates=pb.CandidateTokenSelection(top_n=2),
                )
            },
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            {
                "response": pb.ResponseOptions(
                    return_output_logprobs=False,
                    output_candidates=pb.CandidateTokenSelection(all=pb.AllCandidates()),
                )
            },
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
    ],
)
async def test_refused_before_acceptance(request_fields: dict[str, object], code: object) -> None:
    async with running_engine() as engine:
        request = generate_request(PROMPT)
        for name, value in request_fields.items():
            if name == "prompt":
                request.prompt = str(value)
            elif name == "media":
                assert isinstance(value, list)
                request.media.extend(value)
            elif isinstance(value, str):
                setattr(request, name, value)
            else:
                getattr(request, name).CopyFrom(value)
        events, error = await stream_error(engine.stub.Generate(request))
        assert events == []  # before acceptance: a status, no event
        assert error.code() == code
        assert "Traceback" not in (error.details() or "")
        assert await idle(engine)  # nothing leaked


async def test_bad_prompts_are_refused_and_leak_nothing() -> None:
    async with running_engine() as engine:
        no_input = pb.GenerateRequest(stopping=pb.StoppingOptions(max_tokens=2))
        too_long = generate_request(list(range(300)))  # context is 256
        big_id = generate_request([5, 1000])  # vocab is 1000
        empty = generate_request([])
        for request in (no_input, too_long, big_id, empty):
            events, error = await stream_error(engine.stub.Generate(request))
            assert events == []
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert await idle(engine)


async def test_stop_token_and_eos_finish_with_stop_match() -> None:
    config = sim_config(sim=SimTimingConfig(time_scale=0.0, vocab_size=1000, eos_after=3))
    async with running_engine(config) as engine:
        eos = await collect(engine.stub, generate_request(PROMPT, max_tokens=10))
        finished = eos[-1].finished
        assert finished.reason == pb.FINISH_REASON_STOP
        assert finished.stop_match.WhichOneof("match") == "eos_token_id"
        emitted = [
            t.token_id for r in eos if r.WhichOneof("event") == "token" for t in r.token.tokens
        ]
        assert len(emitted) == 2  # the EOS itself is not output
        assert eos[-1].usage.completion_tokens == 3
        stop_on = emitted[1]
        request = generate_request(PROMPT, max_tokens=10)
        request.stopping.conditions.append(pb.StopCondition(stop_token_id=stop_on))
        request.stopping.include_stop_in_output = True
        stopped = await collect(engine.stub, request)
        assert stopped[-1].finished.stop_match.stop_token_id == stop_on
        out = [
            t.token_id for r in stopped if r.WhichOneof("event") == "token" for t in r.token.tokens
        ]
        assert out == emitted[:2]


def _slow_config() -> EngineConfig:
    # Steps take real (sim) time, so a long request is still running when we act on it.
    return sim_config(
        sim=SimTimingConfig(time_scale=0.5, vocab_size=1000), max_model_len=4096, num_kv_blocks=2048
    )


async def _first_token(stream: Any) -> pb.GenerateResponse:
    response: pb.GenerateResponse = await asyncio.wait_for(stream.read(), timeout=20)
    assert response.WhichOneof("event") == "token"
    return response


async def _rest(stream: Any) -> list[Any]:
    """Read a stream to its end with `read()` (iteration may not follow `read()`)."""
    got: list[Any] = []
    while True:
        response = await asyncio.wait_for(stream.read(), timeout=20)
        if response is grpc.aio.EOF:
            return got
        got.append(response)


async def test_abort_mid_stream_then_already_finished() -> None:
    async with running_engine(_slow_config()) as engine:
        stream = engine.stub.Generate(generate_request(PROMPT, max_tokens=3000, request_id="long"))
        await _first_token(stream)
        duplicate = engine.stub.Generate(generate_request(PROMPT, request_id="long"))
        _, error = await stream_error(duplicate)
        assert error.code() == grpc.StatusCode.ALREADY_EXISTS

        aborted = await engine.stub.Abort(pb.AbortRequest(request_id="long"))
        assert aborted.status == pb.ABORT_STATUS_ABORTED
        rest = await _rest(stream)
        assert rest[-1].finished.reason == pb.FINISH_REASON_CANCELLED
        assert rest[-1].HasField("usage")
        assert sum(r.WhichOneof("event") == "finished" for r in rest) == 1

        again = await engine.stub.Abort(pb.AbortRequest(request_id="long"))
        assert again.status == pb.ABORT_STATUS_ALREADY_FINISHED
        for bad, code in [
            (pb.AbortRequest(request_id="never-seen"), grpc.StatusCode.NOT_FOUND),
            (
                pb.AbortRequest(kv_session=pb.KvSessionRef(session_id="s")),
                grpc.StatusCode.NOT_FOUND,
            ),
            (pb.AbortRequest(), grpc.StatusCode.INVALID_ARGUMENT),
            # An empty id is a malformed target, not an unknown one.
            (pb.AbortRequest(request_id=""), grpc.StatusCode.INVALID_ARGUMENT),
            (pb.AbortRequest(kv_session=pb.KvSessionRef()), grpc.StatusCode.INVALID_ARGUMENT),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await engine.stub.Abort(bad)
            assert info.value.code() == code
        await eventually(lambda: idle(engine), what="engine idle after abort")


async def test_abort_all_and_client_cancel_free_everything() -> None:
    async with running_engine(_slow_config()) as engine:
        streams = [
            engine.stub.Generate(generate_request(PROMPT, max_tokens=3000, request_id=f"r{i}"))
            for i in range(2)
        ]
        for stream in streams:
            await _first_token(stream)
        result = await engine.stub.Abort(pb.AbortRequest(all_requests=pb.AllRequests()))
        assert result.status == pb.ABORT_STATUS_ABORTED
        for stream in streams:
            rest = await _rest(stream)
            assert rest[-1].finished.reason == pb.FINISH_REASON_CANCELLED

        gone = engine.stub.Generate(generate_request(PROMPT, max_tokens=3000, request_id="gone"))
        await _first_token(gone)
        gone.cancel()  # the client goes away: the engine stops the work
        await eventually(lambda: idle(engine), what="engine idle after client cancel")


@contextmanager
def _abort_of_all_failing(core: EngineCore) -> Iterator[None]:
    """Within: `core`'s abort of every request fails after it ended them (as one whose freeing
    of their resources raises), their ends never emitted."""
    with pytest.MonkeyPatch.context() as patch:
        ends_them = core.abort_all

        def failing(*args: Any) -> list[Any]:
            ends_them(*args)
            raise RuntimeError("freeing the requests' resources failed")

        patch.setattr(core, "abort_all", failing)
        yield


async def test_an_abort_of_all_that_fails_in_the_engine_is_answered_internal() -> None:
    """Abort of all requests, and the core's abort of them all fails after it ended them (as
    one whose freeing of their resources raises), their ends never emitted: the call answers
    INTERNAL saying so, every stream ends with an INTERNAL error, and the engine goes idle and
    serves the next request. The call used to wait for ever, and the streams too."""
    async with running_engine(_slow_config()) as engine:
        core = engine.app.service.engine_loop.core
        streams = [
            engine.stub.Generate(generate_request(PROMPT, max_tokens=3000, request_id=f"r{i}"))
            for i in range(2)
        ]
        for stream in streams:
            await _first_token(stream)
        with _abort_of_all_failing(core):
            failed = await rpc_error(
                asyncio.wait_for(
                    engine.stub.Abort(pb.AbortRequest(all_requests=pb.AllRequests())), timeout=20
                )
            )
        assert failed.code() == grpc.StatusCode.INTERNAL
        assert "aborting every request failed" in (failed.details() or "")
        for stream in streams:
            rest = await _rest(stream)
            assert rest[-1].WhichOneof("event") == "error"
            assert rest[-1].error.code == pb.ERROR_CODE_INTERNAL
        await eventually(lambda: idle(engine), what="engine idle after the failed abort")
        responses = await collect(engine.stub, generate_request(PROMPT, request_id="r0"))
        assert responses[-1].finished.reason == pb.FINISH_REASON_LENGTH


async def test_drain_stops_admission_and_completes_when_work_ends() -> None:
    async with running_engine(_slow_config()) as engine:
        stream = engine.stub.Generate(generate_request(PROMPT, max_tokens=3000, request_id="d"))
        await _first_token(stream)
        drain = engine.stub.Drain(pb.DrainRequest(stop_accepting_new_requests=True))
        started: Any = await asyncio.wait_for(drain.read(), timeout=10)
        assert started.state == pb.DRAIN_STATE_STARTED
        assert started.HasField("in_flight_requests") and started.in_flight_requests == 1

        events, refused = await stream_error(engine.stub.Generate(generate_request(PROMPT)))
        assert events == [] and refused.code() == grpc.StatusCode.UNAVAILABLE
        health = await engine.stub.Health(pb.HealthRequest())
        assert health.state == pb.HEALTH_STATE_DRAINING

        await engine.stub.Abort(pb.AbortRequest(request_id="d"))
        rest = await _rest(drain)
        assert rest[-1].state == pb.DRAIN_STATE_COMPLETE
        assert rest[-1].in_flight_requests == 0
        assert all(r.state == pb.DRAIN_STATE_IN_PROGRESS for r in rest[:-1])


async def test_drain_that_keeps_admission_open_waits_for_new_requests_too() -> None:
    """stop_accepting_new_requests = false: the drain reports and waits, but the engine stays
    READY and admits requests (which the drain then waits for as well)."""
    async with running_engine(_slow_config()) as engine:
        stream = engine.stub.Generate(generate_request(PROMPT, max_tokens=3000, request_id="d"))
        await _first_token(stream)
        drain = engine.stub.Drain(pb.DrainRequest())
        started: Any = await asyncio.wait_for(drain.read(), timeout=10)
        assert started.state == pb.DRAIN_STATE_STARTED and started.in_flight_requests == 1
        health = await engine.stub.Health(pb.HealthRequest())
        assert health.state == pb.HEALTH_STATE_READY
        admitted = await collect(engine.stub, generate_request(PROMPT, max_tokens=1))
        assert admitted[-1].WhichOneof("event") == "finished"

        await engine.stub.Abort(pb.AbortRequest(request_id="d"))
        rest = await _rest(drain)
        assert rest[-1].state == pb.DRAIN_STATE_COMPLETE and rest[-1].in_flight_requests == 0
        assert all(r.state == pb.DRAIN_STATE_IN_PROGRESS for r in rest[:-1])
        after = await collect(engine.stub, generate_request(PROMPT, max_tokens=1))
        assert after[-1].WhichOneof("event") == "finished"  # admission was never closed


async def test_a_larger_priority_is_admitted_first() -> None:
    """OpenEngine's priority: larger values are handled first (vLLM's is the opposite). With
    the one seat taken, the queued request with priority 5 starts before the one with -5."""
    one_seat = sim_config(
        sim=SimTimingConfig(time_scale=0.5, vocab_size=1000),
        max_model_len=4096,
        num_kv_blocks=2048,
        max_num_seqs=1,
    )
    async with running_engine(one_seat) as engine:
        busy = engine.stub.Generate(generate_request(PROMPT, max_tokens=3000, request_id="busy"))
        await _first_token(busy)
        finished: list[str] = []

        async def run(request_id: str, priority: int) -> None:
            request = generate_request(PROMPT, max_tokens=1, request_id=request_id)
            request.priority = priority
            await collect(engine.stub, request)
            finished.append(request_id)

        tasks = [asyncio.create_task(run("lower", -5)), asyncio.create_task(run("higher", 5))]

        async def both_queued() -> bool:
            return (await engine.stub.GetLoad(pb.GetLoadRequest())).queued_requests == 2

        await eventually(both_queued, what="both requests queued")
        await engine.stub.Abort(pb.AbortRequest(request_id="busy"))
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=20)
        busy.cancel()
    assert finished == ["higher", "lower"]


async def test_drain_deadline_zero_aborts_at_once_or_fails_without_abort() -> None:
    async with running_engine(_slow_config()) as engine:
        stream = engine.stub.Generate(generate_request(PROMPT, max_tokens=3000, request_id="x"))
        await _first_token(stream)
        no_abort = [
            r
            async for r in engine.stub.Drain(
                pb.DrainRequest(stop_accepting_new_requests=True, deadline_ms=0)
            )
        ]
        assert no_abort[0].state == pb.DRAIN_STATE_STARTED
        assert no_abort[-1].WhichOneof("event") == "error"  # terminal EngineError, then OK
        assert no_abort[-1].error.code == pb.ERROR_CODE_DRAINING

        with_abort = [
            r
            async for r in engine.stub.Drain(
                pb.DrainRequest(
                    stop_accepting_new_requests=True, deadline_ms=0, abort_after_deadline=True
                )
            )
        ]
        assert with_abort[-1].state == pb.DRAIN_STATE_COMPLETE
        rest = await _rest(stream)
        assert rest[-1].finished.reason == pb.FINISH_REASON_CANCELLED
        await eventually(lambda: idle(engine), what="engine idle after drain")


async def test_a_drain_whose_abort_at_the_deadline_fails_in_the_engine_still_completes() -> None:
    """A drain aborting at its deadline, and the core's abort of every request fails after
    it ended them (their ends never emitted): each request is aborted on its own, so the
    drain still completes (saying the abort failed), every stream ends, and the engine,
    still accepting, serves the next request. The drain used to fail (INTERNAL), leaving
    the KV sessions open, and a shutdown's drain raised before it stopped the engine."""
    async with running_engine(_slow_config()) as engine:
        core = engine.app.service.engine_loop.core
        stream = engine.stub.Generate(generate_request(PROMPT, max_tokens=3000, request_id="x"))
        await _first_token(stream)
        with _abort_of_all_failing(core):
            drain = pb.DrainRequest(deadline_ms=0, abort_after_deadline=True)
            responses = [r async for r in engine.stub.Drain(drain)]
        assert responses[-1].WhichOneof("event") == "state", responses[-1]
        assert responses[-1].state == pb.DRAIN_STATE_COMPLETE
        assert "aborting every request failed" in responses[-1].message
        rest = await _rest(stream)
        assert rest[-1].error.code == pb.ERROR_CODE_INTERNAL
        await eventually(lambda: idle(engine), what="engine idle after the drain")
        served = await collect(engine.stub, generate_request(PROMPT, request_id="x"))
        assert served[-1].finished.reason == pb.FINISH_REASON_LENGTH


@asynccontextmanager
async def _engine_and_slow_reader() -> AsyncIterator[tuple[Engine, grpc.aio.Channel]]:
    """An engine whose requests can outlast a whole window of output (4000 tokens), and a
    channel whose client, once it stops reading, keeps its streams open with their flow-control
    windows full (never cancelling)."""
    config = sim_config(max_model_len=4096, num_kv_blocks=1100)
    async with (
        running_engine(config) as engine,
        grpc.aio.insecure_channel(
            f"127.0.0.1:{engine.app.port}",
            options=[("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)],
        ) as slow_reader,
    ):
        yield engine, slow_reader


async def test_a_drain_aborting_at_its_deadline_completes_past_clients_that_stop_reading() -> None:
    """A client that stops reading (its flow-control window full, never cancelling) keeps its
    stream open as long as it likes; past an aborting deadline the drain waits for the
    engine's work only, which has ended, not for those clients to read it."""
    async with _engine_and_slow_reader() as (engine, slow_reader):
        request = generate_request(PROMPT, max_tokens=4000, request_id="openengine")
        openengine = pb_grpc.OpenEngineStub(slow_reader).Generate(request)
        vllm = vllm_grpc.GenerateStub(slow_reader).GenerateStream(
            vpb.GenerateRequest(
                request_id="vllm",
                token_ids=vpb.TokenIds(ids=PROMPT),
                stopping=vpb.StoppingCriteria(max_new_tokens=4000),
            )
        )
        for call in (openengine, vllm):
            await call.read()  # then never again
        drain = pb.DrainRequest(
            stop_accepting_new_requests=True, deadline_ms=0, abort_after_deadline=True
        )
        # A bound, not a measurement: such a drain used to wait for those clients forever.
        async with asyncio.timeout(30):
            states = [response.state async for response in engine.stub.Drain(drain)]
        assert states[-1] == pb.DRAIN_STATE_COMPLETE
        load = await engine.stub.GetLoad(pb.GetLoadRequest())
        assert (load.running_requests, load.used_kv_blocks) == (0, 0)
        openengine.cancel()
        vllm.cancel()


async def test_a_request_id_stays_taken_until_its_client_has_read_the_end() -> None:
    """A request the engine has ended but whose client has not read the end yet (its
    flow-control window full) still holds its id: a second request with that id is
    ALREADY_EXISTS. It used to be accepted, and the first client going away then cancelled
    the second request (the cancel names the id). Once that client is gone the id is free."""
    async with _engine_and_slow_reader() as (engine, slow_reader):
        first = pb_grpc.OpenEngineStub(slow_reader).Generate(
            generate_request(PROMPT, max_tokens=4000, request_id="same")
        )
        await first.read()  # then never again

        async def engine_done() -> bool:
            load = await engine.stub.GetLoad(pb.GetLoadRequest())
            return (load.running_requests, load.queued_requests) == (0, 0)

        await eventually(engine_done, what="the engine ended the first request")
        _, refused = await stream_error(
            engine.stub.Generate(generate_request(PROMPT, max_tokens=4, request_id="same"))
        )
        assert refused.code() == grpc.StatusCode.ALREADY_EXISTS

        first.cancel()  # the first client goes away: the id is free again

        async def second_runs() -> bool:
            try:
                responses = await collect(
                    engine.stub, generate_request(PROMPT, max_tokens=4, request_id="same")
                )
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.ALREADY_EXISTS, exc
                return False
            assert responses[-1].finished.reason == pb.FINISH_REASON_LENGTH
            assert sum(len(r.token.tokens) for r in responses) == 4
            return True

        await eventually(second_runs, what="the id free once the first client left")
        await eventually(lambda: idle(engine), what="engine idle")


async def _queued(engine: Engine) -> int:
    return (await engine.stub.GetLoad(pb.GetLoadRequest())).queued_requests


async def _retry_before_the_engine_thread_moves(
    engine: Engine, request_id: str
) -> asyncio.Future[list[pb.GenerateResponse]]:
    """With the engine thread still held (so the abort of the dead request `request_id`, queued
    behind the hold, has not run): a retry with the same id is accepted (GetLoad then counts it
    queued beside the dead one the engine thread has not taken in), and once the engine thread
    goes on it runs to its end, untouched by the dead request's (CANCELLED) end."""
    retry = asyncio.ensure_future(
        collect(engine.stub, generate_request(PROMPT, max_tokens=4, request_id=request_id))
    )

    async def accepted_or_answered() -> bool:
        return retry.done() or await _queued(engine) == 2

    await eventually(accepted_or_answered, what="the retry accepted (or refused)")
    if retry.done():  # answered while the engine thread is held: raises what the client got
        await retry
        raise AssertionError("the retry ended while the engine thread was held")
    return retry


async def _ran_to_its_end(engine: Engine, retry: asyncio.Future[list[pb.GenerateResponse]]) -> None:
    """The retry got its whole answer (4 tokens, LENGTH), and nothing is left running."""
    responses = await retry
    assert responses[-1].finished.reason == pb.FINISH_REASON_LENGTH
    assert sum(len(r.token.tokens) for r in responses) == 4
    assert responses[-1].usage.completion_tokens == 4
    await eventually(lambda: idle(engine), what="engine idle")


async def test_a_retry_after_a_late_acceptance_failure_is_accepted_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Accepting a request fails after the engine thread took it (here: its metrics), so the
    client is told INTERNAL and the request is cancelled; the client retries at once with the
    same id. The retry used to be refused ALREADY_EXISTS until the engine thread had run the
    cancel, for a request already dead (the held engine thread keeps that window open here)."""
    async with running_engine(sim_config(metrics_listen="127.0.0.1:0")) as engine:
        service = engine.app.service
        metrics = service.metrics
        assert metrics is not None
        async with engine_thread_held(service):

            def metrics_down(request: object) -> None:
                raise RuntimeError("metrics down")

            monkeypatch.setattr(metrics, "on_accept", metrics_down)
            failed = await rpc_error(
                lambda: collect(engine.stub, generate_request(PROMPT, request_id="same"))
            )
            assert failed.code() == grpc.StatusCode.INTERNAL
            monkeypatch.undo()
            retry = await _retry_before_the_engine_thread_moves(engine, "same")
        await _ran_to_its_end(engine, retry)


async def test_a_retry_after_a_client_cancel_is_accepted_at_once() -> None:
    """A client cancels its request and retries at once with the same id. The retry used to
    be refused ALREADY_EXISTS until the engine thread had run the cancel (the held engine
    thread keeps that window open here), though the id was free as far as the engine's own
    bookkeeping (in flight, Drain) went."""
    async with running_engine() as engine:
        service = engine.app.service
        async with engine_thread_held(service):
            first = engine.stub.Generate(generate_request(PROMPT, request_id="same"))

            async def first_accepted() -> bool:
                return await _queued(engine) == 1

            await eventually(first_accepted, what="the first request accepted")
            first.cancel()  # the client goes away
            await eventually(lambda: service.num_in_flight == 0, what="the cancel seen")
            retry = await _retry_before_the_engine_thread_moves(engine, "same")
        await _ran_to_its_end(engine, retry)


async def test_runner_failure_after_acceptance_is_one_terminal_engine_error() -> None:
    async with running_engine() as engine:
        runner = engine.app.service.engine_loop.core.runner
        healthy = runner.execute

        def broken(batch: object) -> list[object]:
            raise RuntimeError("device lost")

        runner.execute = broken  # type: ignore[method-assign,assignment]
        responses = await collect(engine.stub, generate_request(PROMPT, n=2))
        kinds = [r.WhichOneof("event") for r in responses]
        assert kinds == ["error"]  # accepted, so an event and then OK; nothing after it
        error = responses[-1].error
        assert error.code == pb.ERROR_CODE_INTERNAL
        assert "Traceback" not in error.message
        assert responses[-1].HasField("usage")

        runner.execute = healthy  # type: ignore[method-assign]
        ok = await collect(engine.stub, generate_request(PROMPT))
        assert ok[-1].WhichOneof("event") == "finished"
        await eventually(lambda: idle(engine), what="engine idle after a failed step")


async def test_health_probes_cancelled_by_the_client_deadline_leave_nothing_in_flight() -> None:
    # One seat, taken by a long request: each probe waits in the queue until its Health
    # call's deadline cancels the call.
    config = sim_config(
        sim=SimTimingConfig(time_scale=0.5, vocab_size=1000),
        max_model_len=4096,
        num_kv_blocks=2048,
        max_num_seqs=1,
    )
    async with running_engine(config) as engine:
        busy = engine.stub.Generate(generate_request(PROMPT, max_tokens=3000, request_id="busy"))
        await _first_token(busy)
        probe = pb.HealthRequest(include_inference_probe=True)
        for _ in range(3):
            error = await rpc_error(engine.stub.Health(probe, timeout=0.2))
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED

        async def probes_left_the_queue_while_busy_runs() -> bool:
            load = await engine.stub.GetLoad(pb.GetLoadRequest())
            # `busy` still holding the seat: only cancelling the probes emptied the queue.
            assert load.running_requests == 1, "busy ended before the probes left the queue"
            return load.queued_requests == 0

        await eventually(probes_left_the_queue_while_busy_runs, what="cancelled probes dequeued")
        busy.cancel()
        drain = [
            r
            async for r in engine.stub.Drain(
                pb.DrainRequest(stop_accepting_new_requests=True, deadline_ms=5000)
            )
        ]
        assert drain[-1].WhichOneof("event") == "state", drain[-1]
        assert drain[-1].state == pb.DRAIN_STATE_COMPLETE
        assert drain[-1].in_flight_requests == 0
        await eventually(lambda: idle(engine), what="engine idle after the drain")


@pytest.mark.parametrize(
    "options",
    [
        pb.GenerateRequest(sampling=pb.SamplingParams(temperature=math.inf)),
        pb.GenerateRequest(sampling=pb.SamplingParams(temperature=math.nan)),
        pb.GenerateRequest(sampling=pb.SamplingParams(repetition_penalty=math.nan)),
        pb.GenerateRequest(sampling=pb.SamplingParams(repetition_penalty=math.inf)),
        pb.GenerateRequest(sampling=pb.SamplingParams(presence_penalty=math.nan)),
        pb.GenerateRequest(sampling=pb.SamplingParams(num_sequences=9)),  # max_num_seqs 8
        pb.GenerateRequest(
            stopping=pb.StoppingOptions(conditions=[pb.StopCondition(stop_token_id=1000)])
        ),
        pb.GenerateRequest(  # max_top_n is the vocabulary: 1000
            response=pb.ResponseOptions(output_candidates=pb.CandidateTokenSelection(top_n=1001))
        ),
        pb.GenerateRequest(
            response=pb.ResponseOptions(
                prompt_candidates=pb.CandidateTokenSelection(top_n=4_000_000_000)
            )
        ),
        pb.GenerateRequest(
            response=pb.ResponseOptions(
                output_candidates=pb.CandidateTokenSelection(token_ids=pb.TokenIds(ids=[1000]))
            )
        ),
    ],
    ids=[
        "temperature_inf",
        "temperature_nan",
        "repetition_penalty_nan",
        "repetition_penalty_inf",
        "presence_penalty_nan",
        "num_sequences_above_max",
        "stop_token_id_outside_vocab",
        "output_top_n_above_max_top_n",
        "prompt_top_n_huge",
        "candidate_id_outside_vocab",
    ],
)
async def test_out_of_range_options_are_invalid_argument(options: pb.GenerateRequest) -> None:
    async with running_engine() as engine:
        request = generate_request(PROMPT)
        request.MergeFrom(options)
        events, error = await stream_error(engine.stub.Generate(request))
        assert events == []
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert await idle(engine)


async def test_options_at_the_advertised_limits_are_accepted() -> None:
    async with running_engine() as engine:
        info = await engine.stub.GetModelInfo(pb.GetModelInfoRequest(model="sim"))
        limits = info.generation
        request = generate_request(PROMPT, max_tokens=2, n=limits.max_num_sequences)
        request.stopping.conditions.append(pb.StopCondition(stop_token_id=999))
        request.response.output_candidates.top_n = limits.output_logprobs.max_top_n
        responses = await collect(engine.stub, request)
    finished = [r for r in responses if r.WhichOneof("event") == "finished"]
    assert len(finished) == limits.max_num_sequences == 8


async def test_a_min_tokens_the_context_cannot_hold_is_invalid_argument() -> None:
    """The context (256) leaves 252 tokens after a prompt of 4: a minimum of 253 could only
    end LENGTH short of it, so Generate refuses it before acceptance (as vLLM does)."""
    async with running_engine() as engine:
        request = generate_request([1, 2, 3, 4], max_tokens=1000)
        request.stopping.min_tokens = 253
        events, error = await stream_error(engine.stub.Generate(request))
        assert events == []
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert "leaves 252 after a prompt of 4" in (error.details() or ""), error.details()
        assert await idle(engine)
