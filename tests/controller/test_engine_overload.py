"""An engine at its admission bound (`max_queued_requests`) behind the gateway: a real
controller in front of two real sim engines with one seat each, one of them holding a long
request and a queued one. Its refusal (RESOURCE_EXHAUSTED before acceptance) is retried once
on the other engine, so the client is served, through OpenEngine Generate and vllm.Generate
alike; and it is no fault of the engine's: with outlier ejection set to eject at the first
fault, the refusing engine stays in routing. With both engines full, the client gets the
engine's own refusal. A client that leaves (a cancel, its deadline) frees its engine seat or
queue place at once and counts as "cancelled"."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, get_args

import grpc
import pytest

from controller.metrics import RequestOutcome
from engine.server.service import EngineApp
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import (
    Fleet,
    close_fleet,
    generate_request,
    make_fleet,
    start_sim_engine,
)
from tests.grpc_streams import next_reply
from tests.polling import eventually
from vllm_grpc import vllm_grpc_pb2 as vpb
from vllm_grpc import vllm_grpc_pb2_grpc as vpb_grpc

pytestmark = pytest.mark.timeout(90)

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


async def start_bounded_engine(name: str) -> EngineApp:
    """One seat, real-time sim steps (a long request holds the seat), one request queued at
    most, Prometheus metrics on."""
    return await start_sim_engine(
        name,
        time_scale=1.0,
        max_num_seqs=1,
        max_queued_requests=1,
        max_model_len=4096,
        num_kv_blocks=2048,
        metrics_listen="127.0.0.1:0",
    )


@asynccontextmanager
async def overload_fleet() -> AsyncIterator[Fleet]:
    """e0 and e1 behind a gateway that ejects an engine at its first fault, routing round
    robin: blind to load, it sends e0 its turn however full e0 is."""
    engines = [await start_bounded_engine(name) for name in ("e0", "e1")]
    fleet = await make_fleet(
        engines=engines, router={"policy": "round_robin"}, health={"eject_after_failures": 1}
    )
    try:
        yield fleet
    finally:
        await close_fleet(fleet)


@asynccontextmanager
async def filled(fleet: Fleet, engine: EngineApp, *, to_bound: bool = True) -> AsyncIterator[None]:
    """`engine` at its bound, by requests sent to it directly: one running until aborted, one
    queued behind it (not with `to_bound` False: its seat taken, its queue empty). Both
    aborted on the way out."""
    channel = grpc.aio.insecure_channel(fleet.address(engine))
    stub = pb_grpc.OpenEngineStub(channel)
    name = engine.instance_id

    async def drain(request: pb.GenerateRequest) -> None:
        async for _ in stub.Generate(request):
            pass

    async def load_is(running: int, queued: int) -> bool:
        load = await stub.GetLoad(pb.GetLoadRequest())
        return (load.running_requests, load.queued_requests) == (running, queued)

    # One after the other: the long one counts as queued until it has the seat.
    long = asyncio.create_task(drain(generate_request(f"{name}-long", PROMPT, 4000)))
    queued: asyncio.Task[None] | None = None
    try:
        await eventually(lambda: load_is(1, 0), what=f"{name}'s long request running")
        if to_bound:
            queued = asyncio.create_task(drain(generate_request(f"{name}-queued", PROMPT, 2)))
            await eventually(lambda: load_is(1, 1), what=f"{name} at its bound")
        yield
    finally:
        await stub.Abort(pb.AbortRequest(all_requests=pb.AllRequests()))
        await asyncio.gather(long, *([queued] if queued is not None else []))
        await channel.close()


async def served(fleet: Fleet, request_id: str) -> bool:
    """One OpenEngine Generate through the gateway ran to its end."""
    request = generate_request(request_id, PROMPT, 2)
    events = [r.WhichOneof("event") async for r in fleet.gateway.Generate(request)]
    return events == ["token", "token", "finished"]


async def served_by_vllm(fleet: Fleet, request_id: str) -> bool:
    """One vllm.Generate (unary) through the gateway ran to its end."""
    reply = await vpb_grpc.GenerateStub(fleet.channel).Generate(
        vpb.GenerateRequest(
            request_id=request_id,
            model="sim",
            token_ids=vpb.TokenIds(ids=PROMPT),
            stopping=vpb.StoppingCriteria(max_new_tokens=2, ignore_eos=True),
        )
    )
    return reply.outputs.finish_info.num_output_tokens == 2


_ids = iter(range(10**6))


async def until_refused_once_more(
    fleet: Fleet, engine: EngineApp, serve: Callable[[Fleet, str], Awaitable[bool]]
) -> int:
    """Requests through the gateway (each served) until `engine` has refused one more; how
    many were sent."""
    before = refusals(engine)
    for sent in range(1, 21):
        assert await serve(fleet, f"r{next(_ids)}")
        if refusals(engine) > before:
            return sent
    raise AssertionError(f"the router sent {engine.instance_id} none of 20 requests")


def refusals(engine: EngineApp) -> float:
    """The engine's own count of requests refused at its bound."""
    metrics = engine.service.metrics
    assert metrics is not None
    return float(metrics.overloaded.labels("sim", "generate")._value.get())


