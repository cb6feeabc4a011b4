"""The controller under faults: a shared Redis index going away and coming back (with an
engine restarting meanwhile), an engine removed with streams in flight, an engine killed while
it runs requests."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from controller.registry import EngineState
from controller.router import LoadSnapshot
from engine.config import EngineConfig
from engine.server.service import start_engine
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from tests.controller.conftest import Fleet, close_fleet, generate_request, make_fleet
from tests.controller.test_gateway import PREFIX, eventually, generate, holder_of
from tests.redis_servers import RedisServer

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
async def redis(tmp_path: Path) -> AsyncIterator[RedisServer]:
    """A private redis-server: the tests stop and restart it."""
    server = RedisServer(tmp_path / "redis")
    await asyncio.to_thread(server.start)
    try:
        yield server
    finally:
        await asyncio.to_thread(server.stop)


async def finished(fleet: Fleet, request: pb.GenerateRequest) -> pb.GenerateResponse:
    reply = await generate(fleet, request)
    assert reply[-1].WhichOneof("event") == "finished", reply[-1]
    return reply[-1]


async def test_requests_are_routed_by_load_while_the_shared_index_is_down(
    redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    fleet = await make_fleet(2, index={"backend": redis.url})
    try:
        await finished(fleet, generate_request("warm", [*PREFIX, 1]))
        await holder_of(fleet, PREFIX, 4)
        await asyncio.to_thread(redis.kill)
        for i in range(6):
            await finished(fleet, generate_request(f"down{i}", [*PREFIX, 10 + i]))
        query = apb.PromptQuery(token_ids=pb.TokenIds(ids=[*PREFIX, 99]))
        explained = await fleet.admin.Route(query)
        assert explained.engine in {fleet.address(e) for e in fleet.engines}
        match = await fleet.admin.Match(query)
        assert all(m.device_blocks == 0 for m in match.matches)
        # One warning for the outage so far, not one (with a traceback) per request.
        blind = [r for r in caplog.records if "routing by load" in r.getMessage()]
        assert len(blind) == 1 and blind[0].levelno == logging.WARNING
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        await asyncio.to_thread(redis.start)  # back empty: the engines' sources resync it
        await finished(fleet, generate_request("back", [*PREFIX, 2]))
        await holder_of(fleet, PREFIX, 4)
    finally:
        await close_fleet(fleet)


async def test_an_engine_restarted_while_the_shared_index_is_down_is_indexed_again(
    redis: RedisServer,
) -> None:
    fleet = await make_fleet(2, index={"backend": redis.url})
    try:
        old, other = fleet.engines
        address = fleet.address(old)
        await fleet.admin.Cordon(apb.EngineRef(engine=fleet.address(other)))
        await finished(fleet, generate_request("before", [*PREFIX, 1]))
        assert await holder_of(fleet, PREFIX, 4) == address
        await asyncio.to_thread(redis.kill)
        await old.close()
        fresh = await start_engine(
            EngineConfig(
                model="sim",
                listen=address,
                instance_id="e-new",
                num_kv_blocks=256,
                shutdown_grace_s=0.5,
            )
        )
        fleet.engines[0] = fresh
        registry = fleet.app.controller.fleet.registry
        await fleet.app.controller.fleet.wait_for(
            lambda: registry.get(address).engine_id == "e-new" and registry.get(address).routable,
            15,
        )
        await asyncio.to_thread(redis.start)
        tokens = list(range(500, 564))
        await finished(fleet, generate_request("after", [*tokens, 1]))
        assert await holder_of(fleet, tokens, 4) == address
    finally:
        await close_fleet(fleet)


async def test_streams_on_a_removed_engine_end_instead_of_hanging() -> None:
    fleet = await make_fleet(2, time_scale=1.0)
    try:
        controller = fleet.app.controller
        relay = fleet.app.gateway.relay
        seen: dict[str, list[str | None]] = {}
        ended: dict[str, str] = {}

        async def stream(i: int) -> None:
            events = seen.setdefault(f"s{i}", [])
            request = generate_request(f"s{i}", [1000 + i] * 40, max_tokens=300)
            try:
                # The client's deadline detects a hang.
                async for response in fleet.gateway.Generate(request, timeout=20):
                    events.append(response.WhichOneof("event"))
            except grpc.aio.AioRpcError as exc:
                ended[f"s{i}"] = exc.code().name
            else:
                ended[f"s{i}"] = str(events[-1]) if events else "nothing"

        tasks = [asyncio.create_task(stream(i)) for i in range(8)]

        def streaming_on(engine: str) -> set[str]:
            return {rid for rid, e in relay.holding.items() if e == engine and seen[rid]}

        removed = fleet.address(fleet.engines[0])

        async def streaming_on_removed() -> bool:
            return len(streaming_on(removed)) >= 2

        await eventually(streaming_on_removed)
        on_removed = streaming_on(removed)
        await fleet.admin.RemoveEngine(apb.EngineRef(engine=removed))
        async with asyncio.timeout(15):
            await asyncio.gather(*tasks)
        for rid in on_removed:  # output relayed: one terminal EngineError
            assert ended[rid] == "error", (rid, ended[rid], seen[rid][-3:])
            assert seen[rid].count("error") == 1
        assert set(ended.values()) <= {"error", "finished"}, ended
        assert len(controller.router.inflight) == 0
        assert not relay.holding and not relay.running
    finally:
        await close_fleet(fleet)


async def test_a_vllm_stream_on_a_removed_engine_ends_as_engine_left() -> None:
    """vllm.Generate goes to engines over the fleet's own channels, so a removed engine's
    vLLM streams end as its OpenEngine ones do (UNAVAILABLE, "engine ... left": vLLM has no
    in-band error) rather than running on outside the fleet, where Abort cannot reach them."""
    from vllm_grpc import vllm_grpc_pb2 as vpb
    from vllm_grpc import vllm_grpc_pb2_grpc as vpb_grpc

    fleet = await make_fleet(2, time_scale=1.0)
    try:
        relay = fleet.app.gateway.relay
        request = vpb.GenerateRequest(
            request_id="v", model="sim", token_ids=vpb.TokenIds(ids=[*PREFIX, 1]),
            stopping=vpb.StoppingCriteria(max_new_tokens=2000, ignore_eos=True),
        )  # fmt: skip
        chunks: list[vpb.GenerateResponse] = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for chunk in vpb_grpc.GenerateStub(fleet.channel).GenerateStream(request):
                chunks.append(chunk)
                if len(chunks) == 1:
                    removed = relay.holding["v"]
                    await fleet.admin.RemoveEngine(apb.EngineRef(engine=removed))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert err.value.details() == f"engine {removed} left"
        assert not any(c.outputs.HasField("finish_info") for c in chunks)
        assert not relay.holding and not relay.running
    finally:
        await close_fleet(fleet)


async def test_a_killed_engine_leaves_the_fleets_load() -> None:
    fleet = await make_fleet(2, time_scale=1.0)
    try:
        registry = fleet.app.controller.fleet.registry
        killed = fleet.engines[0]
        address = fleet.address(killed)
        streams = [
            asyncio.create_task(
                generate(fleet, generate_request(f"k{i}", [i] * 40, max_tokens=300))
            )
            for i in range(6)
        ]
        await fleet.app.controller.fleet.wait_for(
            lambda: (registry.get(address).load.running_requests or 0) > 0, 15
        )
        await killed.server.stop(None)
        await fleet.app.controller.fleet.wait_for(
            lambda: registry.get(address).state is EngineState.UNREACHABLE, 15
        )
        assert registry.get(address).load == LoadSnapshot()
        load = await fleet.gateway.GetLoad(pb.GetLoadRequest())
        assert load.total_kv_blocks == 256  # the live engine's only
        assert "running=? " in load.attributes[f"engine.{address}"]
        await asyncio.gather(*streams, return_exceptions=True)
    finally:
        await close_fleet(fleet)
