"""The controller end to end: real sim engines behind a real controller, real gRPC clients.
Requests sharing a prefix land where it lives; drained, cordoned and dead engines get no
traffic; failures before the first token are retried elsewhere; abort and LoRA fan out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import pytest
from google.protobuf.message import Message

from controller.metrics import ControllerMetrics
from controller.outcomes import ENGINE_METADATA_KEY, OUTCOME_METADATA_KEY
from controller.registry import EngineState, Registry
from controller.relay import RecentIds
from controller.route_report import read_route
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import (
    EngineFleet,
    Fleet,
    close_fleet,
    ended_while_queued,
    engines_of_kinds,
    generate_request,
    make_fleet,
    start_sim_engine,
    vllm_ended_while_queued,
)
from tests.controller.fronted_engine import Forwarding, start_fronted_engine
from tests.controller.test_fleet_events import scrape
from tests.partial_servicers import PartialOpenEngine
from tests.polling import eventually

if TYPE_CHECKING:
    from tests.redis_servers import RedisServer

pytestmark = pytest.mark.timeout(60)

PREFIX = list(range(100, 164))  # 4 blocks of 16


async def generate(
    fleet: EngineFleet[Any], request: pb.GenerateRequest
) -> list[pb.GenerateResponse]:
    return [r async for r in fleet.gateway.Generate(request)]


def record_routes(fleet: Fleet) -> list[str]:
    """The engines the controller chooses from now on, one entry per routing decision."""
    controller = fleet.app.controller
    chosen: list[str] = []
    route = controller.route

    def recording_route(*args: object, **kwargs: object) -> object:
        decision = route(*args, **kwargs)  # type: ignore[arg-type]
        chosen.append(decision.engine_id)
        return decision

    controller.route = recording_route  # type: ignore[method-assign,assignment]
    return chosen


async def holder_of(fleet: EngineFleet[Any], tokens: list[int], blocks: int) -> str:
    """Wait until the index places `blocks` blocks of `tokens` on one engine; its address."""
    found: list[str] = []

    async def check() -> bool:
        reply = await fleet.admin.Match(apb.PromptQuery(token_ids=pb.TokenIds(ids=tokens)))
        found[:] = [m.engine for m in reply.matches if m.device_blocks >= blocks]
        return bool(found)

    await eventually(check)
    return found[0]


async def test_shared_prefix_lands_where_it_lives(fleet: Fleet) -> None:
    first = await generate(fleet, generate_request("a", [*PREFIX, 1, 2, 3]))
    assert first[-1].WhichOneof("event") == "finished"
    assert first[-1].usage.cached_prompt_tokens == 0
    holder = await holder_of(fleet, PREFIX, 4)
    explained = await fleet.admin.Route(apb.PromptQuery(token_ids=pb.TokenIds(ids=[*PREFIX, 9])))
    assert (explained.engine, explained.reason) == (holder, "cache")
    assert explained.predicted_cached_tokens == 64
    assert len(explained.costs) == 3
    for i in range(6):
        reply = await generate(fleet, generate_request(f"b{i}", [*PREFIX, 50 + i, 7, 8]))
        assert reply[-1].usage.cached_prompt_tokens == 64  # served from the holder's cache
    metrics = fleet.app.controller.metrics
    assert metrics.actual_cached_tokens._value.get() == 6 * 64
    assert metrics.cached_tokens_abs_error._value.get() == 0
    assert metrics._cached_tokens_accuracy() == 1.0


async def test_a_bypass_prefix_cache_request_is_not_routed_by_the_cache(fleet: Fleet) -> None:
    """`kv.bypass_prefix_cache`: the engine reads no cached prefix for the request (seed), so
    the router does not steer it to the engine holding its prefix ("cache") nor predict a
    cached token, and the prediction accuracy counts no miss for it."""
    await generate(fleet, generate_request("a", [*PREFIX, 1]))
    await holder_of(fleet, PREFIX, 4)
    metrics = fleet.app.controller.metrics

    def by_cache() -> float:
        return float(metrics.decisions.labels("kvplane", "cache", "aggregated")._value.get())

    predicted_before, by_cache_before = metrics.predicted_cached_tokens._value.get(), by_cache()
    for i in range(3):
        request = generate_request(f"bypass{i}", [*PREFIX, 10 + i])
        request.kv.bypass_prefix_cache = True
        reply = await generate(fleet, request)
        assert reply[-1].usage.cached_prompt_tokens == 0  # the engine read no cache
    assert by_cache() == by_cache_before
    assert metrics.predicted_cached_tokens._value.get() == predicted_before
    assert metrics.cached_tokens_abs_error._value.get() == 0
    assert metrics._cached_tokens_accuracy() == 1.0
    # The same prompt reading the cache is served from it, as predicted (the bypass requests
    # stored the prefix where they ran: any engine may hold it now).
    reply = await generate(fleet, generate_request("cached", [*PREFIX, 20]))
    assert reply[-1].usage.cached_prompt_tokens == 64
    assert metrics.predicted_cached_tokens._value.get() == predicted_before + 64


async def test_each_model_is_matched_in_its_own_block_size() -> None:
    """A fleet serving two models of different block sizes: a prompt is hashed in the block
    size of its model's engines. (It was hashed in the first engine's, whichever model that
    served, so the other model's cache was invisible to the router.)"""
    small = await start_sim_engine("e0", served_model_name="small", block_size=16)
    big = [await start_sim_engine(f"e{i}", served_model_name="big", block_size=32) for i in (1, 2)]
    fleet = await make_fleet(engines=[small, *big])
    prompt = [*PREFIX, *range(900, 964)]  # 128 tokens: eight blocks of 16, four of 32
    try:
        for model, block_size, reason in (("small", 16, "only"), ("big", 32, "cache")):
            first = generate_request(f"{model}-a", [*prompt, 1])
            first.model = model
            await generate(fleet, first)
            query = apb.PromptQuery(token_ids=pb.TokenIds(ids=[*prompt, 2]), model=model)

            async def indexed(
                query: apb.PromptQuery = query, blocks: int = 128 // block_size
            ) -> bool:
                reply = await fleet.admin.Match(query)
                return any(m.device_blocks == blocks for m in reply.matches)

            await eventually(indexed)
            assert (await fleet.admin.Match(query)).block_size == block_size
            explained = await fleet.admin.Route(query)
            assert explained.reason == reason and explained.predicted_cached_tokens == 128
            again = generate_request(f"{model}-b", [*prompt, 3])
            again.model = model
            assert (await generate(fleet, again))[-1].usage.cached_prompt_tokens == 128
    finally:
        await close_fleet(fleet)


def test_cached_token_prediction_accuracy_weighs_errors_by_size() -> None:
    metrics = ControllerMetrics(Registry())
    assert metrics._cached_tokens_accuracy() == 1.0  # nothing predicted yet
    for predicted, reported in ((64, 64), (64, 0), (0, 32)):
        metrics.record_cache_prediction(predicted, reported)
    # errors 0 + 64 + 32 over max sums 64 + 64 + 32
    assert metrics._cached_tokens_accuracy() == pytest.approx(1 - 96 / 160)


async def test_draining_engine_gets_no_traffic(fleet: Fleet) -> None:
    await generate(fleet, generate_request("a", [*PREFIX, 1]))
    holder = await holder_of(fleet, PREFIX, 4)
    events = [e async for e in fleet.admin.DrainEngine(apb.DrainEngineRequest(engine=holder))]
    assert events[-1].state == pb.DRAIN_STATE_COMPLETE
    record = fleet.app.controller.fleet.registry.get(holder)
    assert record.state is EngineState.DRAINING and not record.routable
    explained = await fleet.admin.Route(apb.PromptQuery(token_ids=pb.TokenIds(ids=[*PREFIX, 9])))
    assert explained.engine != holder
    assert holder not in {c.engine for c in explained.costs}
    for i in range(4):
        reply = await generate(fleet, generate_request(f"d{i}", [*PREFIX, 60 + i]))
        assert reply[-1].WhichOneof("event") == "finished"
    assert fleet.engine_at(holder).service is not None


async def test_cordoned_engine_gets_no_traffic_until_uncordoned(fleet: Fleet) -> None:
    await generate(fleet, generate_request("a", [*PREFIX, 1]))
    holder = await holder_of(fleet, PREFIX, 4)
    info = await fleet.admin.Cordon(apb.EngineRef(engine=holder))
    assert info.cordoned and not info.routable
    reply = await generate(fleet, generate_request("c1", [*PREFIX, 2]))
    assert reply[-1].usage.cached_prompt_tokens == 0
    await fleet.admin.Uncordon(
        apb.EngineRef(engine=fleet.app.controller.fleet.registry.get(holder).engine_id)
    )
    reply = await generate(fleet, generate_request("c2", [*PREFIX, 3]))
    assert reply[-1].usage.cached_prompt_tokens == 64


async def generate_routed(
    fleet: EngineFleet[Any], request: pb.GenerateRequest
) -> tuple[list[pb.GenerateResponse], dict[str, Any] | None]:
    """The stream and its `kvplane-route` trailing metadata."""
    call = fleet.gateway.Generate(request)
    reply = [r async for r in call]
    return reply, read_route(await call.trailing_metadata())


async def test_the_route_names_the_engine_that_served(fleet: Fleet) -> None:
    """`kvplane-route`: the engine that served the request and the router's decision; the
    same prompt again lands on the engine holding its prefix, as predicted, and that
    engine's own count of cached tokens agrees."""
    first, route = await generate_routed(fleet, generate_request("a", [*PREFIX, 1]))
    assert route is not None
    served = fleet.engine_at(route["engine"])
    assert route["instance_id"] == served.instance_id
    assert route["predicted_cached_tokens"] == 0 and route["retried"] is False
    assert "prefill" not in route and "retried_from" not in route
    assert first[-1].usage.cached_prompt_tokens == 0
    assert await holder_of(fleet, PREFIX, 4) == route["engine"]

    again, second = await generate_routed(fleet, generate_request("b", [*PREFIX, 1]))
    assert second is not None
    assert (second["engine"], second["instance_id"]) == (route["engine"], route["instance_id"])
    assert (second["reason"], second["policy"]) == ("cache", "kvplane")
    assert second["predicted_cached_tokens"] == 64
    assert again[-1].usage.cached_prompt_tokens == 64


