"""The controller's connections to an engine gone silent without a reset (its host gone, a NAT
entry expired, a blackholed path: a forwarder that drops what it reads, both ways, while new
connections reach the engine), and the keepalive pings that find them: its polls go on a new
connection, the gateway's streams on the silent one end once the engine answers on the new
one (retried elsewhere before their first token, one EngineError after), while those on a
connection only congested go on, the Abort of a lost request reaches the engine once its
path heals, its KV-event subscription ends and is made again, and a kvplane server takes the
pings of a client that sends them often."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from controller.app import ControllerApp, start_controller
from controller.config import ControllerConfig
from controller.registry import EngineState
from engine.server.service import EngineApp
from indexer.sources.openengine import OpenEngineSource
from kvplane.channels import INSECURE
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import (
    EngineFleet,
    ServedEngine,
    close_fleet,
    generate_request,
    make_fleet,
    start_sim_engine,
)
from tests.controller.test_gateway import PREFIX
from tests.controller.test_stalled_engines import (
    EngineProcess,
    engine_runs_nothing,
    nothing_in_flight,
    num_tokens,
    two_streams_past_their_first_token,
)
from tests.grpc_streams import next_reply, remaining_replies
from tests.polling import eventually
from tests.tcp_forwarder import TcpForwarder

pytestmark = pytest.mark.timeout(90)

PING_FRAME_BYTES = 17  # an HTTP/2 PING: a 9-byte frame header and 8 bytes of payload


async def controller_behind(forwarder: TcpForwarder, **health: float) -> ControllerApp:
    """A controller that reaches its one engine through `forwarder`, following its KV events
    (SubscribeKvEvents); `health`: more `health` settings."""
    config = ControllerConfig.model_validate(
        {
            "listen": "127.0.0.1:0",
            "engines": [{"address": forwarder.address, "kv_events": "grpc"}],
            "health": {
                "poll_interval_s": 0.2,
                "load_poll_interval_s": 0.1,
                "rpc_timeout_s": 0.5,
                "backoff_initial_s": 0.5,
                "backoff_max_s": 1.0,
                **health,
            },
            "shutdown_grace_s": 0.5,
        }
    )
    return await start_controller(config)


async def serve_directly(engine: EngineApp, request_id: str, tokens: list[int]) -> None:
    """A request the engine serves on a connection of its own (not through the forwarder):
    it announces the prompt's blocks on its KV-event stream."""
    async with INSECURE.aio_channel(f"127.0.0.1:{engine.port}") as channel:
        replies = pb_grpc.OpenEngineStub(channel).Generate(generate_request(request_id, tokens))
        assert [r async for r in replies][-1].WhichOneof("event") == "finished"


async def test_an_engine_whose_connection_went_silent_is_routed_to_again_soon() -> None:
    """The connections to the engine go silent: its polls time out, it is unreachable, and
    the poll after is made on a new connection, which the engine answers: routable again at
    once. Before, every poll went on the silent connection, each timing out, and the engine
    stayed unreachable until the kernel gave up on it (some 15 minutes)."""
    engine = await start_sim_engine("e0")
    forwarder = await TcpForwarder.start(f"127.0.0.1:{engine.port}")
    app = await controller_behind(forwarder)
    registry = app.controller.fleet.registry
    try:
        await eventually(lambda: registry.get(forwarder.address).routable, 15, "routable")
        connections = forwarder.tunnels
        forwarder.silence()
        await eventually(
            lambda: registry.get(forwarder.address).state is EngineState.UNREACHABLE,
            15,
            "the engine behind a silent connection to be unreachable",
            every_s=0.005,
        )
        await eventually(
            lambda: registry.get(forwarder.address).routable,
            15,
            "the engine routable again, on a new connection",
        )
        assert forwarder.tunnels > connections
    finally:
        await app.close(0.2)
        await forwarder.cut()
        await engine.close()


async def test_a_kv_event_subscription_gone_silent_is_made_again() -> None:
    """The KV-event subscription's connection goes silent: the keepalive pings go
    unanswered, the subscription ends and is made again on a new connection, and the
    engine's events reach the index again. Before, it waited on the silent connection for
    good (no keepalive), and the index missed every block the engine stored from then on."""
    engine = await start_sim_engine("e0")
    forwarder = await TcpForwarder.start(f"127.0.0.1:{engine.port}")
    app = await controller_behind(forwarder, keepalive_s=1.0, keepalive_timeout_s=1.0)
    fleet = app.controller.fleet
    kv_log = engine.service.kv_log
    try:
        await eventually(lambda: fleet.registry.get(forwarder.address).routable, 15, "routable")
        source = fleet.source_of(forwarder.address)
        assert isinstance(source, OpenEngineSource)
        await serve_directly(engine, "before", list(range(100, 140)))
        await source.wait_until(lambda: source.last_seq == kv_log.last_sequence_number, 15)

        forwarder.silence()
        await serve_directly(engine, "after", list(range(200, 240)))
        await source.wait_until(lambda: source.last_seq == kv_log.last_sequence_number, 30)
    finally:
        await app.close(0.2)
        await forwarder.cut()
        await engine.close()


