"""What the torch engines of a fleet offer, through the controller (real torch engines on the
builtin model): Embed and Score (the controller learns from GetModelInfo that they support the
tasks, and the answers it relays are the engines' own; Classify, which the builtin model lacks,
is FAILED_PRECONDITION at the gateway), guided decoding (the constraint reaches the engine
the request is routed to), and replies over gRPC's default 4 MiB relayed unchanged."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from engine.config import EngineConfig
from engine.server.service import start_engine
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import Fleet, close_fleet, make_fleet, start_builtin_engines

pytestmark = pytest.mark.timeout(120)

MODEL = "builtin"


@pytest.fixture
async def torch_fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Fleet]:
    monkeypatch.setenv("KVPLANE_CACHE_DIR", str(tmp_path))
    engines = await start_builtin_engines(2, max_num_batched_tokens=128)
    fleet = await make_fleet(engines=engines)
    try:
        yield fleet
    finally:
        await close_fleet(fleet)


def task_input(item_id: str, text: str) -> pb.TaskInput:
    return pb.TaskInput(item_id=item_id, text=text)


TEXTS = ["The quick brown fox.", "def parse(self, text):", "You are a helpful assistant."]


async def test_embed_and_score_through_the_controller(torch_fleet: Fleet) -> None:
    embed = pb.EmbedRequest(
        context=pb.TaskRequestContext(request_id="e1", model=MODEL),
        inputs=[task_input(f"i{n}", text) for n, text in enumerate(TEXTS)],
    )
    via_gateway = await torch_fleet.gateway.Embed(embed)
    async with grpc.aio.insecure_channel(torch_fleet.address(torch_fleet.engines[0])) as channel:
        direct = pb_grpc.OpenEngineStub(channel)
        from_engine = await direct.Embed(embed)
        score = pb.ScoreRequest(
            context=pb.TaskRequestContext(request_id="s1", model=MODEL),
            groups=[
                pb.ScoreGroup(
                    group_id="g",
                    query=task_input("q", TEXTS[0]),
                    candidates=[task_input(f"c{n}", text) for n, text in enumerate(TEXTS[1:])],
                )
            ],
        )
        score_from_engine = await direct.Score(score)
    assert [o.item_id for o in via_gateway.outputs] == ["i0", "i1", "i2"]
    assert [list(o.dense.values) for o in via_gateway.outputs] == [
        list(o.dense.values) for o in from_engine.outputs
    ]
    assert len(via_gateway.outputs[0].dense.values) == 256
    score.context.request_id = "s2"
    scored = await torch_fleet.gateway.Score(score)
    got = [c.scores.values[0] for c in scored.groups[0].candidates]
    assert got == [c.scores.values[0] for c in score_from_engine.groups[0].candidates]
    q, *cs = ([*o.dense.values] for o in via_gateway.outputs)
    cosines = [sum(a * b for a, b in zip(q, c, strict=True)) for c in cs]
    assert got == pytest.approx(cosines, abs=1e-5)
    assert scored.higher_is_better


async def test_classify_without_a_head_in_the_fleet_is_failed_precondition(
    torch_fleet: Fleet,
) -> None:
    request = pb.ClassifyRequest(
        context=pb.TaskRequestContext(request_id="c1", model=MODEL),
        inputs=[task_input("a", TEXTS[0])],
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await torch_fleet.gateway.Classify(request)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_guided_decoding_through_the_controller(torch_fleet: Fleet) -> None:
    pattern = "[0-9]{3}-[a-z]{1,4}"
    async with grpc.aio.insecure_channel(torch_fleet.target) as channel:
        stub = pb_grpc.OpenEngineStub(channel)
        for seed in range(3):
            request = pb.GenerateRequest(
                request_id=f"g{seed}",
                model=MODEL,
                prompt="Call me at",
                sampling=pb.SamplingParams(temperature=1.0, seed=seed),
                stopping=pb.StoppingOptions(max_tokens=16),
                guided=pb.GuidedDecoding(regex=pattern),
            )
            responses = [r async for r in stub.Generate(request)]
            text = "".join(r.token.text for r in responses if r.HasField("token"))
            assert re.fullmatch(pattern, text), text
            assert responses[-1].finished.reason == pb.FINISH_REASON_STOP


async def test_a_reply_over_4_mib_is_relayed_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every candidate's logprob at 2,000 prompt positions makes one ~6 MiB message: the
    gateway takes it from the engine (gRPC's default limit is 4 MiB) and relays it; the size
    a client takes is that client's setting."""
    from vllm_grpc import vllm_grpc_pb2 as vpb
    from vllm_grpc import vllm_grpc_pb2_grpc as vpb_grpc

    monkeypatch.setenv("KVPLANE_CACHE_DIR", str(tmp_path))
    engine = await start_engine(
        EngineConfig(
            model=MODEL,
            listen="127.0.0.1:0",
            num_kv_blocks=160,
            max_num_batched_tokens=512,
            num_threads=1,
            shutdown_grace_s=0.5,
        )
    )
    fleet = await make_fleet(engines=[engine])
    request = vpb.GenerateRequest(
        request_id="big",
        model=MODEL,
        token_ids=vpb.TokenIds(ids=[3 + i % 300 for i in range(2000)]),
        stopping=vpb.StoppingCriteria(max_new_tokens=1),
        response=vpb.ResponseOptions(
            prompt_logprobs=True, prompt_candidates=vpb.CandidateTokens(all=True)
        ),
    )
    large = [("grpc.max_receive_message_length", 64 << 20)]
    try:
        replies = {}
        for name, address in [("engine", fleet.address(engine)), ("gateway", fleet.target)]:
            async with grpc.aio.insecure_channel(address, options=large) as channel:
                stub = vpb_grpc.GenerateStub(channel)
                replies[name] = [r async for r in stub.GenerateStream(request)]
    finally:
        await close_fleet(fleet)
    first = replies["engine"][0]
    assert first.ByteSize() > 4 << 20
    assert len(first.prompt_info.candidate_tokens) == 2000
    assert [r.SerializeToString() for r in replies["gateway"]] == [
        r.SerializeToString() for r in replies["engine"]
    ]
