"""vllm.Generate on the torch runner (the builtin random model, with a tokenizer), through real
stubs: text prompts and the response options, stop strings, logprobs and candidates, seeds.
The sim runner's side (defaults, stop tokens, abort, errors, the cache): test_server_vllm.py."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import grpc
import pytest

from engine.config import EngineConfig
from engine.torch_runner.builtin_model import ensure_builtin_model
from openengine.v1 import openengine_pb2 as oe
from tests.engine.engine_server_harness import running_engine, torch_config
from tests.polling import eventually
from vllm_grpc import vllm_grpc_pb2 as pb

pytestmark = pytest.mark.timeout(300)

TEXT = "hello world"
VOCAB_SIZE = 385  # the builtin model's


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    return torch_config(str(ensure_builtin_model(tmp_path_factory.mktemp("models"))))


def _request(max_new_tokens: int = 12, **response: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        text=TEXT,
        stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens),
        response=pb.ResponseOptions(**response),  # type: ignore[arg-type]
    )


async def test_text_prompt_and_what_the_response_carries(config: EngineConfig) -> None:
    """A text prompt is tokenized by the engine; text is sent unless `output_text` is false;
    token ids only when asked for; the streamed text adds up to the unary one."""
    async with running_engine(config) as engine:
        everything = await engine.vllm.Generate(
            _request(prompt_token_ids=True, output_token_ids=True)
        )
        prompt_ids = list(everything.prompt_info.token_ids)
        assert everything.prompt_info.num_prompt_tokens == len(prompt_ids) > 0
        same_as_ids = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt_ids),
            stopping=pb.StoppingCriteria(max_new_tokens=12),
            response=pb.ResponseOptions(output_token_ids=True),
        )
        by_ids = await engine.vllm.Generate(same_as_ids)
        default = await engine.vllm.Generate(_request())
        no_text = await engine.vllm.Generate(_request(output_text=False, output_token_ids=True))
        streamed = [r async for r in engine.vllm.GenerateStream(_request())]
    assert everything.outputs.text != ""
    assert list(by_ids.outputs.token_ids) == list(everything.outputs.token_ids)
    assert by_ids.outputs.text == default.outputs.text == everything.outputs.text
    assert list(default.prompt_info.token_ids) == [] and list(default.outputs.token_ids) == []
    assert default.outputs.num_tokens == 12
    assert no_text.outputs.text == ""
    assert list(no_text.outputs.token_ids) == list(everything.outputs.token_ids)
    assert "".join(r.outputs.text for r in streamed) == everything.outputs.text


async def test_stop_string_with_and_without_include_stop_strings(config: EngineConfig) -> None:
    async with running_engine(config) as engine:
        text = (await engine.vllm.Generate(_request())).outputs.text
        stop = text[3:5]
        at = text.index(stop)
        for include, kept in ((False, text[:at]), (True, text[: at + len(stop)])):
            request = _request()
            request.stopping.stop_strings.append(stop)
            request.stopping.include_stop_strings = include
            unary = await engine.vllm.Generate(request)
            streamed = [r async for r in engine.vllm.GenerateStream(request)]
            finish = unary.outputs.finish_info
            assert finish.finish_reason == pb.FinishInfo.STOP
            assert finish.WhichOneof("stop_reason") == "stop_string" and finish.stop_string == stop
            assert unary.outputs.text == kept, (include, text, stop)
            assert "".join(r.outputs.text for r in streamed) == kept


async def test_a_stop_token_is_sent_and_include_stop_strings_decides_its_text(
    config: EngineConfig,
) -> None:
    """As vLLM's output: the matched stop id ends `token_ids` either way; its text is in
    `text` only with include_stop_strings."""
    async with running_engine(config) as engine:
        greedy = await engine.vllm.Generate(_request(output_token_ids=True))
        ids = list(greedy.outputs.token_ids)
        at = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])  # its first time

        async def text_of(num_tokens: int) -> str:
            return (await engine.vllm.Generate(_request(num_tokens))).outputs.text

        for include, text in ((False, await text_of(at)), (True, await text_of(at + 1))):
            request = _request(output_token_ids=True)
            request.stopping.stop_token_ids.append(ids[at])
            request.stopping.include_stop_strings = include
            unary = await engine.vllm.Generate(request)
            assert list(unary.outputs.token_ids) == ids[: at + 1]
            assert unary.outputs.finish_info.stop_token_id == ids[at]
            assert unary.outputs.text == text, include


async def test_output_logprobs_ranks_and_candidates_stay_aligned(config: EngineConfig) -> None:
    async with running_engine(config) as engine:
        top3 = await engine.vllm.Generate(
            _request(
                output_token_ids=True,
                output_logprobs=True,
                output_candidates=pb.CandidateTokens(top_n=3),
            )
        )
        chosen = await engine.vllm.Generate(
            _request(
                output_logprobs=True,
                output_candidates=pb.CandidateTokens(token_ids=pb.TokenIds(ids=[5, 7])),
            )
        )
        every = await engine.vllm.Generate(
            _request(
                max_new_tokens=2,
                output_logprobs=True,
                output_candidates=pb.CandidateTokens(all=True),
            )
        )
        plain = await engine.vllm.Generate(_request(output_logprobs=True))
    out = top3.outputs
    assert len(out.token_ids) == len(out.logprobs) == len(out.ranks) == out.num_tokens == 12
    assert len(out.candidate_tokens) == 12
    for token_id, logprob, rank, candidates in zip(
        out.token_ids, out.logprobs, out.ranks, out.candidate_tokens, strict=True
    ):
        # Greedy: the sampled token is the most likely one, the first candidate.
        assert rank == 1
        assert [c.rank for c in candidates.tokens] == [1, 2, 3]
        assert candidates.tokens[0].id == token_id
        assert candidates.tokens[0].logprob == pytest.approx(logprob)
        assert logprob <= 0
    assert list(chosen.outputs.logprobs) == pytest.approx(list(out.logprobs))
    assert [[c.id for c in p.tokens] for p in chosen.outputs.candidate_tokens] == [[5, 7]] * 12
    assert [len(p.tokens) for p in every.outputs.candidate_tokens] == [VOCAB_SIZE] * 2
    assert list(plain.outputs.ranks) == [1] * 12 and len(plain.outputs.candidate_tokens) == 0


async def test_prompt_logprobs_first_position_is_zero_with_rank_zero(config: EngineConfig) -> None:
    """The first prompt token has no logprob: 0.0 and rank 0, as vLLM's server sends it (a real
    position's rank is >= 1), so that summing the prompt's logprobs stays finite."""
    async with running_engine(config) as engine:
        unary = await engine.vllm.Generate(
            _request(
                max_new_tokens=1,
                prompt_token_ids=True,
                prompt_logprobs=True,
                prompt_candidates=pb.CandidateTokens(top_n=2),
            )
        )
    info = unary.prompt_info
    assert len(info.logprobs) == len(info.ranks) == len(info.candidate_tokens)
    assert len(info.logprobs) == info.num_prompt_tokens == len(info.token_ids) > 1
    assert info.logprobs[0] == 0.0 and info.ranks[0] == 0
    assert len(info.candidate_tokens[0].tokens) == 0
    assert all(rank >= 1 for rank in info.ranks[1:])
    assert all(len(c.tokens) == 2 for c in info.candidate_tokens[1:])
    assert all(logprob < 0 for logprob in info.logprobs[1:])


async def test_candidates_without_logprobs_asked_for_are_ignored(config: EngineConfig) -> None:
    """As vLLM's server: a candidate selection is an extra of `output_logprobs` /
    `prompt_logprobs`; without them nothing of the logprobs is computed or sent (the proto:
    logprobs "if requested")."""
    async with running_engine(config) as engine:
        unary = await engine.vllm.Generate(
            _request(
                output_candidates=pb.CandidateTokens(top_n=2),
                prompt_candidates=pb.CandidateTokens(top_n=2),
            )
        )
        stream = [
            r
            async for r in engine.vllm.GenerateStream(
                _request(output_candidates=pb.CandidateTokens(all=True))
            )
        ]
    for outputs in [unary.outputs, *(r.outputs for r in stream)]:
        assert list(outputs.logprobs) == [] and list(outputs.ranks) == []
        assert list(outputs.candidate_tokens) == []
    assert list(unary.prompt_info.logprobs) == [] and list(unary.prompt_info.ranks) == []
    assert list(unary.prompt_info.candidate_tokens) == []
    assert unary.outputs.num_tokens == 12


async def test_a_seed_makes_sampling_repeatable(config: EngineConfig) -> None:
    async with running_engine(config) as engine:

        async def sample(seed: int) -> list[int]:
            request = _request(output_token_ids=True)
            request.temperature = 1.0
            request.sampling.seed = seed
            return list((await engine.vllm.Generate(request)).outputs.token_ids)

        first, again, other = await sample(5), await sample(5), await sample(6)
        greedy = (await engine.vllm.Generate(_request(output_token_ids=True))).outputs.token_ids
    assert first == again
    assert first != other
    assert first != list(greedy)  # temperature 1 samples; absent, it is greedy


async def test_seed_minus_one_is_no_seed(config: EngineConfig) -> None:
    """vLLM's SamplingParams reads seed -1 as unseeded: two such requests draw differently."""
    async with running_engine(config) as engine:

        async def sample() -> list[int]:
            request = _request(output_token_ids=True)
            request.temperature = 1.0
            request.sampling.seed = -1
            return list((await engine.vllm.Generate(request)).outputs.token_ids)

        first, second = await sample(), await sample()
    assert first != second  # 12 draws at temperature 1 over 385 tokens: equal ~never