async def test_a_kvplane_server_takes_frequent_keepalive_pings() -> None:
    """A client pinging every second on a subscription that brings nothing (a quiet engine's
    KV events): the engine takes the pings, and the subscription goes on. Before, its
    server took each ping less than 5 minutes after the last as a strike (gRPC's default),
    and ended the subscription with GOAWAY `too_many_pings` at the third."""
    engine = await start_sim_engine("e0")
    forwarder = await TcpForwarder.start(f"127.0.0.1:{engine.port}")
    channels = INSECURE.keeping_alive(1.0, 5.0)
    try:
        async with channels.aio_channel(forwarder.address) as channel:
            stream = pb_grpc.OpenEngineStub(channel).SubscribeKvEvents(
                pb.SubscribeKvEventsRequest(include_snapshot=True)
            )
            await stream.read()  # the snapshot: the subscription is up, and quiet from here
            sent = forwarder.bytes_from_clients
            await eventually(
                lambda: (
                    stream.done() or forwarder.bytes_from_clients >= sent + 5 * PING_FRAME_BYTES
                ),
                30,
                "five keepalive pings, or the subscription's end",
            )
            await serve_directly(engine, "after the pings", list(range(300, 340)))
            batch = await stream.read()  # (an AioRpcError if the subscription ended)
            assert batch is not grpc.aio.EOF
    finally:
        await forwarder.cut()
        await engine.close()


class ForwardedEngine:
    """A `kvplane engine serve --model sim` process that the controller reaches through a
    forwarder (`port`: the forwarder's), whose connections a test can silence."""

    def __init__(self, process: EngineProcess, forwarder: TcpForwarder) -> None:
        self.process = process
        self.forwarder = forwarder

    @property
    def port(self) -> int:
        return int(self.forwarder.address.rpartition(":")[2])

    @property
    def direct(self) -> str:
        """The engine process's own address, not through the forwarder."""
        return f"127.0.0.1:{self.process.port}"

    async def close(self) -> None:
        await self.forwarder.cut()
        await self.process.close()


SilentFleet = tuple[EngineFleet[ServedEngine], ForwardedEngine]


@pytest.fixture
async def silent_fleet(tmp_path: Path) -> AsyncIterator[SilentFleet]:
    """A controller in front of a forwarded engine process (the first engine) and an
    in-process sim engine ("healthy"), every new request routed to the forwarded one (the
    healthy engine cordoned). Its pings wait 5 minutes for an answer, so that they cannot be
    what ends a stream on a silent connection here: by default keepalive ends one within 5
    min 20 s, or 20 s after a ping gRPC sends as data comes in (its flow-control probe)."""
    async with forwarded_fleet(tmp_path) as fleet:
        yield fleet


@contextlib.asynccontextmanager
async def forwarded_fleet(tmp_path: Path, **health: float) -> AsyncIterator[SilentFleet]:
    """`silent_fleet`, with more `health` settings."""
    process = await EngineProcess.start(tmp_path, "forwarded")
    forwarded = ForwardedEngine(process, await TcpForwarder.start(f"127.0.0.1:{process.port}"))
    healthy = await start_sim_engine("healthy", time_scale=1.0)
    engines: list[ServedEngine] = [forwarded, healthy]
    fleet = await make_fleet(
        engines=engines,
        router={"session_metadata_key": "s"},
        health={"keepalive_timeout_s": 300.0, **health},
    )
    try:
        await fleet.admin.Cordon(apb.EngineRef(engine="healthy"))
        yield fleet, forwarded
    finally:
        await close_fleet(fleet)


def leftovers(address: str) -> list[str]:
    """The controller's background tasks still about the engine at `address`: an Abort of a
    request whose call was ended, the closing of one of its old channels."""
    return [
        task.get_name()
        for task in asyncio.all_tasks()
        if task.get_name().startswith("abort lost request")
        or task.get_name() == f"close a channel to {address}"
    ]