def accepted(engine: EngineApp) -> float:
    metrics = engine.service.metrics
    assert metrics is not None
    return float(metrics.requests.labels("sim")._value.get())


def request_failures(fleet: Fleet, engine: EngineApp) -> int:
    """The faults outlier ejection has counted against `engine`."""
    return fleet.app.controller.fleet.registry.get(fleet.address(engine)).request_failures


async def test_a_refusal_at_the_bound_is_retried_elsewhere_and_is_no_fault() -> None:
    async with overload_fleet() as fleet:
        e0, e1 = fleet.engines
        async with filled(fleet, e0):
            sent = await until_refused_once_more(fleet, e0, served)
            sent += await until_refused_once_more(fleet, e0, served_by_vllm)
        # Each refusal was retried on e1 (it refused none), and the client served.
        assert refusals(e0) == 2 and refusals(e1) == 0
        metrics = fleet.app.controller.metrics
        assert metrics.retries._value.get() == 2
        assert metrics.requests.labels("ok")._value.get() == sent
        assert metrics.ejections._value.get() == 0
        assert request_failures(fleet, e0) == 0
        assert fleet.app.controller.fleet.registry.get(fleet.address(e0)).routable
        # Its queue drained, e0 takes requests again (beside the two that filled it).
        for _ in range(20):
            assert await served(fleet, f"r{next(_ids)}")
            if accepted(e0) > 2:
                break
        assert accepted(e0) == 3 and refusals(e0) == 2


async def test_with_every_engine_full_the_client_gets_the_engines_refusal() -> None:
    async with overload_fleet() as fleet:
        e0, e1 = fleet.engines
        async with filled(fleet, e0), filled(fleet, e1):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await served(fleet, "refused")
            assert refusals(e0) == 1 and refusals(e1) == 1
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_queued_requests is 1" in (refused.value.details() or "")
        assert request_failures(fleet, e0) == request_failures(fleet, e1) == 0
        assert fleet.app.controller.metrics.ejections._value.get() == 0
        assert await served(fleet, "after")


async def test_a_request_every_engine_refused_for_overload_counts_as_overloaded() -> None:
    async with overload_fleet() as fleet:
        e0, e1 = fleet.engines
        async with filled(fleet, e0), filled(fleet, e1):
            with pytest.raises(grpc.aio.AioRpcError):
                await served(fleet, "refused")
        outcomes: Any = fleet.app.controller.metrics.requests
        assert outcomes.labels("engine_error")._value.get() == 0
        assert outcomes.labels("overloaded")._value.get() == 1


async def engine_loads(fleet: Fleet) -> list[tuple[int, int]]:
    """Each engine's own (running, queued) requests, in fleet order."""
    loads = []
    for engine in fleet.engines:
        async with grpc.aio.insecure_channel(fleet.address(engine)) as channel:
            load = await pb_grpc.OpenEngineStub(channel).GetLoad(pb.GetLoadRequest())
        loads.append((load.running_requests, load.queued_requests))
    return loads


async def test_a_client_that_leaves_frees_its_seat_and_counts_as_cancelled() -> None:
    """A client cancelling a running stream, and one whose deadline passes while its request
    waits in an engine's queue: each engine's call ends with the client's (its seat or queue
    place free for the next request), and each request counts once, as "cancelled", so that
    the outcomes add up to the requests the gateway took."""
    async with overload_fleet() as fleet:
        running = fleet.gateway.Generate(generate_request("running", PROMPT, 4000))
        assert (await next_reply(running)).WhichOneof("event") == "token"
        assert sorted(await engine_loads(fleet)) == [(0, 0), (1, 0)]
        running.cancel()
        await eventually(
            lambda: _same(engine_loads(fleet), [(0, 0), (0, 0)]), what="its seat freed"
        )
        e0, e1 = fleet.engines
        async with filled(fleet, e0, to_bound=False), filled(fleet, e1, to_bound=False):
            waiting = fleet.gateway.Generate(generate_request("waiting", PROMPT, 2), timeout=3)
            await eventually(
                lambda: _same(engine_loads(fleet), [(1, 0), (1, 1)]), what="it waiting"
            )
            with pytest.raises(grpc.aio.AioRpcError) as left:
                await waiting.read()
            assert left.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await eventually(
                lambda: _same(engine_loads(fleet), [(1, 0), (1, 0)]), what="its place freed"
            )
        outcomes: Any = fleet.app.controller.metrics.requests
        await eventually(
            lambda: outcomes.labels("cancelled")._value.get() == 2, what="both counted"
        )
        counted = {o: outcomes.labels(o)._value.get() for o in get_args(RequestOutcome)}
        assert sum(counted.values()) == 2
        assert len(fleet.app.controller.router.inflight) == 0
        assert fleet.app.gateway.relay.holding == {}


async def _same(loads: Awaitable[list[tuple[int, int]]], expected: list[tuple[int, int]]) -> bool:
    """Whether the engines' loads are `expected`, whichever engine has which."""
    return sorted(await loads) == sorted(expected)
