"""The controller under faults: a shared Redis index going away and coming back (with an
engine restarting meanwhile, or without its data), a remote indexer stopped and started again
empty, an engine's KV-event stream ended by the engine or missing batches, an engine removed
with streams in flight, an engine killed while it runs requests."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import grpc
import pytest

from controller.config import ControllerConfig
from controller.fleet import Fleet as ControllerFleet
from controller.registry import EngineState
from controller.router import LoadSnapshot
from engine.config import EngineConfig, KvEventsConfig
from engine.core.api import BlockStored
from engine.server.service import EngineApp, start_engine
from indexer.config import OpenEngineSourceConfig
from indexer.index import PrefixIndex
from indexer.keys import block_keys
from indexer.memory_backend import MemoryBackend
from indexer.service import build_source
from indexer.servicer import index_services
from indexer.sources.openengine import OpenEngineSource
from kvplane.channels import RECONNECT_MAX_S
from kvplane.config import ServerConfig
from kvplane.server import create_server
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import (
    EngineFleet,
    Fleet,
    close_fleet,
    engines_of_kinds,
    generate_request,
    make_fleet,
    start_sim_engine,
)
from tests.controller.fronted_engine import Context, Forwarding, start_fronted_engine
from tests.controller.test_gateway import PREFIX, generate, holder_of
from tests.indexer.backend_views import worker_keys
from tests.logged_errors import errors_logged
from tests.polling import eventually
from tests.redis_servers import RedisServer

pytestmark = pytest.mark.timeout(90)


async def finished(fleet: EngineFleet[Any], request: pb.GenerateRequest) -> pb.GenerateResponse:
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
        assert {m.engine for m in match.matches} == {fleet.address(e) for e in fleet.engines}
        assert all(m.device_blocks == 0 for m in match.matches)
        # Said, so that an outage does not pass for an empty cache.
        assert "Redis" in explained.index_error and "Redis" in match.index_error
        # One warning for the outage so far, not one (with a traceback) per request.
        blind = [r for r in caplog.records if "routing by load" in r.getMessage()]
        assert len(blind) == 1 and blind[0].levelno == logging.WARNING
        assert not errors_logged(caplog)
        await asyncio.to_thread(redis.start)  # back empty: the engines' sources resync it
        await finished(fleet, generate_request("back", [*PREFIX, 2]))
        await holder_of(fleet, PREFIX, 4)
        assert (await fleet.admin.Match(query)).index_error == ""
    finally:
        await close_fleet(fleet)


async def test_listing_workers_while_the_shared_index_is_down_warns_once(
    redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """ListWorkers asks the index for its size each time (`kvplane up`'s live status lists
    them every second): an outage is one warning, not one per call."""
    fleet = await make_fleet(2, index={"backend": redis.url})
    try:
        await asyncio.to_thread(redis.kill)
        for _ in range(5):
            workers = await fleet.admin.ListWorkers(apb.ListWorkersRequest())
            assert len(workers.workers) == 2  # still listed, without their indexed blocks
        failed = [r for r in caplog.records if "index stats failed" in r.getMessage()]
        assert len(failed) == 1 and failed[0].levelno == logging.WARNING
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


class Wedged(Forwarding):
    """An engine whose Abort and Drain handlers never answer (a wedged process: it took the
    call and hangs) until `wake` is set; everything else is the sim engine's."""

    def __init__(self, inner: pb_grpc.OpenEngineAsyncStub) -> None:
        super().__init__(inner)
        self.wake = asyncio.Event()
        self.num_aborts_held = 0

    async def Abort(self, request: pb.AbortRequest, context: Context) -> Any:
        self.num_aborts_held += 1
        await self.wake.wait()
        return await self.inner.Abort(request)

    async def Drain(
        self, request: pb.DrainRequest, context: Context
    ) -> AsyncIterator[pb.DrainResponse]:
        await self.wake.wait()
        yield pb.DrainResponse(state=pb.DRAIN_STATE_COMPLETE)