async def test_streams_on_a_connection_gone_silent_end_with_an_error_naming_the_engine(
    silent_fleet: SilentFleet,
) -> None:
    """The connection holding an OpenEngine stream and a vllm.Generate one, both past their
    first token, goes silent while the engine answers on new ones: once its polls found it
    unreachable there and answering on a new connection, the streams end (one EngineError;
    UNAVAILABLE), the engine is told to abort them on its new connection, and the controller
    serves on. Before, they waited for keepalive to end the silent connection (its pings'
    timeout: 5 minutes here, 20 s by default), the engine running them on meanwhile."""
    fleet, forwarded = silent_fleet
    address = fleet.address(forwarded)
    streams = await two_streams_past_their_first_token(fleet)
    forwarded.forwarder.silence()
    await streams.end_naming(f"engine {address} went silent on the call's connection")
    await nothing_in_flight(fleet)
    # The engine, which ran on into the silent connection, was told to abort both.
    await engine_runs_nothing(forwarded.direct)
    # It serves on, through the controller, on its new connection.
    await fleet.wait_routable(1)
    served = [r async for r in fleet.gateway.Generate(generate_request("after", [7], 4))]
    assert served[-1].WhichOneof("event") == "finished", served[-1]
    assert fleet.app.controller.fleet.registry.get(address).state is EngineState.READY
    await eventually(lambda: not leftovers(address), 15, "no task left about the engine")


async def test_a_stream_on_a_silent_connection_before_its_first_token_is_answered_elsewhere(
    silent_fleet: SilentFleet,
) -> None:
    """A request sent on a connection gone silent: once the engine answers on a new one,
    the request, with no output yet, is retried on the other engine and answered in full.
    Before, it waited for keepalive to end the silent connection (its pings' timeout: 5
    minutes here; by default up to 5 min 20 s for a stream that received nothing)."""
    fleet, forwarded = silent_fleet
    address = fleet.address(forwarded)
    # A session started on the forwarded engine: its next request goes there too while it
    # is routable, and, once it failed there, to the other engine.
    warm = [r async for r in fleet.gateway.Generate(generate_request("warm", [1], s="pin"))]
    assert warm[-1].WhichOneof("event") == "finished", warm[-1]
    await fleet.admin.Uncordon(apb.EngineRef(engine="healthy"))
    forwarded.forwarder.silence()  # before the request is sent: nothing of it comes back
    request = generate_request("held", [*PREFIX, 1], max_tokens=8, s="pin")
    stream = asyncio.create_task(remaining_replies(fleet.gateway.Generate(request)))
    relay = fleet.app.gateway.relay
    await eventually(lambda: relay.holding.get("held") == address, 15, "held by the engine")
    async with asyncio.timeout(60):  # a hang guard; the outcome is what is asserted
        responses = await stream
    assert responses[-1].WhichOneof("event") == "finished", responses[-1]
    assert num_tokens(responses) == 8
    assert not [r for r in responses if r.WhichOneof("event") == "error"]
    await nothing_in_flight(fleet)
    await engine_runs_nothing(forwarded.direct)
    await eventually(lambda: not leftovers(address), 15, "no task left about the engine")


async def test_streams_on_a_congested_connection_go_on_to_their_end(tmp_path: Path) -> None:
    """The connection holding an OpenEngine stream turns slow both ways, losing nothing (a
    congested link: what is sent arrives 2 s late): a poll on it times out (1 s), the engine
    answers on a new connection, and the Health asked on the old one then times out too; but
    the stream's tokens come in meanwhile, late: the connection is alive, and the stream
    goes on to its end. Before, it ended with an EngineError ("went silent on the call's
    connection"), its engine healthy all along."""
    async with forwarded_fleet(tmp_path, rpc_timeout_s=1.0) as (fleet, forwarded):
        address = fleet.address(forwarded)
        engine = fleet.app.controller.fleet._engines[address]
        registry = fleet.app.controller.fleet.registry
        # Some 20 s of tokens: under way still when the old connection is asked.
        request = generate_request("congested", [*PREFIX, 1], max_tokens=2000)
        stream = fleet.gateway.Generate(request)
        first = await next_reply(stream)
        connections = forwarded.forwarder.tunnels
        forwarded.forwarder.slow_down(2.0)

        def old_connection_asked() -> bool:
            """A poll timed out on the slow connection, the engine answered on a new one,
            and the old one was asked whether it is alive."""
            return (
                forwarded.forwarder.tunnels > connections
                and registry.get(address).state is EngineState.READY
                and not engine.dialled.doubted
            )

        await eventually(old_connection_asked, 30, "the old connection asked")
        # The stream goes on to its end, with no error.
        async with asyncio.timeout(60):  # a hang guard; the outcome is what is asserted
            responses = [first, *await remaining_replies(stream)]
        assert not [r for r in responses if r.WhichOneof("event") == "error"]
        assert responses[-1].WhichOneof("event") == "finished", responses[-1]
        assert num_tokens(responses) == 2000
        await nothing_in_flight(fleet)


