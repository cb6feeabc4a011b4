"""The admin API's membership RPCs refuse bad input with the right status and leave the fleet
as it was: RegisterEngine of an address no engine can have, or of one already registered;
RemoveEngine of an engine the fleet does not have."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from kvplane_api.v1 import admin_pb2 as apb
from tests.controller.conftest import Fleet

pytestmark = pytest.mark.timeout(60)


async def workers(fleet: Fleet) -> list[tuple[str, str, bool]]:
    reply = await fleet.admin.ListWorkers(apb.ListWorkersRequest())
    return [(w.address, w.instance_id, w.routable) for w in reply.workers]


@pytest.mark.parametrize(
    "address",
    [
        "garbage",
        "",
        "127.0.0.1:",
        "127.0.0.1:0",
        "127.0.0.1:70000",
        "127.0.0.1:\u0663",
        "a b:9001",
        " 127.0.0.1:9001",
        "http://127.0.0.1:9001",
        "::1:9001",
    ],
)
async def test_register_engine_refuses_an_address_no_engine_can_have(
    fleet: Fleet, address: str
) -> None:
    before = await workers(fleet)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await fleet.admin.RegisterEngine(apb.RegisterEngineRequest(address=address))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert await workers(fleet) == before


async def test_register_engine_refuses_an_engine_registered_already(fleet: Fleet) -> None:
    before = await workers(fleet)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await fleet.admin.RegisterEngine(
            apb.RegisterEngineRequest(address=fleet.address(fleet.engines[0]), kv_events="none")
        )
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert await workers(fleet) == before
    record = fleet.app.controller.fleet.registry.get(fleet.address(fleet.engines[0]))
    assert (record.source, record.kv_events) == ("config", "grpc")


@pytest.mark.parametrize("engine", ["nope", "127.0.0.1:1"])
async def test_remove_engine_of_an_unknown_engine_is_not_found(fleet: Fleet, engine: str) -> None:
    before = await workers(fleet)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await fleet.admin.RemoveEngine(apb.EngineRef(engine=engine))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert await workers(fleet) == before


@pytest.mark.parametrize("rpc", ["RemoveEngine", "Cordon", "Uncordon"])
async def test_an_empty_engine_reference_is_invalid_even_where_an_engine_has_no_id(
    fleet: Fleet, rpc: str
) -> None:
    """An engine may leave its instance id empty: "" must not name it."""
    registry = fleet.app.controller.fleet.registry
    record = registry.get(fleet.address(fleet.engines[0]))
    assert record.identity is not None
    record.identity = dataclasses.replace(record.identity, instance_id="")
    before = await workers(fleet)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await getattr(fleet.admin, rpc)(apb.EngineRef(engine=""))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await workers(fleet) == before