async def test_abort_and_drain_of_a_wedged_engine_fail_instead_of_hanging() -> None:
    """Abort of a request the wedged engine holds, and a drain of that engine through the
    controller, end within the poll timeout with UNAVAILABLE naming the engine (not at the
    client's deadline, with no word of which engine); Abort of every request reports the
    engine among the outcomes; the drain is withdrawn (the engine's health decides)."""
    wedged = await start_fronted_engine("wedged", Wedged, time_scale=1.0)
    healthy = await start_sim_engine("healthy")
    fleet = await make_fleet(
        engines=engines_of_kinds(wedged, healthy), health={"rpc_timeout_s": 0.5}
    )
    address = f"127.0.0.1:{wedged.port}"
    try:
        await fleet.admin.Cordon(apb.EngineRef(engine="healthy"))
        stream = fleet.gateway.Generate(generate_request("held", [*PREFIX, 1], max_tokens=5000))
        assert isinstance(await stream.read(), pb.GenerateResponse)
        assert fleet.app.gateway.relay.holding["held"] == address

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.gateway.Abort(pb.AbortRequest(request_id="held"), timeout=15)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert f"engine {address} holding request 'held' did not answer" in str(err.value.details())
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.gateway.Abort(pb.AbortRequest(all_requests=pb.AllRequests()), timeout=15)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert f"{address}: DEADLINE_EXCEEDED" in (err.value.details() or ""), err.value

        drain = fleet.admin.DrainEngine(apb.DrainEngineRequest(engine="wedged"), timeout=15)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [event async for event in drain]
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert f"engine {address} did not answer the Drain" in str(err.value.details())
        await fleet.admin.Uncordon(apb.EngineRef(engine="healthy"))
        await fleet.wait_routable(2)
        stream.cancel()
    finally:
        wedged.servicer.wake.set()
        await close_fleet(fleet)


class AbortFails(Forwarding):
    """An engine whose Abort fails with an error of its own; everything else is the sim
    engine's."""

    async def Abort(self, request: pb.AbortRequest, context: Context) -> Any:
        await context.abort(grpc.StatusCode.INTERNAL, "Socket closed")


async def test_abort_of_a_request_whose_engine_fails_it_names_the_engine() -> None:
    """Abort of a request id whose engine fails the Abort: the controller's status names that
    engine and its status, not the engine's bare words (here gRPC's "Socket closed", as a
    process that died mid-call gives), which would read as the controller's own."""
    failing = await start_fronted_engine("failing", AbortFails, time_scale=1.0)
    fleet = await make_fleet(engines=[failing])
    address = f"127.0.0.1:{failing.port}"
    try:
        stream = fleet.gateway.Generate(generate_request("held", [*PREFIX, 1], max_tokens=5000))
        assert isinstance(await stream.read(), pb.GenerateResponse)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.gateway.Abort(pb.AbortRequest(request_id="held"), timeout=15)
        assert err.value.code() == grpc.StatusCode.INTERNAL, err.value
        assert err.value.details() == f"engine {address} failed the Abort: INTERNAL: Socket closed"
        stream.cancel()
    finally:
        await close_fleet(fleet)


async def test_calls_held_by_an_engine_being_removed_end_with_it() -> None:
    """RemoveEngine while the gateway waits on the engine's Abort (a request id it holds,
    and a fan-out to every engine): both end at once, the engine counted as left
    (UNAVAILABLE), instead of waiting for the client's deadline."""
    wedged = await start_fronted_engine("wedged", Wedged, time_scale=1.0)
    healthy = await start_sim_engine("healthy")
    fleet = await make_fleet(
        engines=engines_of_kinds(wedged, healthy), health={"rpc_timeout_s": 60}
    )
    address = f"127.0.0.1:{wedged.port}"

    async def reply_of(call: Awaitable[pb.AbortResponse]) -> pb.AbortResponse:
        return await call

    try:
        await fleet.admin.Cordon(apb.EngineRef(engine="healthy"))
        stream = fleet.gateway.Generate(generate_request("held", [*PREFIX, 1], max_tokens=5000))
        assert isinstance(await stream.read(), pb.GenerateResponse)
        by_id = asyncio.create_task(
            reply_of(fleet.gateway.Abort(pb.AbortRequest(request_id="held"), timeout=15))
        )
        everything = asyncio.create_task(
            reply_of(
                fleet.gateway.Abort(pb.AbortRequest(all_requests=pb.AllRequests()), timeout=15)
            )
        )

        async def both_held() -> bool:
            return wedged.servicer.num_aborts_held == 2

        await eventually(both_held)
        await fleet.admin.RemoveEngine(apb.EngineRef(engine=address))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await by_id
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert err.value.details() == f"engine {address} left"
        # Its requests were not aborted there (it left with them): the fan-out fails too.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await everything
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert f"{address}: UNAVAILABLE (engine {address} left)" in (err.value.details() or "")
        stream.cancel()
    finally:
        wedged.servicer.wake.set()
        await close_fleet(fleet)


