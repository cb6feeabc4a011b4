"""Aggregated engines of one model that differ in their KV cache (engine config
`num_kv_blocks`: so in the context they take), real torch engines on the builtin model behind
a controller that does not tokenise a text prompt (past `tokenize_max_chars`), so the gateway
cannot tell a text prompt's size before an engine does: a prompt the small engine refuses
for its size ("does not fit the KV cache", INVALID_ARGUMENT) is sent to the large one and
served, on OpenEngine Generate and vllm.Generate alike; one past every engine's cache ends
with the large engine's refusal, naming the largest cache; and with the large engine out of
routing, UNAVAILABLE naming it, also when it leaves routing while the small engine holds
the request (sim engines behind a front that holds the request there). The small engine's
refusal used to end the request, though the large engine would have served it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from controller.route_report import read_route
from engine.config import EngineRoleName
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import (
    EngineFleet,
    Fleet,
    ServedEngine,
    close_fleet,
    make_fleet,
    start_sim_engine,
)
from tests.controller.fronted_engine import Context, Forwarding, start_fronted_engine
from tests.controller.test_gateway import generate_routed
from tests.controller.test_kv_capacity_fleet import (
    LARGE,
    LONG_TEXT,
    SMALL,
    builtin_engine,
    text_request,
)
from vllm_grpc import vllm_grpc_pb2 as vpb
from vllm_grpc import vllm_grpc_pb2_grpc as vpb_grpc

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Fleet]:
    """An engine whose cache holds 128 tokens beside one whose cache holds 1024 (LONG_TEXT:
    480 tokens, between the two). Past 100 characters a text prompt is not tokenised here;
    round robin sends every other request to the small engine first."""
    monkeypatch.setenv("KVPLANE_CACHE_DIR", str(tmp_path))
    aggregated = EngineRoleName.aggregated
    engines = [
        await builtin_engine("small", aggregated, SMALL),
        await builtin_engine("large", aggregated, LARGE),
    ]
    fleet = await make_fleet(
        engines=engines, tokenize_max_chars=100, router={"policy": "round_robin"}
    )
    try:
        yield fleet
    finally:
        await close_fleet(fleet)


async def test_a_prompt_the_small_engine_refuses_is_served_by_the_large_one(
    fleet: Fleet,
) -> None:
    """Every request finishes on the large engine, those sent to the small one first retried
    from it; vllm.Generate alike."""
    small, large = (fleet.address(e) for e in fleet.engines)
    retried = []
    for i in range(4):
        reply, route = await generate_routed(fleet, text_request(f"long{i}", f"{i} {LONG_TEXT}"))
        assert reply[-1].WhichOneof("event") == "finished", reply[-1]
        assert reply[-1].usage.prompt_tokens > SMALL * 16
        assert route is not None and route["engine"] == large, route
        retried.append(route.get("retried_from"))
    assert [small] in retried, retried
    for i in range(2):
        stopping = vpb.StoppingCriteria(max_new_tokens=4)
        vllm_route = await vllm_served(fleet, f"vllm{i}", f"{i} {LONG_TEXT}", stopping)
        assert vllm_route["engine"] == large, vllm_route


async def test_a_prompt_past_every_engine_ends_with_the_largest_engines_refusal(
    fleet: Fleet,
) -> None:
    """1440 tokens, past both caches: INVALID_ARGUMENT, in the large engine's words (its
    cache of 64 blocks), whichever engine round robin chose first."""
    for i in range(2):
        call = fleet.gateway.Generate(text_request(f"huge{i}", LONG_TEXT * 3))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            [r async for r in call]
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = caught.value.details() or ""
        assert "does not fit the KV cache" in details and f"{LARGE} blocks" in details, details


async def test_with_the_large_engine_out_of_routing_the_prompt_is_unavailable(
    fleet: Fleet,
) -> None:
    """The large engine cordoned: the small engine's refusal is not the request's last word
    (the large engine takes it once it is back), so UNAVAILABLE, naming both."""
    small, large = (fleet.address(e) for e in fleet.engines)
    fleet.app.controller.fleet.registry.set_cordoned(large, True)
    call = fleet.gateway.Generate(text_request("cordoned", LONG_TEXT))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [r async for r in call]
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
    details = caught.value.details() or ""
    assert f"engine {small} refused the request" in details, details
    assert "large cordoned" in details, details
    assert f"small max_context_length {SMALL * 16 + 1} < {SMALL * 16 + 2}" in details, details


async def test_a_minimum_output_past_the_small_engine_goes_to_the_large_one_first(
    fleet: Fleet,
) -> None:
    """A short text prompt (not tokenised here) asking at least 130 new tokens (`min_tokens`,
    vllm.Generate's `min_new_tokens`): past the small engine's context (129) whatever the
    prompt, so sent to the large one at once, never first to the small one to be refused; at
    least 2000, past every engine's, refused before any engine is asked, naming the largest
    context. Before, the minimum went unjudged while the prompt's length was unknown: every
    other request went to the small engine first (its refusal re-routed), and one past every
    engine was sent to each in turn, to end with the large one's refusal."""
    large = fleet.address(fleet.engines[1])
    text = "hello world " * 10  # past tokenize_max_chars: not tokenised here
    for i in range(2):  # round robin: one of them would go to the small engine first
        request = text_request(f"min{i}", f"{i} {text}")
        request.stopping.min_tokens = request.stopping.max_tokens = 130
        reply, route = await generate_routed(fleet, request)
        assert reply[-1].WhichOneof("event") == "finished", reply[-1]
        assert route is not None and route["engine"] == large, route
        assert "retried_from" not in route, route
    for i in range(2):
        stopping = vpb.StoppingCriteria(max_new_tokens=130, min_new_tokens=130)
        vllm_route = await vllm_served(fleet, f"vllm-min{i}", f"{i} {text}", stopping)
        assert vllm_route["engine"] == large and "retried_from" not in vllm_route, vllm_route
    request = text_request("min-huge", text)
    request.stopping.min_tokens = request.stopping.max_tokens = 2000
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await generate_routed(fleet, request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    assert caught.value.details() == (
        "the request needs max_context_length 2000; the largest any engine serving model "
        f"'builtin' takes is {LARGE * 16 + 1}"
    ), caught.value.details()


class Gated(Forwarding):
    """The sim engine behind, each Generate held at the front until `proceed` is set (the
    test changes the fleet meanwhile), then the engine's answer, its status passed on;
    `arrived` is set when one comes."""

    def __init__(self, inner: pb_grpc.OpenEngineAsyncStub) -> None:
        super().__init__(inner)
        self.arrived = asyncio.Event()
        self.proceed = asyncio.Event()

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.arrived.set()
        await self.proceed.wait()
        try:
            async for response in self.inner.Generate(request):
                yield response
        except grpc.aio.AioRpcError as refused:  # passed on as the engine said it
            await context.abort(refused.code(), refused.details() or "")


async def test_a_longer_engine_leaving_routing_during_the_refusal_leaves_it_unavailable() -> None:
    """Sim engines (no tokenizer: each refuses a text prompt INVALID_ARGUMENT, which the
    gateway cannot tell from a refusal of its length) of a short and a long context; the
    long one is cordoned while the short one holds the request: UNAVAILABLE, naming the
    cordoned engine, as when it was out of routing before. The long engine was judged by
    the plan's candidates, routable then: the request was sent on, no engine took it, and
    the short engine's refusal came back as the request's last word."""
    short = await start_fronted_engine("short", Gated, max_model_len=128)
    long = await start_sim_engine("long", max_model_len=1024)
    fleet: EngineFleet[ServedEngine] = await make_fleet(
        engines=[short, long], tokenize_max_chars=1, router={"policy": "round_robin"}
    )
    try:
        registry = fleet.app.controller.fleet.registry
        for i in range(2):  # round robin: one of two goes to the short engine first
            request = pb.GenerateRequest(request_id=f"r{i}", model="sim", prompt="a prompt")
            call = fleet.gateway.Generate(request)
            replies = asyncio.ensure_future(_stream(call))
            arrived = asyncio.ensure_future(short.servicer.arrived.wait())
            await asyncio.wait([replies, arrived], return_when=asyncio.FIRST_COMPLETED)
            if arrived.done():
                break
            arrived.cancel()
        else:
            pytest.fail("no request went to the short engine first")
        registry.set_cordoned(fleet.address(long), True)
        short.servicer.proceed.set()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await replies
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
        details = caught.value.details() or ""
        assert f"engine {fleet.address(short)} refused the request" in details, details
        assert "long cordoned" in details, details
    finally:
        await close_fleet(fleet)


async def vllm_served(
    fleet: Fleet, request_id: str, text: str, stopping: vpb.StoppingCriteria
) -> dict[str, Any]:
    """A vllm.Generate of `text` through the gateway, finished; its route."""
    request = vpb.GenerateRequest(
        request_id=request_id, model="builtin", text=text, stopping=stopping
    )
    call = vpb_grpc.GenerateStub(fleet.channel).GenerateStream(request)
    chunks = [r async for r in call]
    assert chunks[-1].outputs.HasField("finish_info"), chunks[-1]
    route = read_route(await call.trailing_metadata())
    assert route is not None
    return route


async def _stream(call: Any) -> list[pb.GenerateResponse]:
    return [r async for r in call]