async def test_a_tiny_temperature_samples_at_vllms_minimum(config: EngineConfig) -> None:
    """As vLLM: a positive temperature under 0.01 samples at 0.01 (1e-40 used to overflow the
    logits to inf and draw token 0 from NaN probabilities)."""
    async with running_engine(config) as engine:

        async def sample(temperature: float) -> list[int]:
            request = _request(output_token_ids=True)
            request.temperature = temperature
            request.sampling.seed = 1
            return list((await engine.vllm.Generate(request)).outputs.token_ids)

        floor, tiny = await sample(0.01), await sample(1e-40)
    assert tiny == floor


async def test_logit_bias_and_allowed_token_ids_steer_the_output(config: EngineConfig) -> None:
    """vLLM's decoding options: a large bias makes greedy take that token every step; with an
    allow-list every sampled token is one of it."""
    async with running_engine(config) as engine:
        biased = _request(output_token_ids=True)
        biased.decoding.logit_bias[77] = 100.0
        allowed = _request(output_token_ids=True)
        allowed.temperature = 1.0
        allowed.sampling.seed = 3
        allowed.decoding.allowed_token_ids.extend([10, 20, 30])
        streamed = [r async for r in engine.vllm.GenerateStream(biased)]
        only_77 = await engine.vllm.Generate(biased)
        drawn = await engine.vllm.Generate(allowed)
    assert list(only_77.outputs.token_ids) == [77] * 12
    assert [t for r in streamed for t in r.outputs.token_ids] == [77] * 12
    assert set(drawn.outputs.token_ids) <= {10, 20, 30}
    assert len(set(drawn.outputs.token_ids)) > 1


