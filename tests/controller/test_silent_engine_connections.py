"""The controller's connections to an engine gone silent without a reset (its host gone, a NAT
entry expired, a blackholed path: a forwarder that drops what it reads, both ways, while new
connections reach the engine), and the keepalive pings that find them: its polls go on a new
connection, its KV-event subscription ends and is made again, and a kvplane server takes the
pings of a client that sends them often."""

from __future__ import annotations

import grpc
import pytest

from controller.app import ControllerApp, start_controller
from controller.config import ControllerConfig
from controller.registry import EngineState
from engine.server.service import EngineApp
from indexer.sources.openengine import OpenEngineSource
from kvplane.channels import INSECURE
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import generate_request, start_sim_engine
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