async def test_the_route_of_a_request_no_engine_takes_names_the_engine_that_failed_it() -> None:
    """A failure once an engine was chosen carries the route too (its status aborts the
    call with the metadata set by then)."""
    fleet = await make_fleet(1, health={"poll_interval_s": 60, "load_poll_interval_s": 60})
    try:
        address = fleet.address(fleet.engines[0])
        await fleet.engines[0].server.stop(None)
        call = fleet.gateway.Generate(generate_request("a", [*PREFIX, 1]))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [r async for r in call]
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        route = read_route(err.value.trailing_metadata())
        assert route is not None
        assert (route["engine"], route["instance_id"], route["retried"]) == (address, "e0", False)
    finally:
        await close_fleet(fleet)


async def test_dead_engine_before_first_token_is_retried_elsewhere() -> None:
    # Slow polls: the controller still believes the killed engine is ready.
    fleet = await make_fleet(2, health={"poll_interval_s": 60, "load_poll_interval_s": 60})
    try:
        await generate(fleet, generate_request("a", [*PREFIX, 1]))
        holder = await holder_of(fleet, PREFIX, 4)
        await fleet.engine_at(holder).server.stop(None)
        reply, route = await generate_routed(fleet, generate_request("b", [*PREFIX, 2]))
        assert reply[-1].WhichOneof("event") == "finished"
        assert reply[-1].usage.cached_prompt_tokens == 0  # recomputed on the other engine
        assert fleet.app.controller.metrics.retries._value.get() == 1
        (other,) = [fleet.address(e) for e in fleet.engines if fleet.address(e) != holder]
        assert route is not None
        assert (route["engine"], route["retried"], route["retried_from"]) == (
            other,
            True,
            [holder],
        )
        assert route["instance_id"] == fleet.engine_at(other).instance_id
        assert len(fleet.app.controller.router.inflight) == 0
    finally:
        await close_fleet(fleet)


async def test_engine_killed_mid_stream_ends_with_one_engine_error() -> None:
    fleet = await make_fleet(
        2, time_scale=1.0, health={"poll_interval_s": 60, "load_poll_interval_s": 60}
    )
    try:
        responses: list[pb.GenerateResponse] = []
        stream = fleet.gateway.Generate(generate_request("long", [*PREFIX, 1], max_tokens=2000))
        async for response in stream:
            responses.append(response)
            if len(responses) == 1:
                for engine in fleet.engines:
                    await engine.server.stop(None)
        assert responses[0].WhichOneof("event") == "token"
        assert responses[-1].WhichOneof("event") == "error"
        assert [r.WhichOneof("event") for r in responses].count("error") == 1
    finally:
        await close_fleet(fleet)


async def test_a_streaming_request_stops_counting_as_prefill_at_its_first_token() -> None:
    """Once its client has the first token, the router no longer charges the engine with the
    request's prefill (it would read as a prefill queue there for the whole decode), only
    with the request itself, until it ends."""
    fleet = await make_fleet(2, time_scale=1.0)
    try:
        stream = fleet.gateway.Generate(generate_request("long", [*PREFIX, 1], max_tokens=2000))
        first = await stream.read()
        assert isinstance(first, pb.GenerateResponse) and first.WhichOneof("event") == "token"
        router = fleet.app.controller.router
        holder = fleet.app.gateway.relay.holding["long"]
        assert not router.inflight.is_prefilling("long")
        load = router.inflight.of(holder)
        assert (load.requests, load.prefilling, load.prefill_tokens) == (1, 0, 0)
        stream.cancel()
        await eventually(lambda: len(router.inflight) == 0)
    finally:
        await close_fleet(fleet)


