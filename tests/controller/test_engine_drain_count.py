"""What `kvplane admin drain ENGINE`'s "in flight N" counts: the engine process's own requests
(its Drain stream, `EngineService.drain`), read live, not its polled GetLoad nor the
controller's router accounting. A request the controller routed there whose call has not
reached the engine yet when the drain starts is not counted, and need not be: the engine
refuses it once it arrives (it stopped accepting before it counted), so it never runs there;
the gateway sends it elsewhere, or fails it. Real servers: a controller, sim engines, one of
them behind a front server that holds its Generate calls (the network between the gateway
and the engine process)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from tests.controller.conftest import (
    close_fleet,
    engines_of_kinds,
    generate_request,
    make_fleet,
    start_sim_engine,
)
from tests.controller.fronted_engine import start_fronted_engine
from tests.controller.test_admin_cli_membership import cli_json
from tests.controller.test_lora_churn import GatedGenerate
from tests.polling import eventually

pytestmark = pytest.mark.timeout(60)

Context = grpc.aio.ServicerContext[Any, Any]
PROMPT = list(range(700, 764))


class HeldGenerate(GatedGenerate):
    """`GatedGenerate` (each Generate held until `gate` opens), Drain passed on."""

    async def Drain(
        self, request: pb.DrainRequest, context: Context
    ) -> AsyncIterator[pb.DrainResponse]:
        async for response in self.inner.Drain(request):
            yield response


async def test_a_request_routed_before_the_drain_that_reaches_the_engine_after_it_never_runs() -> (
    None
):
    """The operator's case: every other engine cordoned, a stream routed to the engine whose
    call is still on its way when `drain ENGINE` starts. The drain says in flight 0 at once
    and COMPLETE, rightly: the engine refuses the stream when it arrives (DRAINING), and
    with no other engine to take it the client gets UNAVAILABLE; nothing ran there. Only the
    controller's own accounting (`workers` INFLIGHT) held it meanwhile."""
    held = await start_fronted_engine("held", HeldGenerate)
    others = [await start_sim_engine("c0"), await start_sim_engine("c1")]
    fleet = await make_fleet(engines=engines_of_kinds(held, *others))
    address = fleet.address(held)
    try:
        for engine in others:
            await fleet.admin.Cordon(apb.EngineRef(engine=fleet.address(engine)))
        call = fleet.gateway.Generate(generate_request("routed", [*PROMPT, 1]))
        reading = asyncio.ensure_future(call.read())
        # Routed to the engine, its call held on the way there.
        await eventually(lambda: held.servicer.arrived == ["routed"], 30, "the call sent")

        listed = await cli_json("workers", "--target", fleet.target)
        row = next(w for w in listed["workers"] if w["address"] == address)
        assert row["inflight_requests"] == 1  # the controller's accounting: routed there

        drain = apb.DrainEngineRequest(engine=address)
        events = [e async for e in fleet.admin.DrainEngine(drain)]
        assert [(e.state, e.in_flight_requests) for e in events] == [
            (pb.DRAIN_STATE_STARTED, 0),
            (pb.DRAIN_STATE_COMPLETE, 0),
        ]

        held.servicer.gate.set()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await reading
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in (refused.value.details() or ""), refused.value.details()
        load = await held.servicer.inner.GetLoad(pb.GetLoadRequest())
        assert (load.running_requests, load.queued_requests) == (0, 0)
    finally:
        await close_fleet(fleet)
