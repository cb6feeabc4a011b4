"""The torch runner behind the servers: greedy Generate over gRPC reproduces vLLM 0.32.0's
tokens and prefix hits on the tiny Llama checkpoint, and text streams as correct deltas."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from openengine.v1 import openengine_pb2 as pb
from tests.engine.engine_server_harness import collect, idle, running_engine
from tests.engine.torch_reference import TEST_DEVICE
from tests.polling import eventually

pytestmark = pytest.mark.timeout(180)

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
MODEL = SHARED / "models/tiny-llama"
REQUESTS = SHARED / "data/vllm-0.32.0-kv-events/requests.jsonl"


def _vllm_requests() -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in REQUESTS.read_text().splitlines()]
    return [r for r in rows if "output_token_ids" in r]


def _torch_config() -> Any:
    from engine.config import EngineConfig

    return EngineConfig(
        model=str(MODEL),
        listen="127.0.0.1:0",
        served_model_name="tiny-llama",
        block_size=32,
        num_kv_blocks=256,
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        shutdown_grace_s=1.0,
        device=TEST_DEVICE,
    )


def _greedy(row: dict[str, Any]) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        request_id=f"vllm-{row['req_seq']}",
        model="tiny-llama",
        token_ids=pb.TokenIds(ids=row["prompt_token_ids"]),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingOptions(max_tokens=row["sampling"]["max_tokens"], ignore_eos=True),
        response=pb.ResponseOptions(return_output_logprobs=True),
    )
    if row["cache_salt"]:
        request.kv.cache_salt = row["cache_salt"]
    return request


def _tokens(responses: list[pb.GenerateResponse]) -> list[int]:
    return [
        t.token_id for r in responses if r.WhichOneof("event") == "token" for t in r.token.tokens
    ]


async def test_greedy_over_grpc_matches_vllm_tokens_and_prefix_hits() -> None:
    rows = _vllm_requests()
    shared_prefix = [r for r in rows if r["phase"] == "P1_shared_prefix"]
    repeat = [r for r in rows if r["phase"] == "P2_repeat_and_extend"]
    async with running_engine(_torch_config()) as engine:
        # The shared-prefix phase ran as one concurrent batch in vLLM: do the same.
        batch = await asyncio.gather(*(collect(engine.stub, _greedy(r)) for r in shared_prefix))
        for row, responses in zip(shared_prefix, batch, strict=True):
            assert _tokens(responses) == row["output_token_ids"], row["req_seq"]
            logprobs = [
                t.logprob
                for r in responses
                if r.WhichOneof("event") == "token"
                for t in r.token.tokens
            ]
            assert all(lp <= 0.0 for lp in logprobs) and len(logprobs) == len(
                row["output_token_ids"]
            )
        # Then one at a time, as vLLM got them: same tokens and the same prefix-cache hits.
        for row in repeat:
            responses = await collect(engine.stub, _greedy(row))
            assert _tokens(responses) == row["output_token_ids"], row["req_seq"]
            assert responses[-1].usage.cached_prompt_tokens == row["num_cached_tokens"]


async def test_text_prompt_streams_deltas_that_join_to_the_decoded_output() -> None:
    tokenizer = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    async with running_engine(_torch_config()) as engine:
        info = await engine.stub.GetModelInfo(pb.GetModelInfoRequest(model="tiny-llama"))
        assert info.supports_text_input
        request = pb.GenerateRequest(
            prompt="def parse(self, text: str) -> list[str]:\n    ",
            sampling=pb.SamplingParams(temperature=0.0),
            stopping=pb.StoppingOptions(max_tokens=20, ignore_eos=True),
        )
        responses = await collect(engine.stub, request)
    token_ids = _tokens(responses)
    text = "".join(r.token.text for r in responses if r.WhichOneof("event") == "token")
    assert len(token_ids) == 20
    assert text == tokenizer.decode(token_ids)
    assert responses[-1].usage.prompt_tokens == len(
        tokenizer.encode("def parse(self, text: str) -> list[str]:\n    ").ids
    )


async def test_stop_string_across_a_token_boundary() -> None:
    prompt = "class Parser:\n    def feed(self, data):\n        "
    base = pb.GenerateRequest(
        prompt=prompt,
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingOptions(max_tokens=24, ignore_eos=True),
    )
    async with running_engine(_torch_config()) as engine:
        full = await collect(engine.stub, base)
        pieces = [r.token.text for r in full if r.WhichOneof("event") == "token"]
        text = "".join(pieces)
        # A stop string made of the end of one token's text and the start of the next one's.
        k = next(i for i in range(2, len(pieces) - 1) if len(pieces[i]) >= 2 and pieces[i + 1])
        stop = pieces[k][-2:] + pieces[k + 1][:2]
        cut = text.index(stop)
        for include in (False, True):
            request = pb.GenerateRequest()
            request.CopyFrom(base)
            request.stopping.conditions.append(pb.StopCondition(stop_text=stop))
            request.stopping.include_stop_in_output = include
            responses = await collect(engine.stub, request)
            out = "".join(r.token.text for r in responses if r.WhichOneof("event") == "token")
            finished = responses[-1].finished
            assert finished.reason == pb.FINISH_REASON_STOP
            assert finished.stop_match.stop_text == stop
            assert out == (text[: cut + len(stop)] if include else text[:cut])
        # The last response leaves before the engine's loop frees the request: wait, not race.
        await eventually(lambda: idle(engine), what="the engine to free every request")
