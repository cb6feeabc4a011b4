"""OpenEngine requests carrying fields outside the seed's schema (a client of a newer revision):
refused with INVALID_ARGUMENT naming each, before anything runs, on every RPC but
GetEngineInfo, which answers any client so that it can read the revision this engine
implements. Real engine, real gRPC clients."""

from __future__ import annotations

from typing import Any, TypeVar

import grpc
import pytest
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from openengine.v1 import openengine_pb2 as pb
from tests.engine.engine_server_harness import (
    collect,
    generate_request,
    idle,
    rpc_error,
    running_engine,
    stream_error,
)

pytestmark = pytest.mark.timeout(60)

M = TypeVar("M", bound=Message)

OPENENGINE = pb.DESCRIPTOR.services_by_name["OpenEngine"]
# A field number no message of revision 1 uses.
NEWER_FIELD = 99
# A deadline for the calls that old code would have served as streams that never end.
CALL_TIMEOUT_S = 10.0


def with_newer_field(message: M, number: int = NEWER_FIELD) -> M:
    """`message` (changed in place, and returned) holding varint field `number` = 1, as a
    client of a later revision that added an option there sends it."""
    message.MergeFromString(_varint(number << 3) + b"\x01")
    return message


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


async def _refusal(stub: Any, method: str, request: Message) -> grpc.aio.AioRpcError:
    descriptor = OPENENGINE.methods_by_name[method]
    call = getattr(stub, method)(request, timeout=CALL_TIMEOUT_S)
    if descriptor.server_streaming:
        events, error = await stream_error(call)
        assert events == [], events
        return error
    return await rpc_error(call)


async def test_generate_with_fields_of_a_newer_revision_is_refused_not_served() -> None:
    """Protobuf would drop them unseen and the request be served as if they had not been
    sent; refused before acceptance (no event), naming where each is, nested too."""
    async with running_engine() as engine:
        newer = generate_request([1, 2, 3, 4, 5], model="sim")
        with_newer_field(newer)
        with_newer_field(newer.sampling, 42)
        events, error = await stream_error(engine.stub.Generate(newer))
        assert events == []
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = error.details() or ""
        assert "GenerateRequest field 99" in details, details
        assert "GenerateRequest.sampling field 42" in details, details
        assert await idle(engine)
        served = await collect(engine.stub, generate_request([1, 2, 3, 4, 5], model="sim"))
        assert served[-1].WhichOneof("event") == "finished"


@pytest.mark.parametrize("method", sorted(set(OPENENGINE.methods_by_name) - {"GetEngineInfo"}))
async def test_every_rpc_but_get_engine_info_refuses_a_newer_field(method: str) -> None:
    request_type = OPENENGINE.methods_by_name[method].input_type
    request = with_newer_field(GetMessageClass(request_type)())
    async with running_engine() as engine:
        error = await _refusal(engine.stub, method, request)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert f"{request_type.name} field 99" in (error.details() or ""), error.details()


async def test_get_engine_info_answers_a_client_of_a_newer_revision() -> None:
    """The revision handshake: such a client learns that this engine implements revision 1
    (and fails closed, or keeps to revision 1's fields)."""
    async with running_engine() as engine:
        info = await engine.stub.GetEngineInfo(with_newer_field(pb.GetEngineInfoRequest()))
    assert info.schema_revision == 1


async def test_a_drain_with_a_newer_option_leaves_the_engine_serving() -> None:
    """An option of the drain ignored would drain otherwise than asked: the engine keeps
    taking requests instead."""
    async with running_engine() as engine:
        drain = with_newer_field(pb.DrainRequest(stop_accepting_new_requests=True))
        error = await _refusal(engine.stub, "Drain", drain)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        health = await engine.stub.Health(pb.HealthRequest())
        assert health.state == pb.HEALTH_STATE_READY
        served = await collect(engine.stub, generate_request([1, 2, 3], model="sim"))
        assert served[-1].WhichOneof("event") == "finished"


async def test_a_newer_field_inside_a_repeated_option_is_named_too() -> None:
    """A stop condition of a newer revision (one entry of a repeated option) is refused as a
    top-level field is, not served without it."""
    async with running_engine() as engine:
        newer = generate_request([1, 2, 3, 4, 5], model="sim")
        newer.stopping.conditions.add(stop_token_id=7)
        newer.stopping.conditions.add(stop_token_id=8)
        with_newer_field(newer.stopping.conditions[1], 43)
        events, error = await stream_error(engine.stub.Generate(newer))
        assert events == []
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = error.details() or ""
        assert "GenerateRequest.stopping.conditions[1] field 43" in details, details
        assert await idle(engine)