async def test_abort_goes_to_the_engine_holding_the_request() -> None:
    """Only there: another client's request of the same id, sent straight to the other
    engine, keeps running."""
    fleet = await make_fleet(2, time_scale=1.0)
    try:
        stream = fleet.gateway.Generate(generate_request("long", [*PREFIX, 1], max_tokens=2000))
        first = await stream.read()
        assert isinstance(first, pb.GenerateResponse)
        events = [str(first.WhichOneof("event"))]
        holder = fleet.app.gateway.relay.holding["long"]
        other = next(fleet.address(e) for e in fleet.engines if fleet.address(e) != holder)
        async with grpc.aio.insecure_channel(other) as channel:
            direct = pb_grpc.OpenEngineStub(channel)
            twin = direct.Generate(generate_request("long", [*PREFIX, 2], max_tokens=2000))
            running = await twin.read()
            assert isinstance(running, pb.GenerateResponse)
            assert running.WhichOneof("event") == "token"
            reply = await fleet.gateway.Abort(pb.AbortRequest(request_id="long"))
            assert reply.status == pb.ABORT_STATUS_ABORTED
            while isinstance(response := await stream.read(), pb.GenerateResponse):
                events.append(str(response.WhichOneof("event")))
            # The twin runs until its own client aborts it.
            mine = await direct.Abort(pb.AbortRequest(request_id="long"))
            assert mine.status == pb.ABORT_STATUS_ABORTED
            twin.cancel()
        assert events[-1] in ("finished", "error")
        assert len(events) < 2000
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.gateway.Abort(pb.AbortRequest(request_id="nobody"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        everything = await fleet.gateway.Abort(pb.AbortRequest(all_requests=pb.AllRequests()))
        assert everything.message.count(": ok") == 2
    finally:
        await close_fleet(fleet)


@pytest.mark.parametrize("how", ["cancel", "deadline"])
async def test_a_client_that_gives_up_stops_its_request_on_the_engine(how: str) -> None:
    """Seed: a client's cancellation or deadline expiration stops the running work: the
    engine's request ends then, not after its 3,500 tokens (about 20 s), and Abort of its
    id then answers ALREADY_FINISHED, from the engine as from the gateway."""
    fleet = await make_fleet(1, time_scale=1.0)
    engine = fleet.address(fleet.engines[0])
    try:
        request = generate_request("gone", [*PREFIX, 1], max_tokens=3500)
        call = fleet.gateway.Generate(request, timeout=5 if how == "deadline" else None)
        first = await call.read()
        assert isinstance(first, pb.GenerateResponse) and first.WhichOneof("event") == "token"
        if how == "cancel":
            call.cancel()
        else:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while await call.read() is not grpc.aio.EOF:
                    pass
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

        async def ended_on_the_engine() -> bool:
            reply = await engine_answer(engine, "Abort", pb.AbortRequest(request_id="gone"))
            assert isinstance(reply, pb.AbortResponse)
            return reply.status == pb.ABORT_STATUS_ALREADY_FINISHED

        await eventually(ended_on_the_engine)

        async def engine_idle() -> bool:
            load = await engine_answer(engine, "GetLoad", pb.GetLoadRequest())
            assert isinstance(load, pb.LoadInfo)
            return load.running_requests == 0

        await eventually(engine_idle)
        reply = await fleet.gateway.Abort(pb.AbortRequest(request_id="gone"))
        assert reply.status == pb.ABORT_STATUS_ALREADY_FINISHED
        assert len(fleet.app.controller.router.inflight) == 0
    finally:
        await close_fleet(fleet)


@pytest.mark.parametrize("target", ["request_id", "all_requests"])
async def test_an_abort_releases_the_engine_from_the_routers_accounting_past_a_stalled_client(
    target: str,
) -> None:
    """A client that stops reading its stream (its flow-control window full, never
    cancelling) keeps the gateway's relay of it open as long as it likes. Once an Abort
    through the gateway ended its request on the engine, the router no longer charges that
    engine with it (admin `workers` INFLIGHT, GetLoad's `inflight=`): the engine is idle,
    and would otherwise look busy to routing until that client leaves (OpenEngine Generate
    and vllm.Generate alike). An engine that never sleeps computes both requests at once,
    their clients' windows full long before: the Abort finds them ALREADY_FINISHED there."""
    from vllm_grpc import vllm_grpc_pb2 as vpb
    from vllm_grpc import vllm_grpc_pb2_grpc as vpb_grpc

    # Room for both requests at once: neither waits for the other's KV blocks.
    roomy = await start_sim_engine("e0", num_kv_blocks=1100, max_model_len=4096)
    fleet = await make_fleet(engines=[roomy])
    engine = fleet.address(roomy)
    inflight = fleet.app.controller.router.inflight
    try:
        async with grpc.aio.insecure_channel(
            fleet.target,
            options=[("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)],
        ) as slow_reader:
            openengine = pb_grpc.OpenEngineStub(slow_reader).Generate(
                generate_request("openengine", [*PREFIX, 1], max_tokens=3500)
            )
            vllm = vpb_grpc.GenerateStub(slow_reader).GenerateStream(
                vpb.GenerateRequest(
                    request_id="vllm",
                    model="sim",
                    token_ids=vpb.TokenIds(ids=[*PREFIX, 2]),
                    stopping=vpb.StoppingCriteria(max_new_tokens=3500, ignore_eos=True),
                )
            )
            for call in (openengine, vllm):
                await call.read()  # then never again

            async def engine_idle() -> bool:
                load = await engine_answer(engine, "GetLoad", pb.GetLoadRequest())
                assert isinstance(load, pb.LoadInfo)
                return (load.running_requests, load.queued_requests) == (0, 0)

            await eventually(engine_idle)
            # The gateway cannot tell until it reads the engine's stream on, which waits for
            # its clients.
            assert inflight.of(engine).requests == 2
            if target == "request_id":
                for request_id in ("openengine", "vllm"):
                    reply = await fleet.gateway.Abort(pb.AbortRequest(request_id=request_id))
                    assert reply.status == pb.ABORT_STATUS_ALREADY_FINISHED, reply
            else:
                everything = pb.AbortRequest(all_requests=pb.AllRequests())
                reply = await fleet.gateway.Abort(everything)
                assert reply.status == pb.ABORT_STATUS_ABORTED  # as an engine answers it
            assert inflight.of(engine).requests == 0
            load = await fleet.gateway.GetLoad(pb.GetLoadRequest())
            assert load.attributes[f"engine.{engine}"].endswith("inflight=0")
            # The gateway still relays to those clients what they have not read.
            assert fleet.app.gateway.relay.running == {"openengine", "vllm"}
            for call in (openengine, vllm):
                call.cancel()

            async def released() -> bool:
                return not fleet.app.gateway.relay.running and len(inflight) == 0

            await eventually(released)
    finally:
        await close_fleet(fleet)


# ---- statuses as an engine answers them (WIRE.md section 3) ----


async def engine_answer(address: str, method: str, request: Any) -> object:
    """What the engine at `address` itself answers: its reply (Generate: its responses), or
    its status code."""
    async with grpc.aio.insecure_channel(address) as direct:
        rpc = getattr(pb_grpc.OpenEngineStub(direct), method)
        try:
            if method == "Generate":
                return [r async for r in rpc(request)]
            return await rpc(request)
        except grpc.aio.AioRpcError as exc:
            return exc.code()


async def status_of(call: Awaitable[object]) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code()


async def test_abort_of_everything_every_engine_refuses_alike_is_their_status(
    tmp_path: Path,
) -> None:
    """Engines that ask for a token the controller lacks (no `engine_token_file`) answer
    its Abort fan-out UNAUTHENTICATED: the gateway's Abort(all_requests) is UNAUTHENTICATED
    too, naming each engine, not UNAVAILABLE "no engine could be reached" (they answered)."""
    token = tmp_path / "token"
    token.write_text("engine-only")
    engines = [await start_sim_engine(f"e{i}", auth={"token_file": token}) for i in range(2)]
    fleet = await make_fleet(engines=engines)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.gateway.Abort(pb.AbortRequest(all_requests=pb.AllRequests()))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for engine in engines:
            assert f"{fleet.address(engine)}: UNAUTHENTICATED" in (err.value.details() or "")
    finally:
        await close_fleet(fleet)


async def test_abort_of_everything_in_a_fleet_without_engines_says_so() -> None:
    """A controller with no engine (just started, its engines not registered again yet)
    has asked none: UNAVAILABLE says so, not a bare "no engine could be reached: "."""
    fleet: Fleet = await make_fleet(engines=[])
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.gateway.Abort(pb.AbortRequest(all_requests=pb.AllRequests()))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert err.value.details() == "no engine could be reached: the fleet has no engine"
    finally:
        await close_fleet(fleet)


async def test_a_running_request_id_is_refused_as_an_engine_refuses_a_duplicate() -> None:
    """A second Generate with the id of a running one is ALREADY_EXISTS and reaches no
    engine: the first keeps streaming on its engine, charged once, and Abort stops it."""
    from vllm_grpc import vllm_grpc_pb2 as vpb
    from vllm_grpc import vllm_grpc_pb2_grpc as vpb_grpc

    fleet = await make_fleet(2, time_scale=1.0, router={"policy": "round_robin"})
    try:
        controller = fleet.app.controller
        inflight = controller.router.inflight
        stream = fleet.gateway.Generate(generate_request("X", [*PREFIX, 1], max_tokens=2000))
        events: list[str] = []
        async for response in stream:
            events.append(str(response.WhichOneof("event")))
            if len(events) == 1:
                first_engine = inflight.engine_of("X")
                assert first_engine is not None
                duplicate = generate_request("X", [*PREFIX, 2], max_tokens=2000)
                expected = await engine_answer(first_engine, "Generate", duplicate)
                assert expected == grpc.StatusCode.ALREADY_EXISTS  # what the engine says
                # Round robin would send the duplicate to the other engine.
                assert await status_of(generate(fleet, duplicate)) == expected
                assert inflight.engine_of("X") == first_engine
                assert len(inflight) == 1
                assert fleet.app.gateway.relay.holding == {"X": first_engine}
            if len(events) == 3:
                reply = await fleet.gateway.Abort(pb.AbortRequest(request_id="X"))
                assert reply.status == pb.ABORT_STATUS_ABORTED
        assert events[:3] == ["token"] * 3
        assert events[-1] == "finished" and len(events) < 2000
        assert len(inflight) == 0
        assert controller.metrics.requests.labels("invalid")._value.get() == 1

        # The id may be used again once its request ended; requests without an id (vLLM's
        # API) are each given their own.
        again = await generate(fleet, generate_request("X", [*PREFIX, 3]))
        assert again[-1].WhichOneof("event") == "finished"
        stub = vpb_grpc.GenerateStub(fleet.channel)
        unnamed = vpb.GenerateRequest(
            model="sim", token_ids=vpb.TokenIds(ids=[*PREFIX, 4]),
            stopping=vpb.StoppingCriteria(max_new_tokens=3, ignore_eos=True),
        )  # fmt: skip
        replies = await asyncio.gather(stub.Generate(unnamed), stub.Generate(unnamed))
        assert [r.outputs.finish_info.finish_reason for r in replies] == [vpb.FinishInfo.LENGTH] * 2
        assert controller.metrics.requests.labels("invalid")._value.get() == 1
    finally:
        await close_fleet(fleet)


async def test_an_unknown_model_is_not_found_and_a_known_one_unavailable_while_unroutable(
    fleet: Fleet,
) -> None:
    """NOT_FOUND (as an engine answers: not worth retrying) for a model no engine serves,
    whatever the engines' health; UNAVAILABLE for one served by engines that take no
    traffic now. Generate and admin Route agree."""
    nosuch = generate_request("n", [1, 2, 3])
    nosuch.model = "nosuch"
    engine = fleet.address(fleet.engines[0])
    assert await engine_answer(engine, "Generate", nosuch) == grpc.StatusCode.NOT_FOUND
    route = apb.PromptQuery(token_ids=pb.TokenIds(ids=[1, 2, 3]), model="nosuch")
    assert await status_of(generate(fleet, nosuch)) == grpc.StatusCode.NOT_FOUND
    assert await status_of(fleet.admin.Route(route)) == grpc.StatusCode.NOT_FOUND

    for e in fleet.engines:
        await fleet.admin.Cordon(apb.EngineRef(engine=fleet.address(e)))
    sim = generate_request("s", [1, 2, 3])
    with pytest.raises(grpc.aio.AioRpcError) as unavailable:
        await generate(fleet, sim)
    assert unavailable.value.code() == grpc.StatusCode.UNAVAILABLE
    # Which engines serve it, and why none takes it.
    reason, engines = (unavailable.value.details() or "").split(": ")
    assert reason == "no engine available for model 'sim'"
    assert sorted(engines.split(", ")) == [f"e{i} cordoned" for i in range(3)]
    route.model = "sim"
    assert await status_of(fleet.admin.Route(route)) == grpc.StatusCode.UNAVAILABLE
    assert await status_of(generate(fleet, nosuch)) == grpc.StatusCode.NOT_FOUND
    route.model = "nosuch"
    assert await status_of(fleet.admin.Route(route)) == grpc.StatusCode.NOT_FOUND
    metrics = fleet.app.controller.metrics
    assert metrics.requests.labels("invalid")._value.get() == 2
    assert metrics.requests.labels("no_engine")._value.get() == 1


async def test_an_empty_prompt_is_refused_by_route_and_match_as_by_generate(
    fleet: Fleet,
) -> None:
    """An empty prompt (no token ids) has nothing to place: Generate gets INVALID_ARGUMENT
    "the prompt is empty" (from the engine), and admin Route and Match, which explain what
    Generate would do, refuse it alike rather than name an engine. (A text "" is empty only
    if it tokenizes to nothing: a tokenizer that adds a start token makes it one token.)"""
    empty = generate_request("e", [])
    assert await status_of(generate(fleet, empty)) == grpc.StatusCode.INVALID_ARGUMENT
    for query in (apb.PromptQuery(token_ids=pb.TokenIds(ids=[])),):
        for call in (fleet.admin.Route, fleet.admin.Match):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(query)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details() == "the prompt is empty"


async def test_model_info_is_refused_as_an_engine_refuses_it(fleet: Fleet) -> None:
    engine = fleet.address(fleet.engines[0])
    for model in ("", "nosuch"):
        request = pb.GetModelInfoRequest(model=model)
        expected = await engine_answer(engine, "GetModelInfo", request)
        assert expected == (
            grpc.StatusCode.INVALID_ARGUMENT if model == "" else grpc.StatusCode.NOT_FOUND
        )
        assert await status_of(fleet.gateway.GetModelInfo(request)) == expected
    sim = pb.GetModelInfoRequest(model="sim")
    # The engine's answer, with the capacity of the fleet's three engines alike.
    expected = await engine_answer(engine, "GetModelInfo", sim)
    assert isinstance(expected, pb.ModelInfo)
    expected.total_kv_blocks *= 3
    expected.max_running_requests *= 3
    assert await fleet.gateway.GetModelInfo(sim) == expected
    for e in fleet.engines:
        await fleet.admin.Cordon(apb.EngineRef(engine=fleet.address(e)))
    with pytest.raises(grpc.aio.AioRpcError) as unavailable:
        await fleet.gateway.GetModelInfo(sim)
    assert unavailable.value.code() == grpc.StatusCode.UNAVAILABLE
    # Why: every engine serving the model is cordoned (a client such as `kvplane complete`
    # asks GetModelInfo first, and would otherwise learn nothing).
    reason, engines = (unavailable.value.details() or "").split(": ")
    assert reason == "no engine serving 'sim' can answer now"
    assert sorted(engines.split(", ")) == [f"e{i} cordoned" for i in range(3)]


async def test_abort_of_a_request_that_ended_is_already_finished(fleet: Fleet) -> None:
    """As an engine answers: ALREADY_FINISHED (a success) for a request that ended, NOT_FOUND
    for an id never seen, INVALID_ARGUMENT for an empty one and for no target at all."""
    chosen = record_routes(fleet)
    done = await generate(fleet, generate_request("done", [*PREFIX, 1]))
    assert done[-1].WhichOneof("event") == "finished"
    assert fleet.app.gateway.relay.holding == {}
    abort = pb.AbortRequest(request_id="done")
    expected = await engine_answer(chosen[0], "Abort", abort)
    assert isinstance(expected, pb.AbortResponse)
    assert expected.status == pb.ABORT_STATUS_ALREADY_FINISHED
    reply = await fleet.gateway.Abort(abort)
    assert reply.status == pb.ABORT_STATUS_ALREADY_FINISHED
    never = pb.AbortRequest(request_id="never")
    assert await engine_answer(chosen[0], "Abort", never) == grpc.StatusCode.NOT_FOUND
    assert await status_of(fleet.gateway.Abort(never)) == grpc.StatusCode.NOT_FOUND
    empty = pb.AbortRequest(request_id="")  # the target set, to an empty id
    assert await engine_answer(chosen[0], "Abort", empty) == grpc.StatusCode.INVALID_ARGUMENT
    assert await status_of(fleet.gateway.Abort(empty)) == grpc.StatusCode.INVALID_ARGUMENT
    untargeted = pb.AbortRequest()  # seed: omitting the target is INVALID_ARGUMENT
    assert await engine_answer(chosen[0], "Abort", untargeted) == grpc.StatusCode.INVALID_ARGUMENT
    assert await status_of(fleet.gateway.Abort(untargeted)) == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_routing_bug_is_internal_for_that_request_only(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    controller = fleet.app.controller
    plan = controller.plan

    async def broken_plan(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(controller, "plan", broken_plan)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(fleet, generate_request("bug", [*PREFIX, 1]))
    assert (err.value.code(), err.value.details()) == (
        grpc.StatusCode.INTERNAL,
        "routing failed; see the log",
    )
    assert controller.metrics._outcomes["internal"]._value.get() == 1
    # Freed as the gateway's handler unwinds, which may be just after the client's status.
    await eventually(lambda: fleet.app.gateway.relay.running == set())
    monkeypatch.setattr(controller, "plan", plan)
    done = await generate(fleet, generate_request("bug", [*PREFIX, 2]))
    assert done[-1].WhichOneof("event") == "finished"


def hold_planning(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> tuple[asyncio.Event, ...]:
    """Hold every request in its planning (as tokenising a long prompt, or asking a slow
    index, would) until the second event returned is set; the first is set once one is."""
    controller = fleet.app.controller
    planning, go_on = asyncio.Event(), asyncio.Event()
    plan = controller.plan

    async def slow_plan(*args: Any, **kwargs: Any) -> Any:
        planning.set()
        await go_on.wait()
        return await plan(*args, **kwargs)

    monkeypatch.setattr(controller, "plan", slow_plan)
    return planning, go_on


@pytest.mark.parametrize("target", ["request_id", "all_requests"])
async def test_abort_of_a_request_still_being_routed_ends_it_before_any_engine(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    """An Abort that arrives while the request is being planned (tokenising a long prompt,
    asking the index) is ABORTED, and the request ends there: no engine ever runs it. Abort
    of every request reaches it too: no engine holds it, so no engine's Abort could. The
    stream ends as an engine ends a request aborted before its prefill (status OK, each
    output finished CANCELLED, the last with the prompt's usage), not with the status
    CANCELLED a client takes for a failure."""
    controller = fleet.app.controller
    early = generate_request("early", [*PREFIX, 1])
    early.sampling.num_sequences = 2
    expected = await ended_while_queued(early)
    planning, go_on = hold_planning(fleet, monkeypatch)
    chosen = record_routes(fleet)
    request = asyncio.ensure_future(generate(fleet, early))
    await asyncio.wait_for(planning.wait(), 30)
    if target == "request_id":
        reply = await fleet.gateway.Abort(pb.AbortRequest(request_id="early"))
    else:
        reply = await fleet.gateway.Abort(pb.AbortRequest(all_requests=pb.AllRequests()))
        assert "gateway: 1 aborted before they were routed" in reply.message
    assert reply.status == pb.ABORT_STATUS_ABORTED
    go_on.set()
    assert await request == expected
    assert [r.finished.reason for r in expected] == [pb.FINISH_REASON_CANCELLED] * 2
    assert expected[-1].usage.prompt_tokens == len(PREFIX) + 1
    assert chosen == []  # never routed
    assert controller.metrics._outcomes["aborted"]._value.get() == 1
    # Freed as the gateway's handler unwinds, which may be just after the client's status.
    await eventually(lambda: fleet.app.gateway.relay.running == set())
    assert fleet.app.gateway.relay.aborted_unrouted == set()
    # The id is free again, and a request with it runs as usual.
    done = await generate(fleet, generate_request("early", [*PREFIX, 2]))
    assert done[-1].WhichOneof("event") == "finished"


@pytest.mark.parametrize("unary", [False, True])
async def test_a_vllm_request_aborted_before_any_engine_ends_aborted_as_on_an_engine(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch, unary: bool
) -> None:
    """vllm.Generate ends an aborted request with `finish_info` ABORTED and status OK, on an
    engine even before its prefill (tests/engine/test_server_vllm.py), as vLLM's server does:
    the gateway ends one aborted while it plans it so too (every sequence of a stream, one
    unary reply, the prompt counted as the engine keeps it), not with the status CANCELLED
    a vLLM client would take for a failure."""
    from vllm_grpc import vllm_grpc_pb2 as vpb
    from vllm_grpc import vllm_grpc_pb2_grpc as vpb_grpc

    request = vpb.GenerateRequest(
        request_id="early", model="sim", token_ids=vpb.TokenIds(ids=[*PREFIX, 1]),
        truncate_prompt_tokens=10, sampling=vpb.RandomSampling(num_sequences=1 if unary else 2),
        response=vpb.ResponseOptions(prompt_token_ids=True),
    )  # fmt: skip
    expected = await vllm_ended_while_queued(request, unary)
    planning, go_on = hold_planning(fleet, monkeypatch)
    chosen = record_routes(fleet)
    stub = vpb_grpc.GenerateStub(fleet.channel)

    async def responses() -> list[vpb.GenerateResponse]:
        if unary:
            return [await stub.Generate(request)]
        return [r async for r in stub.GenerateStream(request)]

    call = asyncio.ensure_future(responses())
    await asyncio.wait_for(planning.wait(), 30)
    reply = await fleet.gateway.Abort(pb.AbortRequest(request_id="early"))
    assert reply.status == pb.ABORT_STATUS_ABORTED
    go_on.set()
    ended = await call
    assert ended == expected
    assert chosen == []  # never routed
    assert [r.outputs.index for r in ended] == ([0] if unary else [0, 1])
    for response in ended:
        finish = response.outputs.finish_info
        assert finish.finish_reason == vpb.FinishInfo.ABORTED
        assert finish.num_output_tokens == response.outputs.num_tokens == 0
    assert ended[0].prompt_info.num_prompt_tokens == 10
    assert list(ended[0].prompt_info.token_ids) == [*PREFIX, 1][-10:]
    assert not any(r.HasField("prompt_info") for r in ended[1:])
    assert fleet.app.controller.metrics._outcomes["aborted"]._value.get() == 1


def test_finished_ids_are_remembered_up_to_the_bound() -> None:
    recent = RecentIds(3)
    for rid in ("a", "b", "c", "a", "d"):  # "a" again: the newest, "b" the oldest
        recent.add(rid)
    assert [rid in recent for rid in "abcd"] == [True, False, True, True]
    assert len(recent) == 3


async def test_client_errors_count_as_invalid_not_engine_errors() -> None:
    """requests_total{outcome="invalid"} on /metrics for requests refused for themselves,
    whether the engine refused them (an empty prompt, a token out of the vocabulary) or the
    gateway (a duplicate id, an unknown model)."""
    fleet = await make_fleet(2, time_scale=1.0, metrics_listen="127.0.0.1:0")
    try:
        empty = generate_request("empty", [])
        oov = generate_request("oov", [1, 10**9])
        engine = fleet.address(fleet.engines[0])
        for request in (empty, oov):
            status = await engine_answer(engine, "Generate", request)
            assert status == grpc.StatusCode.INVALID_ARGUMENT
            assert await status_of(generate(fleet, request)) == status
        nosuch = generate_request("nosuch", [1, 2])
        nosuch.model = "nosuch"
        assert await status_of(generate(fleet, nosuch)) == grpc.StatusCode.NOT_FOUND
        long = fleet.gateway.Generate(generate_request("long", [1, 2], max_tokens=2000))
        await long.read()
        duplicate = generate_request("long", [1, 2])
        assert await status_of(generate(fleet, duplicate)) == grpc.StatusCode.ALREADY_EXISTS
        long.cancel()

        text = await scrape(fleet)
        assert 'kvplane_controller_requests_total{outcome="invalid"} 4.0' in text
        assert 'kvplane_controller_requests_total{outcome="engine_error"} 0.0' in text
    finally:
        await close_fleet(fleet)


# What a refused LoRA call adds: how to have engines that take adapters.
LORA_HOW = (
    "; to use adapters, start engines with LoRA on (the bundled engine's lora.enabled: true, "
    "vLLM's --enable-lora)"
)


async def test_lora_on_a_fleet_without_lora_is_refused_naming_every_engine(fleet: Fleet) -> None:
    # The sim engine with LoRA off (its default) says supports_lora: false; engines that
    # serve LoRA: test_lora_routing.py (scripted) and test_lora_engines.py (the bundled one).
    adapter = pb.LoraAdapter(lora_id=1, lora_name="x", source_path="/tmp")
    for call in (
        fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=adapter)),
        fleet.gateway.UnloadLora(pb.UnloadLoraRequest(lora_name="x")),
        fleet.gateway.ListLoras(pb.ListLorasRequest()),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        for engine in fleet.engines:
            assert f"{fleet.address(engine)}: skipped" in (err.value.details() or "")
        reported = [v for k, v in err.value.trailing_metadata() or () if k == OUTCOME_METADATA_KEY]
        assert len(reported) == 3 and all('"outcome": "skipped"' in str(v) for v in reported)
        assert (err.value.details() or "").startswith("no engine in the fleet supports LoRA: ")
        assert (err.value.details() or "").endswith(LORA_HOW)
    named = fleet.address(fleet.engines[0])
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await fleet.gateway.ListLoras(
            pb.ListLorasRequest(), metadata=((ENGINE_METADATA_KEY, named),)
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details() == f"the engine named does not support LoRA: {named}: skipped" + (
        f" (supports_lora is false){LORA_HOW}"
    )


async def test_a_lora_call_naming_an_empty_engine_is_invalid_argument(fleet: Fleet) -> None:
    """`kvplane-engine: ""` names no engine: the admin API's answer for an empty engine name
    (it was UNKNOWN, 'Unexpected <class EmptyEngineRefError>')."""
    adapter = pb.LoraAdapter(lora_id=1, lora_name="x", source_path="/tmp")
    on_none = ((ENGINE_METADATA_KEY, ""),)
    for call in (
        fleet.gateway.LoadLora(pb.LoadLoraRequest(adapter=adapter), metadata=on_none),
        fleet.gateway.UnloadLora(pb.UnloadLoraRequest(lora_name="x"), metadata=on_none),
        fleet.gateway.ListLoras(pb.ListLorasRequest(), metadata=on_none),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "name the engine by its address or instance id"


async def test_fleet_views_load_health_info(fleet: Fleet) -> None:
    await generate(fleet, generate_request("a", [*PREFIX, 1]))
    load = await fleet.gateway.GetLoad(pb.GetLoadRequest())
    assert load.total_kv_blocks == 3 * 256
    assert load.attributes["routable_engines"] == "3"
    assert sum(k.startswith("engine.") for k in load.attributes) == 3
    health = await fleet.gateway.Health(pb.HealthRequest())
    assert health.state == pb.HEALTH_STATE_READY and len(health.checks) == 3
    info = await fleet.gateway.GetEngineInfo(pb.GetEngineInfoRequest())
    assert (info.schema_revision, info.minimum_client_revision) == (1, 1)
    assert list(info.supported_models) == ["sim"]
    model = await fleet.gateway.GetModelInfo(pb.GetModelInfoRequest(model="sim"))
    assert model.kv_block_size == 16
    workers = await fleet.admin.ListWorkers(apb.ListWorkersRequest())
    assert sorted(w.instance_id for w in workers.workers) == ["e0", "e1", "e2"]
    assert sum(w.indexed_blocks for w in workers.workers) >= 4


async def test_the_fleets_load_sums_every_figure_its_engines_report(fleet: Fleet) -> None:
    """GetLoad has each load figure every engine reports, as their sum (a present zero is a
    measured zero, seed): `active_kv_sessions` and `running_tokens` too, which were absent,
    "unavailable", though every engine reported them."""
    summed = ("running_requests", "queued_requests", "active_kv_sessions", "used_kv_blocks",
              "total_kv_blocks", "running_tokens", "waiting_tokens")  # fmt: skip
    engines: list[Message] = []
    for e in fleet.engines:
        async with grpc.aio.insecure_channel(fleet.address(e)) as direct:
            engines.append(await pb_grpc.OpenEngineStub(direct).GetLoad(pb.GetLoadRequest()))
    assert all(load.HasField(name) for load in engines for name in summed)

    async def sums() -> bool:
        load: Message = await fleet.gateway.GetLoad(pb.GetLoadRequest())
        return all(
            load.HasField(name) and getattr(load, name) == sum(getattr(e, name) for e in engines)
            for name in summed
        )

    await eventually(sums, what="the fleet's load is its engines' sum")


async def test_health_answers_model_role_and_inference_probe_as_an_engine_does(
    fleet: Fleet,
) -> None:
    """Health's request fields, as an engine answers them: NOT_FOUND for a model no engine
    serves, a `role` check that fails (NOT_READY) for a role other than the gateway's
    AGGREGATED, and with `include_inference_probe` an `inference_probe` check: every engine
    taking traffic runs its own probe, READY when each passed (they were ignored: READY,
    no probe)."""
    engine = fleet.address(fleet.engines[0])
    nosuch = pb.HealthRequest(model="nosuch")
    assert await engine_answer(engine, "Health", nosuch) == grpc.StatusCode.NOT_FOUND
    assert await status_of(fleet.gateway.Health(nosuch)) == grpc.StatusCode.NOT_FOUND
    for role in (pb.ENGINE_ROLE_PREFILL, pb.ENGINE_ROLE_AGGREGATED):
        request = pb.HealthRequest(role=role)
        direct = await engine_answer(engine, "Health", request)
        assert isinstance(direct, pb.HealthResponse)
        reply = await fleet.gateway.Health(request)
        assert reply.state == direct.state
        assert [(c.state, c.message) for c in reply.checks if c.name == "role"] == [
            (c.state, c.message) for c in direct.checks if c.name == "role"
        ]
    probed = await fleet.gateway.Health(pb.HealthRequest(include_inference_probe=True, model="sim"))
    assert probed.state == pb.HEALTH_STATE_READY
    (probe,) = [c for c in probed.checks if c.name == "inference_probe"]
    assert probe.state == pb.HEALTH_STATE_READY
    assert sorted(probe.message.split("; ")) == sorted(
        f"{fleet.address(e)}: generated 1 token" for e in fleet.engines
    )


async def test_per_engine_kv_and_runtime_rpcs_are_unimplemented_for_the_fleet(
    fleet: Fleet,
) -> None:
    """KV-connector info, KV-event sources and the KV-event and runtime-event streams
    describe one engine (its endpoints, its sequence numbers): the gateway sends clients to
    the engines, UNIMPLEMENTED before any event, rather than merge or pick one."""
    gateway = fleet.gateway
    info = gateway.GetKvConnectorInfo(pb.GetKvConnectorInfoRequest())
    assert await status_of(info) == grpc.StatusCode.UNIMPLEMENTED
    sources = gateway.GetKvEventSources(pb.GetKvEventSourcesRequest())
    assert await status_of(sources) == grpc.StatusCode.UNIMPLEMENTED
    for stream in (
        gateway.SubscribeKvEvents(pb.SubscribeKvEventsRequest()),
        gateway.SubscribeRuntimeEvents(pb.SubscribeRuntimeEventsRequest()),
    ):
        assert await status_of(stream.read()) == grpc.StatusCode.UNIMPLEMENTED


async def test_engines_added_and_removed_at_run_time(fleet: Fleet) -> None:
    extra = await start_sim_engine("e3")
    try:
        info = await fleet.admin.RegisterEngine(
            apb.RegisterEngineRequest(address=f"127.0.0.1:{extra.port}")
        )
        assert info.source == "admin"
        await fleet.wait_routable(4)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.admin.RegisterEngine(
                apb.RegisterEngineRequest(address=f"127.0.0.1:{extra.port}")
            )
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        await generate(fleet, generate_request("a", [*PREFIX, 1]))
        holder = await holder_of(fleet, PREFIX, 4)
        await fleet.admin.RemoveEngine(apb.EngineRef(engine=holder))
        match = await fleet.admin.Match(apb.PromptQuery(token_ids=pb.TokenIds(ids=PREFIX)))
        assert all(m.device_blocks == 0 for m in match.matches)
        assert holder not in {m.engine for m in match.matches}
        # Match lists only the fleet's engines: the index itself has dropped the entries.
        index = fleet.app.controller.index
        assert index is not None
        assert holder not in {w.worker_id for w in (await index.stats()).workers}
    finally:
        await extra.close()


async def test_one_engine_under_two_addresses_is_counted_once(fleet: Fleet) -> None:
    engine = fleet.engines[0]
    twin = f"localhost:{engine.port}"
    await fleet.admin.RegisterEngine(apb.RegisterEngineRequest(address=twin, kv_events="none"))
    registry = fleet.app.controller.fleet.registry
    await fleet.app.controller.fleet.wait_for(
        lambda: registry.get(twin).state is EngineState.INCOMPATIBLE, 15
    )
    assert "the same engine" in registry.get(twin).last_error
    workers = await fleet.admin.ListWorkers(apb.ListWorkersRequest())
    routable = [w.instance_id for w in workers.workers if w.address != twin]
    assert sorted(routable) == ["e0", "e1", "e2"]
    load = await fleet.gateway.GetLoad(pb.GetLoadRequest())
    assert registry.get(twin).load.total_kv_blocks is None  # never polled
    assert load.total_kv_blocks == sum(
        r.load.total_kv_blocks or 0 for r in registry.records() if r.address != twin
    )
    assert load.attributes["routable_engines"] == "3"
    assert len(registry.routable()) == 3


async def test_restarted_engine_cold_cache_attracts_no_traffic() -> None:
    fleet = await make_fleet(2)
    try:
        await generate(fleet, generate_request("a", [*PREFIX, 1]))
        holder = await holder_of(fleet, PREFIX, 4)
        await fleet.restart_engine(holder, "e-new")
        match = await fleet.admin.Match(apb.PromptQuery(token_ids=pb.TokenIds(ids=PREFIX)))
        assert holder in {m.engine for m in match.matches}  # the restarted engine is listed
        assert all(m.device_blocks == 0 for m in match.matches)
    finally:
        await close_fleet(fleet)


class _FutureEngine(PartialOpenEngine):
    """An engine advertising a contract revision this controller was not tested with (or,
    with `revision` 1, one it was, until the test upgrades it: a new process, "f<revision>")."""

    def __init__(self, revision: int = 2, models: tuple[str, ...] = ("sim",)) -> None:
        self.revision = revision
        self.models = models

    async def GetEngineInfo(
        self, request: pb.GetEngineInfoRequest, context: object
    ) -> pb.EngineInfo:
        return pb.EngineInfo(
            engine_name="future", instance_id=f"f{self.revision}", supported_models=self.models,
            schema_revision=self.revision, minimum_client_revision=self.revision,
            schema_release=f"v{self.revision}.0.0",
        )  # fmt: skip

    async def Health(self, request: pb.HealthRequest, context: object) -> pb.HealthResponse:
        return pb.HealthResponse(state=pb.HEALTH_STATE_READY)

    async def GetLoad(self, request: pb.GetLoadRequest, context: object) -> pb.LoadInfo:
        return pb.LoadInfo(instance_id=f"f{self.revision}")


@asynccontextmanager
async def _registered(fleet: Fleet, engine: _FutureEngine) -> AsyncIterator[str]:
    """`engine` served on a port of its own and registered with the fleet: its address."""
    server = grpc.aio.server()
    pb_grpc.add_OpenEngineServicer_to_server(engine, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        address = f"127.0.0.1:{port}"
        await fleet.admin.RegisterEngine(
            apb.RegisterEngineRequest(address=address, kv_events="none")
        )
        yield address
    finally:
        await server.stop(None)


async def test_incompatible_engine_is_rejected_and_never_routed(fleet: Fleet) -> None:
    async with _registered(fleet, _FutureEngine()) as address:
        registry = fleet.app.controller.fleet.registry
        await fleet.app.controller.fleet.wait_for(
            lambda: registry.get(address).state is EngineState.INCOMPATIBLE, 30
        )
        assert "outside the tested range" in registry.get(address).last_error
        for i in range(10):
            explained = await fleet.admin.Route(
                apb.PromptQuery(token_ids=pb.TokenIds(ids=[i] * 40))
            )
            assert explained.engine != address
        health = await fleet.gateway.Health(pb.HealthRequest())
        assert health.state == pb.HEALTH_STATE_DEGRADED


async def test_an_engine_turned_incompatible_takes_its_models_out_of_the_fleets_info(
    fleet: Fleet,
) -> None:
    """An engine replaced by a process of a revision the controller was not tested with is
    rejected, and its models leave GetEngineInfo's `supported_models`: the seed has
    GetModelInfo select one of them, and it (like Generate) answers NOT_FOUND for a model no
    compatible engine serves (they were still listed)."""
    engine = _FutureEngine(revision=1, models=("future-only",))
    async with _registered(fleet, engine) as address:
        registry = fleet.app.controller.fleet.registry
        await fleet.app.controller.fleet.wait_for(lambda: registry.get(address).routable, 30)
        info = await fleet.gateway.GetEngineInfo(pb.GetEngineInfoRequest())
        assert sorted(info.supported_models) == ["future-only", "sim"]
        engine.revision = 2
        await fleet.app.controller.fleet.wait_for(
            lambda: registry.get(address).state is EngineState.INCOMPATIBLE, 30
        )
        info = await fleet.gateway.GetEngineInfo(pb.GetEngineInfoRequest())
        assert list(info.supported_models) == ["sim"]
        future_only = fleet.gateway.GetModelInfo(pb.GetModelInfoRequest(model="future-only"))
        assert await status_of(future_only) == grpc.StatusCode.NOT_FOUND


async def test_prometheus_metrics_are_exported() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    fleet = await make_fleet(2, metrics_listen="127.0.0.1:0")
    try:
        await generate(fleet, generate_request("a", [*PREFIX, 1]))
        text = await scrape(fleet)
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]

        def values(name: str, **labels: str) -> list[float]:
            return [
                s.value for s in samples if s.name == name and labels.items() <= s.labels.items()
            ]

        # One request, routed once and answered once; nothing was cached, as predicted.
        assert sum(values("kvplane_controller_route_decisions_total", policy="kvplane")) == 1
        assert values("kvplane_controller_first_response_seconds_count") == [1]
        assert values("kvplane_controller_predicted_cached_tokens_total") == [0]
        assert values("kvplane_controller_actual_cached_tokens_total") == [0]
        # Fractions (0-1) end in _ratio, as the engine's kvplane_engine_kv_usage_ratio does.
        assert values("kvplane_controller_cached_tokens_prediction_accuracy_ratio") == [1.0]
        # Per engine: both engines of the fleet, by address.
        addresses = {fleet.address(e) for e in fleet.engines}
        for name in ("running_requests", "kv_usage_ratio"):
            engines = {
                s.labels["engine"] for s in samples if s.name == f"kvplane_controller_engine_{name}"
            }
            assert engines == addresses, name
        assert all(0 <= v <= 1 for v in values("kvplane_controller_engine_kv_usage_ratio"))
        assert len(values("kvplane_controller_index_blocks")) == 1
    finally:
        await close_fleet(fleet)


async def test_gateway_latency_buckets_resolve_its_milliseconds_and_minute_long_streams() -> None:
    """As an operator reads the histograms on /metrics: routing, which adds a millisecond or
    two, has buckets under a millisecond; the first response (TTFT behind a queue and a long
    prefill) and the whole stream (a long generation decodes for minutes) have buckets up to
    minutes, not a last one at 10 s that would put every longer request in +Inf."""
    from prometheus_client.parser import text_string_to_metric_families

    fleet = await make_fleet(1, metrics_listen="127.0.0.1:0")
    try:
        await generate(fleet, generate_request("a", [*PREFIX, 1]))
        text = await scrape(fleet)
        bounds: dict[str, list[float]] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.endswith("_bucket") and s.labels["le"] != "+Inf":
                    bounds.setdefault(family.name, []).append(float(s.labels["le"]))
        route = bounds["kvplane_controller_route_seconds"]
        assert min(route) < 0.001 and 0.002 in route
        for name in ("first_response_seconds", "request_seconds"):
            stream = bounds[f"kvplane_controller_{name}"]
            assert min(stream) < 0.001
            assert {30.0, 60.0, 300.0} <= set(stream), name
    finally:
        await close_fleet(fleet)


async def test_the_request_histogram_times_every_generation_whatever_its_outcome() -> None:
    """`request_seconds` observes each generation that `requests_total` counts, so that its
    count is the requests' and its quantiles include the failed ones: one answered, one
    refused by the gateway (no request id), one refused by its engine (an empty prompt), one
    whose client left mid-stream, and one with no engine to take it (all cordoned)."""
    from prometheus_client.parser import text_string_to_metric_families

    fleet = await make_fleet(2, time_scale=1.0, metrics_listen="127.0.0.1:0")
    try:
        await generate(fleet, generate_request("ok", [*PREFIX, 1]))
        assert await status_of(generate(fleet, generate_request("", [1, 2]))) == (
            grpc.StatusCode.INVALID_ARGUMENT
        )
        empty = generate_request("empty", [])
        assert await status_of(generate(fleet, empty)) == grpc.StatusCode.INVALID_ARGUMENT
        left = fleet.gateway.Generate(generate_request("left", [1, 2], max_tokens=2000))
        await left.read()
        left.cancel()
        for engine in fleet.engines:
            await fleet.admin.Cordon(apb.EngineRef(engine=fleet.address(engine)))
        unserved = generate(fleet, generate_request("unserved", [1, 2]))
        assert await status_of(unserved) == grpc.StatusCode.UNAVAILABLE

        async def samples() -> dict[tuple[str, str], float]:
            return {
                (s.name, s.labels.get("outcome", "")): s.value
                for f in text_string_to_metric_families(await scrape(fleet))
                for s in f.samples
                if s.name.startswith("kvplane_controller_request")
            }

        async def all_counted() -> bool:  # the client's cancel reaches the gateway after it
            return (await samples())[("kvplane_controller_requests_total", "cancelled")] == 1

        await eventually(all_counted)
        counted = await samples()
        outcomes = {o: v for (name, o), v in counted.items() if name.endswith("_total") and v}
        assert outcomes == {"ok": 1, "invalid": 2, "cancelled": 1, "no_engine": 1}
        assert counted[("kvplane_controller_request_seconds_count", "")] == 5
    finally:
        await close_fleet(fleet)


async def test_vllm_generate_is_routed_to_the_prefix_holder(fleet: Fleet) -> None:
    from vllm_grpc import vllm_grpc_pb2 as vpb
    from vllm_grpc import vllm_grpc_pb2_grpc as vpb_grpc

    stub = vpb_grpc.GenerateStub(fleet.channel)

    def request(rid: str, tail: int) -> vpb.GenerateRequest:
        return vpb.GenerateRequest(
            request_id=rid, model="sim", token_ids=vpb.TokenIds(ids=[*PREFIX, tail]),
            stopping=vpb.StoppingCriteria(max_new_tokens=3, ignore_eos=True),
        )  # fmt: skip

    chunks = [r async for r in stub.GenerateStream(request("v1", 1))]
    assert chunks[-1].outputs.finish_info.num_output_tokens == 3
    holder = await holder_of(fleet, PREFIX, 4)
    cache_decisions = fleet.app.controller.metrics.decisions.labels(
        "kvplane", "cache", "aggregated"
    )
    before = cache_decisions._value.get()
    call = stub.Generate(request("v2", 2))
    reply = await call
    assert reply.outputs.finish_info.finish_reason == vpb.FinishInfo.LENGTH
    assert cache_decisions._value.get() == before + 1  # sent where the prefix lives
    route = read_route(await call.trailing_metadata())  # named as OpenEngine Generate's is
    assert route is not None
    assert (route["engine"], route["reason"], route["predicted_cached_tokens"]) == (
        holder,
        "cache",
        64,
    )
    assert len(fleet.app.controller.router.inflight) == 0


async def test_vllm_fields_of_a_newer_proto_are_refused_through_the_gateway(fleet: Fleet) -> None:
    """The gateway relays the request with the fields it does not know either, so the engine
    refuses them as it does a direct client (not served as if they were not sent)."""
    from tests.engine.test_server_vllm import with_newer_vllm_fields
    from vllm_grpc import vllm_grpc_pb2 as vpb
    from vllm_grpc import vllm_grpc_pb2_grpc as vpb_grpc

    stub = vpb_grpc.GenerateStub(fleet.channel)
    newer = with_newer_vllm_fields(
        vpb.GenerateRequest(
            model="sim",
            token_ids=vpb.TokenIds(ids=[*PREFIX, 1]),
            stopping=vpb.StoppingCriteria(max_new_tokens=3),
        )
    )
    for call in (stub.Generate(newer), stub.GenerateStream(newer)):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call if isinstance(call, grpc.aio.UnaryUnaryCall) else [r async for r in call]
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = refused.value.details() or ""
        assert "GenerateRequest field 15" in details, details
        assert "GenerateRequest.response field 8" in details, details
    assert len(fleet.app.controller.router.inflight) == 0


async def test_openengine_fields_of_a_newer_revision_reach_the_engine_and_are_refused(
    fleet: Fleet,
) -> None:
    """Generate and GetModelInfo, which the gateway relays to one engine, carry the fields it
    does not know either on to that engine, intact (nested ones too), and the engine refuses
    them as it does a direct client: not served as if they had not been sent."""
    from tests.engine.test_server_unknown_fields import with_newer_field

    newer = generate_request("newer", [*PREFIX, 1])
    with_newer_field(newer)
    with_newer_field(newer.sampling, 42)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await generate(fleet, newer)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = refused.value.details() or ""
    assert "GenerateRequest field 99" in details, details
    assert "GenerateRequest.sampling field 42" in details, details
    assert len(fleet.app.controller.router.inflight) == 0
    info = fleet.gateway.GetModelInfo(with_newer_field(pb.GetModelInfoRequest(model="sim")))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await info
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "GetModelInfoRequest field 99" in (refused.value.details() or "")


async def test_the_gateways_own_calls_refuse_fields_of_a_newer_revision(fleet: Fleet) -> None:
    """The calls the gateway answers or acts on itself refuse them as an engine does (an
    Abort it may end at the relay, its drain, the LoRA intent it records, the fleet's load
    and health); GetEngineInfo, the revision handshake, answers."""
    from tests.engine.test_server_unknown_fields import with_newer_field

    gateway = fleet.gateway
    calls: list[tuple[str, Any]] = [
        ("AbortRequest", gateway.Abort(with_newer_field(pb.AbortRequest(request_id="x")))),
        ("HealthRequest", gateway.Health(with_newer_field(pb.HealthRequest()))),
        ("GetLoadRequest", gateway.GetLoad(with_newer_field(pb.GetLoadRequest()))),
        ("ListLorasRequest", gateway.ListLoras(with_newer_field(pb.ListLorasRequest()))),
        (
            "LoadLoraRequest",
            gateway.LoadLora(
                with_newer_field(
                    pb.LoadLoraRequest(
                        adapter=pb.LoraAdapter(lora_id=1, lora_name="a", source_path="/a")
                    )
                )
            ),
        ),
        (
            "UnloadLoraRequest",
            gateway.UnloadLora(with_newer_field(pb.UnloadLoraRequest(lora_name="a"))),
        ),
    ]
    for request_type, call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request_type
        assert f"{request_type} field 99" in (refused.value.details() or ""), request_type
    drain = gateway.Drain(with_newer_field(pb.DrainRequest(stop_accepting_new_requests=True)))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        [r async for r in drain]
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "DrainRequest field 99" in (refused.value.details() or "")
    assert not fleet.app.controller.draining
    info = await gateway.GetEngineInfo(with_newer_field(pb.GetEngineInfoRequest()))
    assert info.schema_revision == 1
    health = await gateway.Health(pb.HealthRequest())
    assert health.state == pb.HEALTH_STATE_READY
    assert (await generate(fleet, generate_request("after", [*PREFIX, 2])))[-1].HasField("finished")


async def test_admin_calls_refuse_fields_of_a_newer_revision(fleet: Fleet) -> None:
    """An admin call with an option of a newer CLI or planner would otherwise change the fleet
    otherwise than asked: refused, the fleet left as it was."""
    from tests.engine.test_server_unknown_fields import with_newer_field

    address = fleet.address(fleet.engines[0])
    cordon = fleet.admin.Cordon(with_newer_field(apb.EngineRef(engine=address)))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await cordon
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "EngineRef field 99" in (refused.value.details() or "")
    listed = await fleet.admin.ListWorkers(apb.ListWorkersRequest())
    assert not any(w.cordoned for w in listed.workers)
    extra = await start_sim_engine("extra")
    try:
        register = apb.RegisterEngineRequest(address=f"127.0.0.1:{extra.port}", kv_events="none")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await fleet.admin.RegisterEngine(with_newer_field(register))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "RegisterEngineRequest field 99" in (refused.value.details() or "")
        listed = await fleet.admin.ListWorkers(apb.ListWorkersRequest())
        assert register.address not in {w.address for w in listed.workers}
    finally:
        await extra.close()


async def test_vllm_truncated_prompt_is_routed_by_the_tokens_the_engine_keeps(
    fleet: Fleet,
) -> None:
    """truncate_prompt_tokens: the engine keeps the last N tokens, so those are what the router
    matches (the untruncated prompt starts with tokens no engine holds)."""
    from vllm_grpc import vllm_grpc_pb2 as vpb
    from vllm_grpc import vllm_grpc_pb2_grpc as vpb_grpc

    stub = vpb_grpc.GenerateStub(fleet.channel)
    kept = [*PREFIX, 2]
    warm = vpb.GenerateRequest(
        model="sim", token_ids=vpb.TokenIds(ids=[*PREFIX, 1]),
        stopping=vpb.StoppingCriteria(max_new_tokens=2, ignore_eos=True),
    )  # fmt: skip
    await stub.Generate(warm)
    await holder_of(fleet, PREFIX, 4)
    cache_decisions = fleet.app.controller.metrics.decisions.labels(
        "kvplane", "cache", "aggregated"
    )
    before = cache_decisions._value.get()
    truncated = vpb.GenerateRequest(
        model="sim", token_ids=vpb.TokenIds(ids=[*range(500, 540), *kept]),
        truncate_prompt_tokens=len(kept),
        stopping=vpb.StoppingCriteria(max_new_tokens=2, ignore_eos=True),
    )  # fmt: skip
    reply = await stub.Generate(truncated)
    assert reply.prompt_info.num_prompt_tokens == len(kept)
    assert cache_decisions._value.get() == before + 1  # sent where the kept prefix lives


async def test_generate_stream_is_relayed_exactly() -> None:
    """The engine's responses byte for byte: a fresh engine called directly and its twin
    behind the controller answer the same sampled request (seeded, with prompt and output
    logprobs and candidates, so every kind of event is in the stream)."""
    twin = await start_sim_engine("e0")
    fleet = await make_fleet(1)
    try:
        request = generate_request("exact", list(range(40)), max_tokens=8)
        request.sampling.CopyFrom(pb.SamplingParams(temperature=0.9, top_p=0.95, seed=1234))
        request.response.CopyFrom(
            pb.ResponseOptions(
                return_prompt_logprobs=True,
                return_output_logprobs=True,
                output_candidates=pb.CandidateTokenSelection(top_n=2),
            )
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{twin.port}") as channel:
            direct = [
                r.SerializeToString()
                async for r in pb_grpc.OpenEngineStub(channel).Generate(request)
            ]
        relayed = [r.SerializeToString() async for r in fleet.gateway.Generate(request)]
    finally:
        await close_fleet(fleet)
        await twin.close()
    kinds = [pb.GenerateResponse.FromString(m).WhichOneof("event") for m in relayed]
    assert kinds == ["prompt"] + ["token"] * 8 + ["finished"]
    assert relayed == direct


async def test_vllm_generate_takes_the_gateways_path() -> None:
    """vllm.Generate is held like OpenEngine Generate (Abort by id reaches a live
    GenerateStream), counted in the metrics, and honours the session key (call metadata)."""
    from vllm_grpc import vllm_grpc_pb2 as vpb
    from vllm_grpc import vllm_grpc_pb2_grpc as vpb_grpc

    fleet = await make_fleet(
        2, time_scale=1.0, router={"session_metadata_key": "session", "policy": "round_robin"}
    )
    try:
        stub = vpb_grpc.GenerateStub(fleet.channel)
        metrics = fleet.app.controller.metrics

        def request(rid: str, max_new_tokens: int) -> vpb.GenerateRequest:
            return vpb.GenerateRequest(
                request_id=rid, model="sim", token_ids=vpb.TokenIds(ids=[*PREFIX, 1]),
                stopping=vpb.StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=True),
            )  # fmt: skip

        chunks: list[vpb.GenerateResponse] = []
        async for chunk in stub.GenerateStream(request("long", 2000)):
            chunks.append(chunk)
            if len(chunks) == 1:
                assert "long" in fleet.app.gateway.relay.holding
                reply = await fleet.gateway.Abort(pb.AbortRequest(request_id="long"))
                assert reply.status == pb.ABORT_STATUS_ABORTED
        assert chunks[-1].outputs.finish_info.finish_reason == vpb.FinishInfo.ABORTED
        assert sum(c.outputs.num_tokens for c in chunks) < 2000
        assert fleet.app.gateway.relay.holding == {}
        assert metrics.requests.labels("ok")._value.get() == 1
        assert metrics.prompt_tokens._value.get() == len(PREFIX) + 1
        registry = metrics.registry
        for histogram in ("route", "first_response", "request"):
            name = f"kvplane_controller_{histogram}_seconds_count"
            assert registry.get_sample_value(name) == 1, name

        chosen = record_routes(fleet)
        for _ in range(4):
            unary = await stub.Generate(request("", 2), metadata=(("session", "alice"),))
            assert unary.outputs.finish_info.finish_reason == vpb.FinishInfo.LENGTH
        assert len(chosen) == 4 and len(set(chosen)) == 1  # round robin would alternate
        assert metrics.requests.labels("ok")._value.get() == 5
        assert len(fleet.app.controller.router.inflight) == 0
    finally:
        await close_fleet(fleet)


@pytest.mark.parametrize(
    ("request_id", "model", "status"),
    [
        ("emb", "sim", grpc.StatusCode.FAILED_PRECONDITION),
        # The seed requires both, whatever the task's support (was FAILED_PRECONDITION).
        ("", "sim", grpc.StatusCode.INVALID_ARGUMENT),
        ("emb", "", grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
async def test_a_task_no_engine_supports_is_refused_as_an_engine_refuses_it(
    fleet: Fleet, request_id: str, model: str, status: grpc.StatusCode
) -> None:
    # The sim engine has no Embed (FAILED_PRECONDITION: it generates only);
    # tests/controller/test_gateway_scripted.py routes tasks to engines that have it.
    request = pb.EmbedRequest(
        context=pb.TaskRequestContext(request_id=request_id, model=model),
        inputs=[pb.TaskInput(item_id="x", token_ids=pb.TokenIds(ids=[1, 2, 3]))],
    )
    expected = await engine_answer(fleet.address(fleet.engines[0]), "Embed", request)
    assert await status_of(fleet.gateway.Embed(request)) == expected == status


async def test_concurrent_requests_sharing_a_system_prompt_spread_over_the_fleet() -> None:
    fleet = await make_fleet(3, time_scale=1.0)
    try:
        await generate(fleet, generate_request("warm", [*PREFIX, 1]))
        await holder_of(fleet, PREFIX, 4)
        chosen = record_routes(fleet)
        replies = await asyncio.gather(
            *(
                generate(
                    fleet,
                    generate_request(
                        f"s{i}", [*PREFIX, *range(1000 + 40 * i, 1040 + 40 * i)], max_tokens=20
                    ),
                )
                for i in range(30)
            )
        )
        assert all(r[-1].WhichOneof("event") == "finished" for r in replies)
        counts = {e: chosen.count(e) for e in set(chosen)}
        assert len(counts) == 3, counts
        assert max(counts.values()) <= 20, counts
    finally:
        await close_fleet(fleet)


async def test_redis_index_backend_routes_like_memory(redis_server: RedisServer) -> None:
    redis_server.client().flushall()
    fleet = await make_fleet(2, index={"backend": redis_server.url})
    try:
        assert fleet.app.controller.index is not None
        assert fleet.app.controller.index.name != "memory"
        await generate(fleet, generate_request("a", [*PREFIX, 1]))
        holder = await holder_of(fleet, PREFIX, 4)
        reply = await generate(fleet, generate_request("b", [*PREFIX, 2]))
        assert reply[-1].usage.cached_prompt_tokens == 64
        explained = await fleet.admin.Route(
            apb.PromptQuery(token_ids=pb.TokenIds(ids=[*PREFIX, 3]))
        )
        assert explained.engine == holder
    finally:
        await close_fleet(fleet)


async def test_session_affinity_by_metadata_key() -> None:
    fleet = await make_fleet(3, router={"session_metadata_key": "session", "policy": "round_robin"})
    try:
        chosen = record_routes(fleet)
        for i in range(6):
            await generate(fleet, generate_request(f"s{i}", [i] * 40, session="alice"))
        assert len(set(chosen)) == 1  # round robin would have used all three
        for i in range(3):
            await generate(fleet, generate_request(f"n{i}", [i] * 40))
        assert len(set(chosen[6:])) == 3
    finally:
        await close_fleet(fleet)


async def test_model_info_has_the_largest_limits_routing_honours_and_the_fleets_capacity() -> None:
    """Engines of one model with different limits (a shorter context, fewer sequences):
    GetModelInfo advertises the largest context and sequence count, whichever engine answers
    it, as routing sends a request only to an engine that takes it (controller.eligibility);
    the output limit stays the smallest (routing does not honour it: an engine caps an output
    at its context). A request at the advertised limits goes to the big engine; while only
    the small one takes traffic, it is UNAVAILABLE (worth retrying) naming what the small one
    lacks, not refused by it; one within the small one's limits is served there. Its capacity
    is the fleet's, the sum."""
    big = await start_sim_engine("big", max_model_len=8192, max_num_seqs=64, num_kv_blocks=1024)
    small = await start_sim_engine("small", max_model_len=1024, max_num_seqs=8)
    fleet = await make_fleet(engines=[big, small])

    def at(context: int, sequences: int, request_id: str) -> pb.GenerateRequest:
        request = generate_request(request_id, list(range(1, context)), 1)
        request.sampling.num_sequences = sequences
        return request

    try:
        for cordoned, routed in ((small, big), (big, small)):
            await fleet.admin.Cordon(apb.EngineRef(engine=cordoned.instance_id))
            await fleet.wait_routable(1)
            info = await fleet.gateway.GetModelInfo(pb.GetModelInfoRequest(model="sim"))
            assert info.max_context_length == 8192 and info.max_output_tokens == 1023
            assert info.generation.max_num_sequences == 64
            # Its capacity is the fleet's: both engines' KV blocks and seats.
            assert (info.total_kv_blocks, info.max_running_requests) == (1024 + 256, 64 + 8)
            for request, lacking in (
                (at(8192, 1, f"long-{routed.instance_id}"), "small max_context_length 1024 < 8192"),
                (
                    at(64, 64, f"wide-{routed.instance_id}"),
                    "small generation.max_num_sequences 8 < 64",
                ),
            ):
                call = fleet.gateway.Generate(request)
                if routed is big:
                    reply = [r async for r in call]
                    route = read_route(await call.trailing_metadata())
                    assert route is not None and route["instance_id"] == "big"
                    outputs = request.sampling.num_sequences
                    assert sum(r.HasField("finished") for r in reply) == outputs
                    continue
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    [r async for r in call]
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
                assert lacking in (caught.value.details() or "")
            # Within the small engine's limits: served where it is routed.
            call = fleet.gateway.Generate(at(1024, 8, f"at-small-{routed.instance_id}"))
            reply = [r async for r in call]
            route = read_route(await call.trailing_metadata())
            assert route is not None and route["instance_id"] == routed.instance_id
            assert sum(r.HasField("finished") for r in reply) == 8
            await fleet.admin.Uncordon(apb.EngineRef(engine=cordoned.instance_id))
            await fleet.wait_routable(2)
    finally:
        await close_fleet(fleet)


class OlderBuild(Forwarding):
    """An engine of an older build: it does not take `kv.cache_salt`, nor more than 20 output
    logprob candidates (vLLM's default `--max-logprobs`), and says so."""

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Any) -> Any:
        info = await self.inner.GetModelInfo(request)
        info.generation.supports_cache_salt = False
        info.generation.output_logprobs.max_top_n = 20
        return info

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> Any:
        if request.kv.HasField("cache_salt"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "cache_salt is not supported")
        async for response in self.inner.Generate(request):
            yield response


async def test_model_info_advertises_a_request_option_one_engine_takes_and_routes_to_it() -> None:
    """A fleet in a rolling upgrade: one engine takes `kv.cache_salt`, one of the older build
    says it does not (and refuses it), and takes fewer logprob candidates. GetModelInfo says
    `supports_cache_salt: true` and the larger `max_top_n`, whichever engine answers, as
    routing sends a salted request, or one asking more candidates, to the new engine only;
    while only the old engine takes traffic such a request is UNAVAILABLE, naming what the
    old one lacks, never refused by it."""
    new = await start_sim_engine("new")
    old = await start_fronted_engine("old", OlderBuild)
    fleet = await make_fleet(engines=engines_of_kinds(new, old))

    def salted(request_id: str) -> pb.GenerateRequest:
        request = generate_request(request_id, [1, 2, 3])
        request.kv.cache_salt = "tenant-a"
        return request

    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await engine_answer_or_raise(fleet.address(old), salted("direct"))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        for i in range(4):  # round and round: each goes to the new engine
            call = fleet.gateway.Generate(salted(f"salted{i}"))
            assert [r async for r in call][-1].HasField("finished")
            route = read_route(await call.trailing_metadata())
            assert route is not None and route["instance_id"] == "new"
        for cordoned in ("old", "new"):
            await fleet.admin.Cordon(apb.EngineRef(engine=cordoned))
            await fleet.wait_routable(1)
            info = await fleet.gateway.GetModelInfo(pb.GetModelInfoRequest(model="sim"))
            assert info.generation.supports_cache_salt
            assert info.generation.supports_priority  # what both take stays advertised
            assert info.generation.output_logprobs.max_top_n > 20  # and the larger limit
            if cordoned == "new":
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    [r async for r in fleet.gateway.Generate(salted("while-old"))]
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
                details = caught.value.details() or ""
                assert "old generation.supports_cache_salt false" in details, details
            await fleet.admin.Uncordon(apb.EngineRef(engine=cordoned))
            await fleet.wait_routable(2)
    finally:
        await close_fleet(fleet)


async def engine_answer_or_raise(
    address: str, request: pb.GenerateRequest
) -> list[pb.GenerateResponse]:
    async with grpc.aio.insecure_channel(address) as direct:
        return [r async for r in pb_grpc.OpenEngineStub(direct).Generate(request)]


@pytest.mark.parametrize("num_engines", [0, 2])
async def test_abort_of_a_kv_session_with_no_id_is_invalid_as_on_an_engine(
    num_engines: int,
) -> None:
    """An Abort naming a KV session without its `session_id` is malformed: INVALID_ARGUMENT
    with an engine's words, before any engine is asked. It used to be sent to every engine
    (their refusals joined in one message) and, with no engine registered yet, answered
    UNAVAILABLE, a status a client retries, for a request that can never succeed."""
    fleet = await make_fleet(num_engines)
    try:
        malformed = pb.AbortRequest(kv_session=pb.KvSessionRef())
        if fleet.engines:
            engine = fleet.address(fleet.engines[0])
            assert await engine_answer(engine, "Abort", malformed) == (
                grpc.StatusCode.INVALID_ARGUMENT
            )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await fleet.gateway.Abort(malformed)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == "kv_session.session_id is empty"
    finally:
        await close_fleet(fleet)


def embedding(max_batch_size: int, normalizes: bool) -> type[Forwarding]:
    """An engine that embeds (as it says: Embed itself is not played here), in batches of at
    most `max_batch_size`, normalizing or not."""

    class Embedding(Forwarding):
        async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Any) -> Any:
            info = await self.inner.GetModelInfo(request)
            info.tasks.embed.CopyFrom(
                pb.EmbedCapabilities(
                    supported=True,
                    input_types=[pb.TASK_INPUT_TYPE_TOKEN_IDS],
                    max_batch_size=max_batch_size,
                    supports_normalization=normalizes,
                    supports_priority=True,
                )
            )
            return info

    return Embedding


async def test_model_info_advertises_what_every_engine_with_a_task_takes_of_it() -> None:
    """Two engines embed, one in batches of 32 normalizing, one in batches of 8 and not; a
    third does not embed. The fleet's `tasks.embed` says batches of 8, no normalization,
    whichever engine answers (Embed goes to either), and what both take (priority) stays;
    the engine without the task bounds nothing of it. It used to be the answering engine's,
    and a batch of 32 sent to the other was refused."""
    engines = engines_of_kinds(
        await start_fronted_engine("big", embedding(32, True)),
        await start_fronted_engine("small", embedding(8, False)),
        await start_sim_engine("plain"),
    )
    fleet = await make_fleet(engines=engines)
    try:
        for cordoned in ("small", "big"):
            await fleet.admin.Cordon(apb.EngineRef(engine=cordoned))
            await fleet.wait_routable(2)
            embed = (
                await fleet.gateway.GetModelInfo(pb.GetModelInfoRequest(model="sim"))
            ).tasks.embed
            assert embed.supported and embed.max_batch_size == 8
            assert embed.HasField("supports_normalization") and not embed.supports_normalization
            assert embed.supports_priority
            await fleet.admin.Uncordon(apb.EngineRef(engine=cordoned))
            await fleet.wait_routable(3)
    finally:
        await close_fleet(fleet)
