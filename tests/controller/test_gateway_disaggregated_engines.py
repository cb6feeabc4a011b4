"""The gateway in front of the bundled engine playing PREFILL and DECODE (sim runner, real KV
sessions pulled over gRPC), where test_gateway_disaggregated.py runs the same flows on fakes:
the client's stream is that of an aggregated engine, the decode engine reports the pulled
prefix as cached, and no session stays open on the prefill engine."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from engine.config import LoraConfig
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import (
    Fleet,
    close_fleet,
    generate_request,
    make_fleet,
    start_sim_engine,
)
from tests.controller.test_gateway_scripted import cli
from tests.engine.lora_adapters import write_adapter_config
from tests.polling import eventually

pytestmark = pytest.mark.timeout(60)

PROMPT = [*range(300, 364), 1]  # 4 blocks of 16 and one token


def _tokens(responses: list[pb.GenerateResponse]) -> list[int]:
    return [t.token_id for r in responses if r.HasField("token") for t in r.token.tokens]


async def test_prefill_and_decode_engines_behind_the_gateway() -> None:
    prefill = await start_sim_engine("p0", role="prefill")
    decode = await start_sim_engine("d0", role="decode")
    aggregated = await start_sim_engine("a0")
    fleet = await make_fleet(engines=[prefill, decode])
    try:
        request = generate_request("r", PROMPT, max_tokens=6)
        request.response.return_prompt_logprobs = True
        reply = [r async for r in fleet.gateway.Generate(request)]
        events = [r.WhichOneof("event") for r in reply]
        assert events[0] == "prompt" and events.count("prompt") == 1
        assert "prefill_ready" not in events and events[-1] == "finished"
        assert reply[-1].usage.cached_prompt_tokens == 64  # the pulled blocks

        async with grpc.aio.insecure_channel(f"127.0.0.1:{aggregated.port}") as channel:
            stub = pb_grpc.OpenEngineStub(channel)
            alone = [r async for r in stub.Generate(generate_request("a", PROMPT, 6))]
        assert _tokens(reply) == _tokens(alone)

        async with grpc.aio.insecure_channel(f"127.0.0.1:{prefill.port}") as channel:
            stub = pb_grpc.OpenEngineStub(channel)

            async def released() -> bool:
                load = await stub.GetLoad(pb.GetLoadRequest())
                return load.active_kv_sessions == 0 and load.used_kv_blocks == 0

            await eventually(released)
    finally:
        await close_fleet(fleet)
        await aggregated.close()


async def test_a_decode_engine_holding_the_prompt_prefills_it_itself() -> None:
    prefill = await start_sim_engine("p0", role="prefill")
    decode = await start_sim_engine("d0", role="decode")
    fleet = await make_fleet(engines=[prefill, decode], router={"skip_prefill_ratio": 0.5})
    try:
        first = [r async for r in fleet.gateway.Generate(generate_request("r1", PROMPT))]
        assert first[-1].WhichOneof("event") == "finished"

        async def decode_holds_it() -> bool:
            return any(e.device_blocks >= 4 for e in await _matches(fleet, decode.port))

        await eventually(decode_holds_it)
        second = [r async for r in fleet.gateway.Generate(generate_request("r2", PROMPT))]
        assert second[-1].usage.cached_prompt_tokens == 64
        assert "r2" in decode.service._finished and "r2" not in prefill.service._finished

    finally:
        await close_fleet(fleet)


async def _matches(fleet: Fleet, port: int) -> list[apb.EngineMatch]:
    reply = await fleet.admin.Match(apb.PromptQuery(token_ids=pb.TokenIds(ids=PROMPT)))
    return [m for m in reply.matches if m.engine == f"127.0.0.1:{port}"]


async def test_a_lora_adapter_no_decode_engine_holds_is_refused_before_the_prefill(
    tmp_path: Path,
) -> None:
    """The adapter loaded on the prefill engine only: Generate and admin `route` naming it
    are NOT_FOUND, saying no decode engine has it, and no prefill runs (it was UNAVAILABLE,
    "no decode engine available", with an idle decode engine there). Once the decode engine
    loads it the request runs."""
    lora = LoraConfig(enabled=True)
    prefill = await start_sim_engine("p0", role="prefill", lora=lora)
    decode = await start_sim_engine("d0", role="decode", lora=lora)
    fleet = await make_fleet(engines=[prefill, decode])
    try:
        adapter = str(write_adapter_config(tmp_path / "x"))
        target = ["--target", fleet.target]
        loaded = await cli("lora", "load", "x", adapter, "--id", "1", "--engine", "p0", *target)
        assert loaded.exit_code == 0, loaded.output
        request = generate_request("r1", PROMPT)
        request.lora_name = "x"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [r async for r in fleet.gateway.Generate(request)]
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert err.value.details() == "no decode engine has LoRA adapter 'x' loaded"
        assert "r1" not in prefill.service._finished
        query = apb.PromptQuery(token_ids=pb.TokenIds(ids=PROMPT), lora_name="x")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.admin.Route(query)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "no decode engine has LoRA adapter 'x'" in (err.value.details() or "")

        loaded = await cli("lora", "load", "x", adapter, "--id", "1", "--engine", "d0", *target)
        assert loaded.exit_code == 0, loaded.output
        request.request_id = "r2"
        reply = [r async for r in fleet.gateway.Generate(request)]
        assert reply[-1].WhichOneof("event") == "finished"
        assert "r2" in prefill.service._finished and "r2" in decode.service._finished
    finally:
        await close_fleet(fleet)


@pytest.mark.parametrize("target", ["request_id", "all_requests"])
async def test_an_abort_after_an_unread_handoff_ends_the_request_without_a_decode(
    target: str,
) -> None:
    """A client that stops reading (its flow-control window full, never cancelling) holds
    the gateway before its prompt output is through, and so before it reads the prefill
    engine's handoff: the prefill engine's part is over (an Abort of the request there is
    ALREADY_FINISHED), the gateway's is not. An Abort through the gateway ends the request
    there, as at any handoff: the client then gets its output finished CANCELLED, no decode
    engine is called, and the prefill engine's KV session is released. It used to answer
    ALREADY_FINISHED and let the decode hop generate everything once the client read on."""
    prefill = await start_sim_engine("p0", role="prefill", num_kv_blocks=1100, max_model_len=4096)
    decode = await start_sim_engine("d0", role="decode", num_kv_blocks=1100, max_model_len=4096)
    fleet = await make_fleet(engines=[prefill, decode])
    relay = fleet.app.gateway.relay
    try:
        async with (
            grpc.aio.insecure_channel(
                fleet.target,
                options=[("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)],
            ) as slow_reader,
            grpc.aio.insecure_channel(fleet.address(prefill)) as direct,
        ):
            request = generate_request("r", list(range(1000, 3000)), max_tokens=50)
            request.response.return_prompt_logprobs = True  # more than the client's window
            call = pb_grpc.OpenEngineStub(slow_reader).Generate(request)

            async def handed_over() -> bool:
                load = await pb_grpc.OpenEngineStub(direct).GetLoad(pb.GetLoadRequest())
                return load.active_kv_sessions == 1

            await eventually(handed_over)
            assert "r" not in relay.handed_over  # the gateway has not read the handoff
            if target == "request_id":
                reply = await fleet.gateway.Abort(pb.AbortRequest(request_id="r"))
                assert (reply.status, reply.message) == (
                    pb.ABORT_STATUS_ABORTED,
                    "aborted at the handoff to a decode engine",
                )
            else:
                everything = pb.AbortRequest(all_requests=pb.AllRequests())
                reply = await fleet.gateway.Abort(everything)
                assert reply.status == pb.ABORT_STATUS_ABORTED
            responses = [r async for r in call]
            assert [r.WhichOneof("event") for r in responses] == ["prompt", "finished"]
            assert responses[-1].finished.reason == pb.FINISH_REASON_CANCELLED

            async def released() -> bool:
                load = await pb_grpc.OpenEngineStub(direct).GetLoad(pb.GetLoadRequest())
                return load.active_kv_sessions == 0

            await eventually(released)
        assert "r" not in decode.service._finished  # no decode engine was called
        assert len(fleet.app.controller.router.inflight) == 0
    finally:
        await close_fleet(fleet)