async def test_a_truncated_prompt_aborted_while_converted_counts_the_tokens_kept(
    config: EngineConfig,
) -> None:
    """A GenerateStream aborted while its guide compiles, which acceptance would then refuse
    (more sequences than `max_num_seqs`), ends ABORTED as one the engine never took; its
    `prompt_info` is still the prompt `truncate_prompt_tokens` keeps (its last 4 tokens), as
    an accepted request's is and as the gateway answers one aborted before any engine took it.
    It counted every token sent."""
    sent = list(range(20, 50))
    request = pb.GenerateRequest(
        request_id="held",
        token_ids=pb.TokenIds(ids=sent),
        truncate_prompt_tokens=4,
        sampling=pb.RandomSampling(num_sequences=config.max_num_seqs + 1),
        decoding=pb.DecodingParameters(regex="a+"),
        stopping=pb.StoppingCriteria(max_new_tokens=3),
        response=pb.ResponseOptions(prompt_token_ids=True),
    )
    async with running_engine(config) as engine:
        # The guide compiler (one worker) is busy until released: the request waits there,
        # held as being converted.
        compiler_free = threading.Event()
        busy = engine.app.service._guide_compiler.submit(compiler_free.wait, 30)
        generate = asyncio.create_task(_read_all(engine.vllm.GenerateStream(request)))

        async def aborted_while_held() -> bool:
            try:
                reply = await engine.stub.Abort(oe.AbortRequest(request_id="held"))
            except grpc.aio.AioRpcError as error:  # not held yet
                assert error.code() == grpc.StatusCode.NOT_FOUND, error
                return False
            return reply.status == oe.ABORT_STATUS_ABORTED

        await eventually(aborted_while_held)
        compiler_free.set()
        responses = await generate
        assert busy.result() is True
    info = responses[0].prompt_info
    assert (info.num_prompt_tokens, list(info.token_ids)) == (4, sent[-4:])
    assert [r.outputs.finish_info.finish_reason for r in responses] == [pb.FinishInfo.ABORTED]


async def _read_all(stream: Any) -> list[pb.GenerateResponse]:
    return [response async for response in stream]


async def test_a_stop_string_the_last_allowed_token_completes_is_a_stop_not_the_length(
    config: EngineConfig,
) -> None:
    """The token that reaches max_new_tokens also completes a stop string: the stop string
    wins (STOP naming it, its text cut), as in vLLM, not LENGTH with the stop string sent."""
    async with running_engine(config) as engine:
        steps = [
            r.outputs.text async for r in engine.vllm.GenerateStream(_request(max_new_tokens=12))
        ]
        # The last token whose text is a stop string found nowhere before it.
        last = max(
            n
            for n in range(1, len(steps) + 1)
            if steps[n - 1].strip()
            and "".join(steps[:n]).find(steps[n - 1]) == len("".join(steps[: n - 1]))
        )
        stop = steps[last - 1]
        request = _request(max_new_tokens=last)
        request.stopping.stop_strings.append(stop)
        unary = await engine.vllm.Generate(request)
    finish = unary.outputs.finish_info
    assert finish.finish_reason == pb.FinishInfo.STOP, (steps, stop)
    assert finish.stop_string == stop
    assert finish.num_output_tokens == last
    assert unary.outputs.text == "".join(steps[: last - 1])
