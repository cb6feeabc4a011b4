"""Each bounded Generate option at its bound, through a real client (sim runner; OpenEngine,
and vllm.Generate where its rule differs): the last value inside is served as asked, the
first outside is refused before acceptance (INVALID_ARGUMENT naming the option, no event) and
leaves nothing behind."""

from __future__ import annotations

import grpc
import pytest

from openengine.v1 import openengine_pb2 as pb
from tests.engine.engine_server_harness import (
    collect,
    generate_request,
    idle,
    running_engine,
    stream_error,
)
from vllm_grpc import vllm_grpc_pb2 as vpb

pytestmark = pytest.mark.timeout(60)

PROMPT = list(range(10, 22))  # 12 tokens = 3 blocks of 4


def _options(**fields: object) -> pb.GenerateRequest:
    request = generate_request(PROMPT, max_tokens=2)
    for name, value in fields.items():
        getattr(request, name).MergeFrom(value)
    return request


def _tokens(responses: list[pb.GenerateResponse]) -> list[pb.TokenInfo]:
    return [t for r in responses if r.WhichOneof("event") == "token" for t in r.token.tokens]


def _finished(responses: list[pb.GenerateResponse]) -> list[pb.GenerationFinished]:
    return [r.finished for r in responses if r.WhichOneof("event") == "finished"]


OUTSIDE = [
    (_options(sampling=pb.SamplingParams(top_k=-2)), "top_k must be >= 1 when set, got -2"),
    (_options(stopping=pb.StoppingOptions(max_tokens=0)), "max_tokens must be >= 1"),
    (
        _options(sampling=pb.SamplingParams(presence_penalty=2.5)),
        "presence_penalty must be in [-2, 2], got 2.5",
    ),
    (
        _options(sampling=pb.SamplingParams(frequency_penalty=-2.25)),
        "frequency_penalty must be in [-2, 2], got -2.25",
    ),
    (
        _options(stopping=pb.StoppingOptions(conditions=[pb.StopCondition(stop_text="")])),
        "stop strings must be non-empty",
    ),
    (
        _options(stopping=pb.StoppingOptions(conditions=[pb.StopCondition()])),
        "a stop condition sets neither stop_text nor stop_token_id",
    ),
    (
        _options(
            response=pb.ResponseOptions(output_candidates=pb.CandidateTokenSelection(top_n=0))
        ),
        "candidate top_n must be > 0",
    ),
    (
        _options(
            response=pb.ResponseOptions(
                prompt_candidates=pb.CandidateTokenSelection(token_ids=pb.TokenIds())
            )
        ),
        "candidate token_ids must not be empty",
    ),
    (
        _options(
            response=pb.ResponseOptions(
                return_prompt_logprobs=True, prompt_logprob_start=len(PROMPT)
            )
        ),
        "prompt_logprob_start is past the end of the prompt",
    ),
]


@pytest.mark.parametrize(
    ("request_", "details"),
    OUTSIDE,
    ids=[
        "top_k_minus_2",
        "max_tokens_0",
        "presence_penalty_above_2",
        "frequency_penalty_below_minus_2",
        "empty_stop_text",
        "stop_condition_without_a_condition",
        "candidate_top_n_0",
        "candidate_token_ids_empty",
        "prompt_logprob_start_at_the_prompts_end",
    ],
)
async def test_the_first_value_outside_a_bound_is_invalid_argument_naming_it(
    request_: pb.GenerateRequest, details: str
) -> None:
    async with running_engine() as engine:
        events, error = await stream_error(engine.stub.Generate(request_))
        assert events == []  # before acceptance: a status, no event
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert details in (error.details() or ""), error.details()
        assert await idle(engine)


async def test_the_last_value_inside_each_bound_is_served_as_asked() -> None:
    async with running_engine() as engine:
        one = await collect(engine.stub, _options(stopping=pb.StoppingOptions(max_tokens=1)))
        assert len(_tokens(one)) == 1
        assert [f.reason for f in _finished(one)] == [pb.FINISH_REASON_LENGTH]
        # 0 and -1 are the engines' "no top-k"; 1 the smallest top-k.
        for top_k in (-1, 0, 1):
            served = await collect(engine.stub, _options(sampling=pb.SamplingParams(top_k=top_k)))
            assert len(_tokens(served)) == 2, top_k
        for penalty in (2.0, -2.0):
            for sampling in (
                pb.SamplingParams(presence_penalty=penalty),
                pb.SamplingParams(frequency_penalty=penalty),
            ):
                served = await collect(engine.stub, _options(sampling=sampling))
                assert len(_tokens(served)) == 2, sampling
        # The last prompt position: one prompt logprob, of the prompt's last token.
        last = await collect(
            engine.stub,
            _options(
                response=pb.ResponseOptions(
                    return_prompt_logprobs=True, prompt_logprob_start=len(PROMPT) - 1
                )
            ),
        )
        prompts = [r.prompt for r in last if r.WhichOneof("event") == "prompt"]
        assert [[t.token_id for t in p.tokens] for p in prompts] == [[PROMPT[-1]]]
        assert await idle(engine)


async def test_a_prompt_must_leave_room_for_one_output_token_in_the_context() -> None:
    """The context is 256 tokens: a prompt of 255 gets exactly one token (LENGTH), one of 256
    has no room for any and is refused, saying so."""
    async with running_engine() as engine:
        fits = await collect(engine.stub, generate_request(list(range(255)), max_tokens=8))
        assert len(_tokens(fits)) == 1
        assert [f.reason for f in _finished(fits)] == [pb.FINISH_REASON_LENGTH]
        assert fits[-1].usage.prompt_tokens == 255
        events, error = await stream_error(
            engine.stub.Generate(generate_request(list(range(256)), max_tokens=8))
        )
        assert events == []
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert "prompt of 256 tokens leaves no room" in (error.details() or ""), error.details()
        assert await idle(engine)


async def test_vllm_min_new_tokens_equal_to_max_new_tokens_is_served() -> None:
    """vllm.Generate: a minimum equal to the maximum asks for exactly that many tokens."""
    async with running_engine() as engine:
        request = vpb.GenerateRequest(
            token_ids=vpb.TokenIds(ids=PROMPT),
            stopping=vpb.StoppingCriteria(max_new_tokens=5, min_new_tokens=5),
        )
        response = await engine.vllm.Generate(request)
        assert response.outputs.num_tokens == 5
        assert response.outputs.finish_info.finish_reason == vpb.FinishInfo.LENGTH
        assert await idle(engine)
