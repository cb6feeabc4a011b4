"""Controllers fronting controllers, with real controllers and engines on loopback.

A controller may front another (a hierarchical fleet): requests pass through to the lower
controller's engines. Two that front each other are a loop: the second registration is refused
(the first controller's GetEngineInfo says whom it fronts). A ring that registration did not
see (a controller's view of another read before that one fronted anything) is found in the
request path: each controller passes its instance id on in `kvplane-via`, and the one that
finds its own there refuses the request, naming the ring, instead of passing it around until
a deadline."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import grpc
import pytest

from controller.registry import EngineState
from kvplane_api.v1 import admin_pb2 as apb
from tests.controller.conftest import Fleet, close_fleet, generate_request, make_fleet
from tests.controller.test_gateway import PREFIX, generate
from tests.polling import eventually

pytestmark = pytest.mark.timeout(90)


@asynccontextmanager
async def controllers(count: int) -> AsyncIterator[list[Fleet]]:
    """`count` controllers, each with one sim engine of its own."""
    fleets: list[Fleet] = []
    try:
        for _ in range(count):
            fleets.append(await make_fleet(num_engines=1))
        yield fleets
    finally:
        for fleet in fleets:
            await close_fleet(fleet)


def state_of(fleet: Fleet, engine: Fleet) -> Callable[[], EngineState]:
    """The state `fleet` gives the controller `engine` as one of its engines."""
    return lambda: fleet.app.controller.fleet.registry.get(engine.target).state


async def front(fleet: Fleet, lower: Fleet) -> None:
    """Register the controller `lower` as an engine of `fleet`, and wait until its identity
    is read (its first health answer: accepted; or refused)."""
    await fleet.admin.RegisterEngine(
        apb.RegisterEngineRequest(address=lower.target, kv_events="none")
    )
    await eventually(
        lambda: state_of(fleet, lower)() not in (EngineState.UNKNOWN, EngineState.STARTING),
        what="its identity read",
    )


async def all_finish(fleet: Fleet, name: str, count: int = 6) -> None:
    for i in range(count):
        responses = await generate(fleet, generate_request(f"{name}-{i}", PREFIX))
        assert responses[-1].WhichOneof("event") == "finished", responses[-1]


async def test_a_controller_fronting_another_is_kept_and_one_fronting_it_back_is_refused() -> None:
    async with controllers(2) as (upper, lower):
        await front(upper, lower)
        await eventually(lambda: state_of(upper, lower)() is EngineState.READY, what="routable")
        await all_finish(upper, "hierarchical")  # through the lower one or the upper's engine

        await front(lower, upper)
        await eventually(
            lambda: state_of(lower, upper)() is EngineState.INCOMPATIBLE,
            what="the upper controller refused as an engine of the lower one",
        )
        error = lower.app.controller.fleet.registry.get(upper.target).last_error
        upper_id, lower_id = upper.app.controller.instance_id, lower.app.controller.instance_id
        assert error == (
            f"a controller (instance {upper_id}) that fronts this controller "
            f"(instance {lower_id}): requests would loop between them"
        )
        # The hierarchy stands, and both still serve.
        assert state_of(upper, lower)() is EngineState.READY
        await all_finish(upper, "upper")
        await all_finish(lower, "lower")


async def test_a_ring_of_controllers_is_refused_in_the_request_path_naming_it() -> None:
    """a fronts b before b fronts c (a's view of b says b fronts nothing), then c fronts a:
    a ring registration cannot see. With c's own engine cordoned, a request to a goes
    a -> b -> c -> a, where a refuses it."""
    async with controllers(3) as (a, b, c):
        await front(a, b)
        await front(b, c)
        await front(c, a)
        for state in (state_of(a, b), state_of(b, c), state_of(c, a)):

            def routable(state: Callable[[], EngineState] = state) -> bool:
                return state() is EngineState.READY

            await eventually(routable, what="routable")
        for fleet in (a, b, c):  # each routes to the next controller only
            (own,) = fleet.engines
            await fleet.admin.Cordon(apb.EngineRef(engine=fleet.address(own)))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            # (A deadline: a loop nothing catches passes the request around until one.)
            call = a.gateway.Generate(generate_request("around", PREFIX), timeout=30)
            _ = [response async for response in call]
        ids = [f.app.controller.instance_id for f in (a, b, c)]
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
        assert f"request loop between controllers: {' -> '.join([*ids, ids[0]])}" in (
            err.value.details() or ""
        )