async def test_a_drain_through_the_controller_ends_when_the_engine_is_removed() -> None:
    """RemoveEngine while `admin drain ENGINE` relays that engine's progress: the drain
    stream ends with UNAVAILABLE ("engine ... left"), as the engine's Generate streams do,
    instead of hanging until the client's deadline."""
    fleet = await make_fleet(2, time_scale=1.0)
    try:
        drained, other = (fleet.address(e) for e in fleet.engines)
        await fleet.admin.Cordon(apb.EngineRef(engine=other))
        stream = fleet.gateway.Generate(generate_request("long", [*PREFIX, 1], max_tokens=5000))
        assert isinstance(await stream.read(), pb.GenerateResponse)
        drain = fleet.admin.DrainEngine(
            apb.DrainEngineRequest(engine=drained, deadline_ms=60_000), timeout=15
        )
        first = await drain.read()
        assert isinstance(first, pb.DrainResponse) and first.state == pb.DRAIN_STATE_STARTED
        await fleet.admin.RemoveEngine(apb.EngineRef(engine=drained))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while isinstance(await drain.read(), pb.DrainResponse):
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert f"engine {drained} left" in str(err.value.details())
        stream.cancel()
    finally:
        await close_fleet(fleet)


async def test_a_drain_through_the_controller_of_an_engine_killed_meanwhile_names_it(
    tmp_path: Path,
) -> None:
    """`kvplane admin drain ENGINE` while that engine's process is killed (SIGKILL): one line
    naming the engine and what broke, not the dead engine's bare "Socket closed" as if it were
    the controller's connection (with a TLS hint for it)."""
    from tests.controller.test_admin_cli import cli
    from tests.controller.test_stalled_engines import EngineProcess

    engine = await EngineProcess.start(tmp_path, "killed")
    fleet = await make_fleet(engines=engines_of_kinds(engine, await start_sim_engine("other")))
    address = f"127.0.0.1:{engine.port}"
    try:
        await fleet.admin.Cordon(apb.EngineRef(engine="other"))
        stream = fleet.gateway.Generate(generate_request("long", [*PREFIX, 1], max_tokens=100_000))
        assert isinstance(await stream.read(), pb.GenerateResponse)
        drain = asyncio.create_task(
            cli("drain", address, "--deadline-ms", "600000", "--target", fleet.target)
        )
        async with grpc.aio.insecure_channel(address) as channel:  # the engine's own word

            async def draining() -> bool:
                health = await pb_grpc.OpenEngineStub(channel).Health(pb.HealthRequest())
                return health.state == pb.HEALTH_STATE_DRAINING

            await eventually(draining, timeout_s=30)
        engine.proc.kill()
        async with asyncio.timeout(60):  # a hang guard; the outcome is what is asserted
            result = await drain
        assert result.exit_code == 1, result.output
        message = str(result.exception)
        assert f"engine {address} failed the Drain: UNAVAILABLE" in message, message
        assert "TLS" not in message, message
        stream.cancel()
    finally:
        await engine.close()
        await close_fleet(fleet)