async def lose_a_stream_in_a_blackhole(
    fleet: EngineFleet[ServedEngine], forwarded: ForwardedEngine, request: pb.GenerateRequest
) -> None:
    """`request`'s stream, past its first token, is lost as the path to the engine is
    blackholed, new connections too (`silence(new_ones=True)`): it ends with an EngineError
    once `abandon_streams_after_s` passed, and the Abort of its request waits for the engine
    on a connection that never gets through, which a poll timing out on it then doubts."""
    address = fleet.address(forwarded)
    engine = fleet.app.controller.fleet._engines[address]
    stream = fleet.gateway.Generate(request)
    while (await next_reply(stream)).WhichOneof("event") != "token":
        pass
    forwarded.forwarder.silence(new_ones=True)
    async with asyncio.timeout(60):  # a hang guard; the outcome is what is asserted
        rest = await remaining_replies(stream)
    assert rest[-1].WhichOneof("event") == "error", rest[-1]
    assert f"abort lost request {request.request_id} on {address}" in leftovers(address)
    await eventually(lambda: engine.dialled.doubted, 30, "the Abort's connection doubted")


async def test_an_abort_of_a_lost_request_reaches_the_engine_once_its_path_heals(
    tmp_path: Path,
) -> None:
    """The path to the engine is blackholed, new connections too, longer than
    `abandon_streams_after_s`: the stream on it ends, and the Abort of its request waits on
    a connection that never got through; once the path heals the engine answers on a newer
    one, and the Abort, ended with the connection it waited on, is sent again there: the
    engine, which ran the request on into the silent connection, frees it. Before, the
    Abort ended with that connection, and the engine ran the request on to its end."""
    async with forwarded_fleet(tmp_path, rpc_timeout_s=1.0, abandon_streams_after_s=1.0) as (
        fleet,
        forwarded,
    ):
        address = fleet.address(forwarded)
        request = generate_request("orphan", [*PREFIX, 1], max_tokens=100_000)
        await lose_a_stream_in_a_blackhole(fleet, forwarded, request)
        forwarded.forwarder.let_new_ones_through()
        await engine_runs_nothing(forwarded.direct)
        await fleet.wait_routable(1)
        await nothing_in_flight(fleet)
        await eventually(lambda: not leftovers(address), 15, "no task left about the engine")


async def test_a_retry_sent_while_the_abort_of_its_lost_call_waits_is_not_aborted(
    tmp_path: Path,
) -> None:
    """As above, but the request ran to its end on the engine during the outage, and its
    client sends it again (its id) once the engine answers, while the Abort of the lost call
    still waits on its connection that never got through: that Abort is dropped, and the
    retry, run by the engine, is answered in full, not ended by the Abort meant for the
    lost call."""
    async with forwarded_fleet(tmp_path, rpc_timeout_s=2.0, abandon_streams_after_s=1.0) as (
        fleet,
        forwarded,
    ):
        address = fleet.address(forwarded)
        engine = fleet.app.controller.fleet._engines[address]
        registry = fleet.app.controller.fleet.registry
        request = generate_request("again", [*PREFIX, 1], max_tokens=300)
        await lose_a_stream_in_a_blackhole(fleet, forwarded, request)
        await engine_runs_nothing(forwarded.direct)  # the lost call ran to its end
        forwarded.forwarder.let_new_ones_through()

        def answering_while_the_abort_waits() -> bool:
            """Routable again, its old connections being asked (the Abort waits on one)."""
            return registry.get(address).state is EngineState.READY and engine.dialled.doubted

        await eventually(answering_while_the_abort_waits, 30, "routable, the Abort waiting")
        assert f"abort lost request again on {address}" in leftovers(address)
        async with asyncio.timeout(60):  # a hang guard; the outcome is what is asserted
            responses = [r async for r in fleet.gateway.Generate(request)]
        assert responses[-1].WhichOneof("event") == "finished", responses[-1]
        assert responses[-1].finished.reason != pb.FINISH_REASON_CANCELLED, responses[-1]
        assert num_tokens(responses) == 300
        await nothing_in_flight(fleet)
        await eventually(lambda: not leftovers(address), 15, "no task left about the engine")
