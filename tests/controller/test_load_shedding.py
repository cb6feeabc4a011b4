"""Load shedding (`router.reject_when_all_busy`): a real controller in front of scripted
engines (real sim engines behind a thin OpenEngine server, tests/controller/
test_gateway_scripted.py) that report a chosen load through GetLoad. With every engine busy
a new request is refused before any engine sees it, through OpenEngine Generate,
vllm.Generate, the pooling tasks and admin `route` alike, and leaves nothing behind in the
gateway's bookkeeping; off (the default), the busy fleet serves it as it always did."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import grpc
import pytest

from openengine.v1 import openengine_pb2 as pb
from tests.controller.conftest import EngineFleet, close_fleet, generate_request
from tests.controller.test_gateway_scripted import (
    ScriptedEngine,
    ScriptedFleet,
    address,
    cli,
    scripted_fleet,
    start_scripted_engine,
)
from vllm_grpc import vllm_grpc_pb2 as vpb
from vllm_grpc import vllm_grpc_pb2_grpc as vpb_grpc

pytestmark = pytest.mark.timeout(60)

# The sim engines have 256 KV blocks: 250 held is 97.7%, past the default 97%.
FULL = {"used_kv_blocks": 250, "total_kv_blocks": 256}
REFUSAL = "every engine is busy (KV usage >= 97% or queued requests >= 8): retry later"
PROMPT = [1, 2, 3, 4, 5, 6, 7]


async def busy_fleet(
    *, reject: bool, policy: str = "kvplane"
) -> tuple[ScriptedFleet, list[ScriptedEngine]]:
    """Two engines that take Generate and Embed, both reporting a full KV cache (e1 fewer
    running requests than e0), with the controller's polls showing it."""
    engines = [
        await start_scripted_engine(name, tasks=frozenset({"embed"})) for name in ("e0", "e1")
    ]
    engines[0].servicer.load = {**FULL, "running_requests": 5}
    engines[1].servicer.load = {**FULL, "running_requests": 1}
    router: dict[str, object] = {"policy": policy, "busy_queued_requests": 8}
    if reject:  # else the default, off
        router["reject_when_all_busy"] = True
    fleet = await scripted_fleet(*engines, router=router)
    await wait_load(fleet, engines)
    return fleet, engines


async def wait_load(fleet: EngineFleet[Any], engines: list[ScriptedEngine]) -> None:
    """Until the controller's last GetLoad of each engine shows what it reports."""
    registry = fleet.app.controller.fleet.registry

    def shown() -> bool:
        return all(
            registry.get(address(e)).load.used_kv_blocks == e.servicer.load.get("used_kv_blocks")
            for e in engines
        )

    await fleet.app.controller.fleet.wait_for(shown, 15)


def vllm_request(request_id: str) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(
        request_id=request_id, model="sim", token_ids=vpb.TokenIds(ids=PROMPT),
        stopping=vpb.StoppingCriteria(max_new_tokens=2, ignore_eos=True),
    )  # fmt: skip


def embed_request(request_id: str) -> pb.EmbedRequest:
    return pb.EmbedRequest(
        context=pb.TaskRequestContext(request_id=request_id, model="sim"),
        inputs=[pb.TaskInput(item_id="i", token_ids=pb.TokenIds(ids=PROMPT))],
    )


async def refusal(call: Awaitable[object]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value


@pytest.mark.parametrize("policy", ["kvplane", "round_robin"])
async def test_every_engine_busy_refuses_new_requests_before_any_engine(policy: str) -> None:
    fleet, engines = await busy_fleet(reject=True, policy=policy)
    controller = fleet.app.controller
    relay = fleet.app.gateway.relay
    try:
        refused = [
            await refusal(fleet.gateway.Generate(generate_request("r1", PROMPT)).read()),
            await refusal(vpb_grpc.GenerateStub(fleet.channel).Generate(vllm_request("v1"))),
            await refusal(fleet.gateway.Embed(embed_request("t1"))),
        ]
        assert [(e.code(), e.details()) for e in refused] == [
            (grpc.StatusCode.RESOURCE_EXHAUSTED, REFUSAL)
        ] * 3
        assert all(e.servicer.generate_calls == e.servicer.task_calls == [] for e in engines)
        metrics = controller.metrics
        assert metrics.requests.labels("overloaded")._value.get() == 2  # the generations
        assert metrics.requests.labels("no_engine")._value.get() == 0
        assert metrics.decisions.labels(policy, "overloaded", "none")._value.get() == 2
        # Nothing of the refused requests is left: no id held, no engine charged.
        assert relay.running == set() and relay.holding == {}
        assert all(controller.router.inflight.engine_of(rid) is None for rid in ("r1", "v1"))
        assert all(controller.router.inflight.of(address(e)).requests == 0 for e in engines)

        route = await cli("route", "--prompt", "hello", "--target", fleet.target)
        assert route.exit_code == 1
        assert "RESOURCE_EXHAUSTED" in str(route.exception)
        assert REFUSAL in str(route.exception)

        # e1 has room again: the same request id is taken (not ALREADY_EXISTS) and served;
        # where is the policy's choice (kvplane skips the busy e0, round robin does not).
        engines[1].servicer.load = {"used_kv_blocks": 10}
        await wait_load(fleet, engines)
        replies = [r async for r in fleet.gateway.Generate(generate_request("r1", PROMPT))]
        assert replies[-1].WhichOneof("event") == "finished"
        calls = (engines[0].servicer.generate_calls, engines[1].servicer.generate_calls)
        assert calls == ([], ["r1"]) if policy == "kvplane" else sorted(calls) == [[], ["r1"]]
        assert (await fleet.gateway.Embed(embed_request("t2"))).request_id == "t2"
        assert engines[1].servicer.task_calls == ["embed"]
        assert metrics.requests.labels("ok")._value.get() == 1
        assert relay.running == set() and relay.holding == {}
    finally:
        await close_fleet(fleet)


async def test_without_rejection_a_busy_fleet_serves_as_before() -> None:
    """The default: the least loaded of the busy engines takes the request."""
    fleet, engines = await busy_fleet(reject=False)
    try:
        replies = [r async for r in fleet.gateway.Generate(generate_request("r1", PROMPT))]
        assert replies[-1].WhichOneof("event") == "finished"
        assert (await fleet.gateway.Embed(embed_request("t1"))).request_id == "t1"
        assert engines[1].servicer.generate_calls == ["r1"]
        assert engines[1].servicer.task_calls == ["embed"]
        metrics = fleet.app.controller.metrics
        assert metrics.requests.labels("ok")._value.get() == 1
        assert metrics.requests.labels("overloaded")._value.get() == 0
        route = await cli("route", "--prompt", "hello", "--target", fleet.target)
        assert route.exit_code == 0, route.output
        assert route.output.startswith(f"-> e1 ({address(engines[1])})")
    finally:
        await close_fleet(fleet)