class Indexer:
    """`kvplane indexer serve`'s parts in this process (an empty memory index, one OpenEngine
    source per engine, the gRPC server), to stop and start again, empty, on its port.
    `source_backoff_s`: its sources' reconnect backoff, fixed (default: the sources' own)."""

    def __init__(self, engines: list[str], source_backoff_s: float | None = None) -> None:
        self.engines = engines
        self.source_backoff_s = source_backoff_s
        self.port = 0
        self.server: grpc.aio.Server | None = None
        self.backend: MemoryBackend | None = None
        self.tasks: list[asyncio.Task[None]] = []

    async def blocks_of(self) -> dict[str, int]:
        """Blocks per worker in its index."""
        assert self.backend is not None
        return {w.worker_id: w.num_blocks for w in (await self.backend.stats()).workers}

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        backend = self.backend = MemoryBackend(PrefixIndex())
        sources = [
            build_source(OpenEngineSourceConfig(kind="openengine", target=e), backend, 16)
            for e in self.engines
        ]
        for source in sources:
            if self.source_backoff_s is not None:
                assert isinstance(source, OpenEngineSource)
                source.settings = dataclasses.replace(
                    source.settings,
                    backoff_initial_s=self.source_backoff_s,
                    backoff_max_s=self.source_backoff_s,
                )
        services, _, _ = index_services(
            backend,
            default_block_size=16,
            max_concurrent_prefix_queries=8,
            source_of={s.worker_id: s for s in sources}.get,
        )
        self.server, self.port = await create_server(
            ServerConfig(listen=f"127.0.0.1:{self.port}"), services
        )
        self.tasks = [asyncio.create_task(s.run()) for s in sources]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.server is not None:
            await self.server.stop(None)
            self.server = None


