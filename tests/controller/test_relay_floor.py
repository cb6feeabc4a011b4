"""The bare relay `kvplane bench gateway` uses as its floor: a real sim engine behind it, the
relayed stream compared byte for byte with the engine's own; an engine failure comes back
as the engine's status."""

from __future__ import annotations

import grpc
import pytest

from controller.relay_floor import start_relay
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import generate_request, start_sim_engine

pytestmark = pytest.mark.timeout(30)


async def _stream(target: str, request: pb.GenerateRequest) -> list[bytes]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.OpenEngineStub(channel)
        return [r.SerializeToString() async for r in stub.Generate(request)]


async def test_relayed_stream_is_the_engines_byte_for_byte() -> None:
    # Two fresh engines alike, one called directly and one through the relay, so that neither
    # call finds the other's prompt in its cache.
    engine, relayed_engine = await start_sim_engine("e0"), await start_sim_engine("e1")
    relay = await start_relay(f"127.0.0.1:{relayed_engine.port}")
    try:
        tokens = list(range(40))
        direct = await _stream(f"127.0.0.1:{engine.port}", generate_request("a", tokens, 6))
        relayed = await _stream(f"127.0.0.1:{relay.port}", generate_request("a", tokens, 6))
    finally:
        await relay.close()
        await engine.close()
        await relayed_engine.close()
    assert len(direct) == 7  # six tokens, then finished with usage
    kinds = [pb.GenerateResponse.FromString(m).WhichOneof("event") for m in relayed]
    assert kinds == ["token"] * 6 + ["finished"]
    assert relayed == direct


async def test_engine_status_is_relayed() -> None:
    engine = await start_sim_engine("e0")
    relay = await start_relay(f"127.0.0.1:{engine.port}")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as direct:
            await _stream(f"127.0.0.1:{engine.port}", pb.GenerateRequest(model="sim"))
        with pytest.raises(grpc.aio.AioRpcError) as relayed:
            await _stream(f"127.0.0.1:{relay.port}", pb.GenerateRequest(model="sim"))
    finally:
        await relay.close()
        await engine.close()
    assert relayed.value.code() == direct.value.code() != grpc.StatusCode.OK