async def test_a_remote_indexer_that_stops_costs_cache_knowledge_until_it_is_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`index: {remote: ...}`: while the indexer is down, requests are routed by load and admin
    `route`/`match`/`workers` answer without the index (one warning); once it is back, empty,
    its sources resubscribe with a snapshot and the router finds the prefix where it lives,
    without any engine sending an event for it again."""
    engines = [await start_sim_engine(f"e{i}") for i in range(2)]
    indexer = Indexer([f"127.0.0.1:{e.port}" for e in engines])
    await indexer.start()
    fleet = await make_fleet(engines=engines, index={"remote": indexer.target})
    try:
        await finished(fleet, generate_request("warm", [*PREFIX, 1]))
        holder = await holder_of(fleet, PREFIX, 4)
        await indexer.stop()
        for i in range(4):  # prompts of their own: only the warm one's prefix is on `holder`
            await finished(fleet, generate_request(f"down{i}", [2000 + i] * 40))
        query = apb.PromptQuery(token_ids=pb.TokenIds(ids=[*PREFIX, 99]))
        explained = await fleet.admin.Route(query)
        assert explained.engine in {fleet.address(e) for e in fleet.engines}
        match = await fleet.admin.Match(query)
        assert [m.device_blocks for m in match.matches] == [0, 0]
        assert match.index_error.startswith("remote index: UNAVAILABLE")
        assert explained.index_error.startswith("remote index: UNAVAILABLE")
        workers = await fleet.admin.ListWorkers(apb.ListWorkersRequest())
        assert sum(w.routable for w in workers.workers) == 2
        blind = [r for r in caplog.records if "routing by load" in r.getMessage()]
        assert len(blind) == 1 and blind[0].levelno == logging.WARNING
        assert "remote index: UNAVAILABLE" in blind[0].getMessage()
        assert not errors_logged(caplog)

        await indexer.start()  # empty: rebuilt from the engines' snapshots alone
        assert await holder_of(fleet, PREFIX, 4) == holder
        match = await fleet.admin.Match(query)
        assert {m.engine: m.device_blocks for m in match.matches if m.engine != holder} == {
            fleet.address(e): 0 for e in engines if fleet.address(e) != holder
        }
        explained = await fleet.admin.Route(query)
        assert (explained.engine, explained.reason) == (holder, "cache")
        assert explained.index_error == ""
        reply = await finished(fleet, generate_request("back", [*PREFIX, 3]))
        assert reply.usage.cached_prompt_tokens == 64
    finally:
        await close_fleet(fleet)
        await indexer.stop()


async def test_a_restarted_engines_old_blocks_attract_no_traffic_with_a_remote_indexer() -> None:
    """`index: {remote: ...}`: after an engine dies, the indexer's source for it waits out
    its reconnect backoff (300 s here) still holding the old process's blocks. The controller
    tells the indexer as soon as it sees the new process (ResyncEngine): the old blocks are
    gone before the engine takes traffic, and the source resubscribes at once, so what the
    new process caches is found within seconds, not after the backoff."""
    engines = [await start_sim_engine(f"e{i}") for i in range(2)]
    indexer = Indexer([f"127.0.0.1:{e.port}" for e in engines], source_backoff_s=300.0)
    await indexer.start()
    fleet = await make_fleet(engines=engines, index={"remote": indexer.target})
    try:
        await finished(fleet, generate_request("warm", [*PREFIX, 1]))
        holder = await holder_of(fleet, PREFIX, 4)
        await fleet.restart_engine(holder, "e-new")
        query = apb.PromptQuery(token_ids=pb.TokenIds(ids=[*PREFIX, 99]))
        match = await fleet.admin.Match(query)
        assert [m.device_blocks for m in match.matches] == [0, 0]
        explained = await fleet.admin.Route(query)
        assert explained.reason != "cache"

        fresh_prompt = [7000 + i for i in range(64)]
        async with grpc.aio.insecure_channel(holder) as channel:
            replies = pb_grpc.OpenEngineStub(channel).Generate(
                generate_request("direct", [*fresh_prompt, 1])
            )
            assert [r async for r in replies][-1].WhichOneof("event") == "finished"

        async def found_on_holder() -> bool:
            query = apb.PromptQuery(token_ids=pb.TokenIds(ids=[*fresh_prompt, 2]))
            match = await fleet.admin.Match(query)
            return {m.engine: m.device_blocks for m in match.matches}.get(holder) == 4

        await eventually(found_on_holder, timeout_s=60)  # far short of the backoff
    finally:
        await close_fleet(fleet)
        await indexer.stop()


async def test_an_engine_restarted_while_no_controller_watched_is_resynced_at_first_contact() -> (
    None
):
    """`index: {remote: ...}`: an engine restarts while no controller runs; the indexer's
    source for it waits out its reconnect backoff (300 s here), still holding the old process's
    blocks. A controller that starts then meets the engine for the first time and cannot tell
    a new process from the one the indexer followed; it asks the indexer to resync the engine
    if its source lost its stream: the old blocks are gone before the engine takes traffic,
    and the other engine's, whose source follows the live process, are kept."""
    engines = [await start_sim_engine(f"e{i}") for i in range(2)]
    addresses = [f"127.0.0.1:{e.port}" for e in engines]
    indexer = Indexer(addresses, source_backoff_s=300.0)
    await indexer.start()
    fleet: Fleet | None = None
    try:
        prompts = {
            a: [[*PREFIX, 1], [5000 + i for i in range(65)]][i] for i, a in enumerate(addresses)
        }
        for address, prompt in prompts.items():
            async with grpc.aio.insecure_channel(address) as channel:
                replies = pb_grpc.OpenEngineStub(channel).Generate(
                    generate_request(f"warm {address}", prompt)
                )
                assert [r async for r in replies][-1].WhichOneof("event") == "finished"

        async def indexed() -> bool:
            blocks = await indexer.blocks_of()
            return all(blocks.get(a, 0) >= 4 for a in addresses)

        await eventually(indexed, timeout_s=30)
        restarted, other = addresses
        await engines[0].close()
        engines[0] = await start_sim_engine("e0-new", port=int(restarted.rsplit(":", 1)[1]))
        assert (await indexer.blocks_of()).get(restarted, 0) >= 4  # the old process's

        fleet = await make_fleet(engines=engines, index={"remote": indexer.target})
        match = await fleet.admin.Match(
            apb.PromptQuery(token_ids=pb.TokenIds(ids=prompts[restarted]))
        )
        assert {m.engine: m.device_blocks for m in match.matches}.get(restarted, 0) == 0
        match = await fleet.admin.Match(apb.PromptQuery(token_ids=pb.TokenIds(ids=prompts[other])))
        assert {m.engine: m.device_blocks for m in match.matches}.get(other) == 4

        # The source was woken out of its backoff: what the new process caches is found.
        fresh = [7000 + i for i in range(65)]
        await finished(fleet, generate_request("fresh", fresh))

        async def found() -> bool:
            query = apb.PromptQuery(token_ids=pb.TokenIds(ids=fresh))
            match = await fleet.admin.Match(query)
            return max(m.device_blocks for m in match.matches) == 4

        await eventually(found, timeout_s=60)  # far short of the backoff
    finally:
        if fleet is not None:
            await close_fleet(fleet)
        else:
            for engine in engines:
                await engine.close()
        await indexer.stop()


async def test_the_controllers_channels_reconnect_about_every_second() -> None:
    """The channels to engines and to the remote indexer retry a lost connection from
    `health.backoff_initial_s` up to `RECONNECT_MAX_S` apart, not at gRPC's own pace (up to
    120 s), nor at the polls' backoff (`backoff_max_s`): an indexer, asked by every routed
    request, back after a minute's outage was asked in vain for 15 s more, every prompt routed
    by load meanwhile; an engine back is polled as soon as its channel connects."""
    config = ControllerConfig.model_validate(
        {"health": {"backoff_initial_s": 0.25, "backoff_max_s": 3.0}, "index": {"remote": "h:1"}}
    )
    fleet = ControllerFleet(config, None)
    names = ("grpc.initial_reconnect_backoff_ms", "grpc.max_reconnect_backoff_ms")
    assert fleet.remote is not None
    try:
        engines = {k: v for k, v in fleet._engine_channels.options if k in names}
        indexer = {k: v for k, v in fleet.remote.channels.options if k in names}
        assert (
            engines
            == indexer
            == dict(zip(names, (250, round(RECONNECT_MAX_S * 1000)), strict=True))
        )
    finally:
        await fleet.close()


@pytest.fixture(params=["memory", "redis"])
async def index(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[dict[str, str]]:
    """The controller's own index: embedded, or in a private redis-server."""
    if request.param == "memory":
        yield {"backend": "memory"}
        return
    server = RedisServer(tmp_path / "redis")
    await asyncio.to_thread(server.start)
    try:
        yield {"backend": server.url}
    finally:
        await asyncio.to_thread(server.stop)


async def indexed_keys(fleet: Fleet, worker: str) -> set[int]:
    """The block keys the controller's index places on `worker`."""
    index = fleet.app.controller.index
    assert index is not None
    return await worker_keys(index, worker)


def cached_keys(engine: EngineApp) -> set[int]:
    """The block keys the engine holds (its KV-event log's snapshot: what it announced)."""
    return {
        key
        for event in engine.service.kv_log.snapshot().events
        if isinstance(event, BlockStored)
        for key in event.block_keys
    }


async def index_follows(fleet: EngineFleet[Any], address: str, engine: EngineApp) -> None:
    """Wait until the controller's source for `address` has applied the engine's last batch;
    then the index holds exactly the engine's blocks (none lost, none stale)."""
    source = fleet.app.controller.fleet.source_of(address)
    assert isinstance(source, OpenEngineSource)
    log = engine.service.kv_log
    await source.wait_until(lambda: source.last_seq == log.last_sequence_number, 20)
    assert await indexed_keys(fleet, address) == cached_keys(engine)


def _resyncs(fleet: EngineFleet[Any], address: str) -> float:
    """The engine's `kvplane_controller_engine_kv_event_resyncs_total`, as /metrics has it."""
    sample = "kvplane_controller_engine_kv_event_resyncs_total"
    value = fleet.app.controller.metrics.registry.get_sample_value(sample, {"engine": address})
    assert value is not None, f"no {sample} for {address}"
    return value


async def test_a_shared_redis_that_lost_its_data_is_rebuilt_from_the_engines(
    redis: RedisServer,
) -> None:
    """redis-server restarted without its data and no request since: the controller's
    subscriptions resubscribe with a snapshot (the backend asks them to, and the engines'
    writer leases, lost with the data, are taken again), and the index holds each engine's
    blocks again, exactly, without any engine restarting or storing anything. /metrics says
    so: each engine's `kvplane_controller_engine_kv_event_resyncs_total` counts the rebuild
    (before, 0: the lease taken again started a source with counters of its own), and goes on
    from there for an engine process that replaces it at that address (a Prometheus counter
    never goes back within its series)."""
    fleet = await make_fleet(2, index={"backend": redis.url})
    try:
        await finished(fleet, generate_request("a", [*PREFIX, 1]))
        await finished(fleet, generate_request("b", [*range(3000, 3064), 1]))
        holder = await holder_of(fleet, PREFIX, 4)
        for engine in fleet.engines:
            await index_follows(fleet, fleet.address(engine), engine)
        await asyncio.to_thread(redis.kill)
        await asyncio.to_thread(redis.start)
        assert await holder_of(fleet, PREFIX, 4) == holder
        for engine in fleet.engines:
            address = fleet.address(engine)

            async def rebuilt(address: str = address, engine: EngineApp = engine) -> bool:
                return await indexed_keys(fleet, address) == cached_keys(engine)

            await eventually(rebuilt, 20, f"{address}'s blocks indexed again")
            await index_follows(fleet, address, engine)
            assert _resyncs(fleet, address) >= 1, address
        address = fleet.address(fleet.engines[0])
        before = _resyncs(fleet, address)
        fresh = await fleet.restart_engine(address, "e-new")
        await index_follows(fleet, address, fresh)
        assert _resyncs(fleet, address) >= before
    finally:
        await close_fleet(fleet)


class CutEvents(Forwarding):
    """Relays the engine's KV-event stream until `cut()`, which ends it as an engine does
    (one terminal EngineError, as for a subscriber that fell behind) and holds the next
    subscription until `resume` is set."""

    def __init__(self, inner: pb_grpc.OpenEngineAsyncStub) -> None:
        super().__init__(inner)
        self.resume = asyncio.Event()
        self.resume.set()
        self.held = asyncio.Event()  # a subscription waits for `resume`
        self.requests: list[pb.SubscribeKvEventsRequest] = []
        self._calls: list[Any] = []
        self._cut = False

    def cut(self) -> None:
        self.resume.clear()
        self._cut = True
        for call in self._calls:
            call.cancel()

    async def SubscribeKvEvents(
        self, request: pb.SubscribeKvEventsRequest, context: Context
    ) -> AsyncIterator[pb.SubscribeKvEventsResponse]:
        if not self.resume.is_set():
            self.held.set()
            await self.resume.wait()
        self.requests.append(request)
        self._cut = False
        call = self.inner.SubscribeKvEvents(request)
        self._calls.append(call)
        try:
            async for reply in call:
                yield reply
        except asyncio.CancelledError:
            if not self._cut:
                raise
            yield pb.SubscribeKvEventsResponse(
                error=pb.EngineError(code=pb.ERROR_CODE_OVERLOADED, message="cut by the test")
            )


async def test_a_writer_lease_found_taken_anew_counts_one_resync(redis: RedisServer) -> None:
    """The engine's writer lease key gone from Redis under its holder (it expired under a
    paused holder nobody replaced, or Redis lost it): the holder's next renewal takes it
    anew and resubscribes, which rebuilds the engine's entries and counts exactly one
    `kvplane_controller_engine_kv_event_resyncs_total`, by the writer lease's rule shared
    with the indexer replicas' `resyncs` (a first take, from nobody, counts none)."""
    fleet = await make_fleet(1, index={"backend": redis.url, "writer_lease_s": 1.5})
    try:
        engine = fleet.engines[0]
        address = fleet.address(engine)
        await finished(fleet, generate_request("a", [*PREFIX, 1]))
        await index_follows(fleet, address, engine)
        assert _resyncs(fleet, address) == 0
        assert redis.command("DEL", f"kvplane:{{default:0}}:l:{address}") == 1
        await eventually(lambda: _resyncs(fleet, address) == 1, 20, "the lease taken anew")
        await finished(fleet, generate_request("b", [*range(3000, 3064), 1]))
        await index_follows(fleet, address, engine)
        assert _resyncs(fleet, address) == 1
    finally:
        await close_fleet(fleet)


@pytest.mark.parametrize("buffer_steps", [10_000, 1], ids=["replayed", "snapshot"])
async def test_a_kv_event_stream_the_engine_ends_is_followed_again_exactly(
    index: dict[str, str], buffer_steps: int
) -> None:
    """The engine ends a SubscribeKvEvents stream (a terminal EngineError) and its cache turns
    over before the controller subscribes again (the old prompt evicted, new ones stored):
    the controller resubscribes from the next sequence number, and from the engine's replay
    (`replayed`) or, when the engine no longer buffers that far back, its snapshot
    (`snapshot`), the index holds exactly the engine's blocks again."""
    engine = await start_fronted_engine(
        "cut", CutEvents, num_kv_blocks=16, kv_events=KvEventsConfig(buffer_steps=buffer_steps)
    )
    address = f"127.0.0.1:{engine.port}"
    fleet = await make_fleet(engines=[engine], index=index)
    try:
        await finished(fleet, generate_request("old", [*PREFIX, 1]))
        await holder_of(fleet, PREFIX, 4)
        await index_follows(fleet, address, engine.inner)
        engine.servicer.cut()
        await engine.servicer.held.wait()  # the controller subscribes again: held for now
        direct = pb_grpc.OpenEngineStub(engine.channel)
        for i in range(5):  # 20 full blocks through a 16-block cache
            request = generate_request(f"new{i}", [*range(4000 + 100 * i, 4064 + 100 * i), 1])
            [r async for r in direct.Generate(request)]
        assert block_keys(PREFIX, 16)[0] not in cached_keys(engine.inner)  # evicted
        engine.servicer.resume.set()
        await index_follows(fleet, address, engine.inner)
        last = engine.servicer.requests[-1]
        assert last.include_snapshot and last.start_sequence_number > 1  # from where it was
        source = fleet.app.controller.fleet.source_of(address)
        assert isinstance(source, OpenEngineSource)
        # Replayed: no clear since the first batch; a snapshot: one clear, for its gap.
        resets = 1 if buffer_steps > 1 else 2
        assert (source.counters.num_resets, source.counters.num_resyncs) == (resets, 0)
        match = await fleet.admin.Match(apb.PromptQuery(token_ids=pb.TokenIds(ids=PREFIX)))
        assert [m.device_blocks for m in match.matches] == [0]
    finally:
        await close_fleet(fleet)


class DropsABatch(Forwarding):
    """Relays the engine's KV-event stream, leaving out one batch when `drop` is set (as an
    adapter whose feed lost a message would): the stream goes on with a sequence gap."""

    def __init__(self, inner: pb_grpc.OpenEngineAsyncStub) -> None:
        super().__init__(inner)
        self.drop = False
        self.requests: list[pb.SubscribeKvEventsRequest] = []

    async def SubscribeKvEvents(
        self, request: pb.SubscribeKvEventsRequest, context: Context
    ) -> AsyncIterator[pb.SubscribeKvEventsResponse]:
        self.requests.append(request)
        async for reply in self.inner.SubscribeKvEvents(request):
            if self.drop and reply.WhichOneof("event") == "batch":
                self.drop = False
                continue
            yield reply


async def test_a_sequence_gap_in_a_kv_event_stream_is_rebuilt_from_a_snapshot(
    index: dict[str, str],
) -> None:
    """A batch the controller never got (the next one skips its number): the worker is
    cleared and rebuilt from a fresh snapshot subscription, so the blocks stored before the
    gap are not lost and those in the missing batch are indexed too."""
    engine = await start_fronted_engine("gap", DropsABatch)
    address = f"127.0.0.1:{engine.port}"
    fleet = await make_fleet(engines=[engine], index=index)
    try:
        await finished(fleet, generate_request("before", [*PREFIX, 1]))
        await index_follows(fleet, address, engine.inner)
        engine.servicer.drop = True
        await finished(fleet, generate_request("dropped", [*range(5000, 5064), 1]))
        await finished(fleet, generate_request("after", [*range(6000, 6064), 1]))
        source = fleet.app.controller.fleet.source_of(address)
        assert isinstance(source, OpenEngineSource)
        await source.wait_until(lambda: source.counters.num_resyncs == 1, 20)
        await index_follows(fleet, address, engine.inner)
        last = engine.servicer.requests[-1]
        assert (last.include_snapshot, last.start_sequence_number) == (True, 0)
        assert source.counters.num_gaps == 1
        # Scraped as Prometheus counters, per engine.
        metrics = fleet.app.controller.metrics.registry
        for name, value in (("resyncs", 1), ("gaps", 1), ("restarts", 0)):
            sample = f"kvplane_controller_engine_kv_event_{name}_total"
            assert metrics.get_sample_value(sample, {"engine": address}) == value
    finally:
        await close_fleet(fleet)
