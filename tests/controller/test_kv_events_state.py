"""`kvplane admin workers` says, per engine, whether the controller follows its KV events into
the index now: an engine whose event stream is lost while its polls succeed (its ZMQ
publisher gone, its SubscribeKvEvents failing and retried) is routed on an index stale for it
alone, and its health says nothing of it. Real servers: a controller, sim engines behind a
front server that plays the event stream's faults, a real ZMQ publisher, a real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import msgpack
import pytest
import zmq.asyncio

from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import EngineFleet, close_fleet, make_fleet
from tests.controller.fronted_engine import Forwarding, FrontedEngine, start_fronted_engine
from tests.controller.test_admin_cli import cli
from tests.controller.test_admin_cli_membership import cli_json
from tests.controller.test_controller_replicas import close_replica, shared_index, small_engines
from tests.controller.test_flapping_engines import CrashLooping
from tests.controller.test_fleet_events import BLOCK, RankedZmqEngine, sample, scrape
from tests.controller.test_processes import indexer_process
from tests.indexer.fake_kv_publisher import FakeKvPublisher
from tests.polling import eventually
from tests.redis_servers import RedisServer

pytestmark = pytest.mark.timeout(90)

WAIT_S = 20.0
UP = "kvplane_controller_engine_kv_events_up"
LAG = "kvplane_controller_engine_event_lag_seconds"


async def worker(fleet: EngineFleet[Any], address: str) -> dict[str, Any]:
    """The engine's row of `kvplane admin workers --output json` against the controller."""
    listed = await cli_json("workers", "--target", fleet.target)
    return next(w for w in listed["workers"] if w["address"] == address)


async def wait_kv_events(fleet: EngineFleet[Any], address: str, state: str) -> dict[str, Any]:
    """The engine's row once `admin workers` shows its KV events in `state`."""
    row: dict[str, Any] = {}

    async def shown() -> bool:
        nonlocal row
        row = await worker(fleet, address)
        return row.get("kv_events_state") == state

    await eventually(shown, WAIT_S, f"{address}'s KV events {state}")
    return row


Z = TypeVar("Z", bound=RankedZmqEngine)


@contextlib.asynccontextmanager
async def zmq_followed(
    kind: Callable[[pb_grpc.OpenEngineAsyncStub, list[FakeKvPublisher]], Z],
) -> AsyncIterator[tuple[EngineFleet[Any], FrontedEngine[Z], FakeKvPublisher]]:
    """A controller (with metrics) following one engine's KV events (`kv_events: zmq`) from
    its ZMQ publisher: the fleet, the engine (a `kind` in front of a sim engine), the
    publisher."""
    context = zmq.asyncio.Context()
    publisher = FakeKvPublisher(context)
    publisher.start_replay()
    engine = await start_fronted_engine("zmq-events", lambda inner: kind(inner, [publisher]))
    fleet = await make_fleet(engines=[engine], kv_events="zmq", metrics_listen="127.0.0.1:0")
    try:
        yield fleet, engine, publisher
    finally:
        await close_fleet(fleet)
        await publisher.close()
        context.term()


async def test_a_lost_zmq_publisher_shows_down_while_the_engine_stays_ready() -> None:
    """`kv_events: zmq`: the engine's publisher goes away (its socket closed, as a publisher
    process killed beside an engine whose gRPC keeps answering) and comes back."""
    async with zmq_followed(RankedZmqEngine) as (fleet, _, publisher):
        address = fleet.address(fleet.engines[0])
        row = await wait_kv_events(fleet, address, "following")
        assert row["kv_events_reason"] == "" and row["kv_events_since_unix_s"] > 0
        assert sample(await scrape(fleet), UP, address) == 1.0
        await publisher.wait_subscribed()
        stored = ["BlockStored", [11], None, list(range(BLOCK)), BLOCK, None, "GPU"]
        await publisher.publish(
            [b"", (0).to_bytes(8, "big"), msgpack.packb([time.time(), [stored], 1])]
        )

        async def lag_exported() -> bool:
            return sample(await scrape(fleet), LAG, address) is not None

        await eventually(lag_exported, WAIT_S, "the batch's event lag exported")

        publisher.close_pub()  # the publisher is gone; the engine still answers
        row = await wait_kv_events(fleet, address, "down")
        assert row["state"] == "ready" and row["routable"]
        assert f"publisher {publisher.endpoint} disconnected" in row["kv_events_reason"]
        scraped = await scrape(fleet)
        assert sample(scraped, UP, address) == 0.0
        # The last batch's lag says nothing of events that do not arrive: no value frozen at it.
        assert sample(scraped, LAG, address) is None
        table = await cli("workers", "--target", fleet.target)
        assert "KV EVENTS" in table.stdout
        assert re.search(r"down since \d\d:\d\d:\d\dZ: publisher tcp://", table.stdout)

        await publisher.restart()  # back on the same endpoint
        await wait_kv_events(fleet, address, "following")
        assert sample(await scrape(fleet), UP, address) == 1.0


async def test_an_engine_followed_rank_by_rank_is_down_while_one_rank_is() -> None:
    """An engine without SubscribeKvEvents followed through its advertised ZMQ ranks (the
    OpenEngine source's fallback): down while one rank's publisher is gone, naming the rank."""
    context = zmq.asyncio.Context()
    ranks = [FakeKvPublisher(context), FakeKvPublisher(context)]
    for publisher in ranks:
        publisher.start_replay()
    engine = await start_fronted_engine("ranked", lambda inner: RankedZmqEngine(inner, ranks))
    address = f"127.0.0.1:{engine.port}"
    fleet = await make_fleet(engines=[engine])
    try:
        await wait_kv_events(fleet, address, "following")
        ranks[1].close_pub()
        row = await wait_kv_events(fleet, address, "down")
        assert row["kv_events_reason"] == (
            f"{address}/dp1: publisher {ranks[1].endpoint} disconnected"
        )
        await ranks[1].restart()
        await wait_kv_events(fleet, address, "following")
    finally:
        await close_fleet(fleet)
        for publisher in ranks:
            await publisher.close()
        context.term()


class SwitchableEvents(Forwarding):
    """The sim engine's SubscribeKvEvents, cut and refused while `cut_events` holds (a
    stream failing and retried while the engine's polls succeed)."""

    def __init__(self, inner: pb_grpc.OpenEngineAsyncStub) -> None:
        super().__init__(inner)
        self.events_off = asyncio.Event()

    async def SubscribeKvEvents(
        self, request: pb.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.SubscribeKvEventsResponse]:
        if self.events_off.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "KV events off")
        stream = self.inner.SubscribeKvEvents(request)
        off = asyncio.ensure_future(self.events_off.wait())
        try:
            while True:
                read = asyncio.ensure_future(stream.read())
                await asyncio.wait((read, off), return_when=asyncio.FIRST_COMPLETED)
                if off.done():
                    read.cancel()
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "KV events cut")
                reply = read.result()
                if reply is grpc.aio.EOF:
                    return
                assert isinstance(reply, pb.SubscribeKvEventsResponse)
                yield reply
        finally:
            off.cancel()
            stream.cancel()


async def test_a_failing_subscribe_kv_events_shows_down_while_the_engine_stays_ready() -> None:
    engine = await start_fronted_engine("grpc-events", SwitchableEvents)
    address = f"127.0.0.1:{engine.port}"
    fleet = await make_fleet(engines=[engine])
    try:
        await wait_kv_events(fleet, address, "following")

        engine.servicer.events_off.set()
        row = await wait_kv_events(fleet, address, "down")
        assert row["state"] == "ready" and row["routable"]
        assert "UNAVAILABLE: KV events" in row["kv_events_reason"]

        engine.servicer.events_off.clear()
        row = await wait_kv_events(fleet, address, "following")
        assert row["kv_events_reason"] == ""
    finally:
        await close_fleet(fleet)


async def test_an_engine_followed_by_another_replica_says_so(redis: RedisServer) -> None:
    """Two replicas on one Redis: the lease holder follows the engine, the other says another
    replica does (not down); once the holder is gone, the other follows it."""
    a = await make_fleet(engines=await small_engines(1), index=shared_index(redis))
    b = await make_fleet(engines=a.engines, index=shared_index(redis))
    address = a.address(a.engines[0])
    try:
        await wait_kv_events(a, address, "following")
        row = await wait_kv_events(b, address, "other_replica")
        assert "another replica" in row["kv_events_reason"]
        await close_replica(a)
        await wait_kv_events(b, address, "following")
    finally:
        await close_replica(b)
        for engine in a.engines:
            await engine.close()


async def test_an_engine_followed_by_an_indexer_on_the_same_redis_says_so(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]], redis: RedisServer
) -> None:
    """A `kvplane indexer serve` process following the engine into the controller's Redis
    partition holds the engine's writer lease: the controller shows `other_replica`, and its
    reason names the indexer as a possible holder (it used to say a controller replica held
    it, sending the operator to look for one that did not exist)."""
    engine = (await small_engines(1))[0]
    address = f"127.0.0.1:{engine.port}"
    await indexer_process(tmp_path, [address], processes, backend=redis.url)
    lease, client = f"kvplane:{{default:0}}:l:{address}", redis.client()

    def held_by_the_indexer() -> bool:
        holder = client.get(lease)
        return isinstance(holder, bytes) and b"/indexer-" in holder

    await eventually(held_by_the_indexer, WAIT_S, "the indexer holding the writer lease")
    client.close()
    fleet = await make_fleet(engines=[engine], index=shared_index(redis))
    try:
        row = await wait_kv_events(fleet, address, "other_replica")
        assert "kvplane indexer" in row["kv_events_reason"], row["kv_events_reason"]
    finally:
        await close_fleet(fleet)


def one_batch() -> list[bytes]:
    """A ZMQ batch (sequence 0, stamped now) storing one block."""
    stored = ["BlockStored", [11], None, list(range(BLOCK)), BLOCK, None, "GPU"]
    return [b"", (0).to_bytes(8, "big"), msgpack.packb([time.time(), [stored], 1])]


class RestartingZmqEngine(CrashLooping, RankedZmqEngine):
    """An engine whose KV events come from its ZMQ publisher, restarted at its address (a new
    instance id; its publisher a new PUB on the same endpoint)."""


async def test_a_restarted_zmq_engine_shows_no_event_of_its_old_process() -> None:
    """`following since T (last T0)`: T0 is when the engine process followed since T last had
    a batch indexed. A new process at the address (same endpoint) has sent none yet, so the
    old process's last batch is not shown as its own; its first batch is."""
    async with zmq_followed(RestartingZmqEngine) as (fleet, engine, publisher):
        address = fleet.address(engine)
        controller_fleet = fleet.app.controller.fleet
        await wait_kv_events(fleet, address, "following")
        await publisher.wait_subscribed()
        await publisher.publish(one_batch())

        async def last_event_shown() -> bool:
            return "last_kv_event_unix_s" in await worker(fleet, address)

        await eventually(last_event_shown, WAIT_S, "the old process's batch indexed")
        old_source = controller_fleet.source_of(address)

        instance = engine.servicer.restart()
        await publisher.restart()

        async def new_process_followed() -> bool:
            record = controller_fleet.registry.get(address)
            source = controller_fleet.source_of(address)
            row = await worker(fleet, address)
            return (
                record.engine_id == instance
                and source is not None
                and source is not old_source
                and row["kv_events_state"] == "following"
            )

        await eventually(new_process_followed, WAIT_S, "the new process's events followed")
        row = await worker(fleet, address)
        assert "last_kv_event_unix_s" not in row, row
        table = (await cli("workers", "--target", fleet.target)).stdout
        assert re.search(r"following since \d\d:\d\d:\d\dZ(?! \(last)", table), table

        await publisher.wait_subscribed()
        await publisher.publish(one_batch())
        await eventually(last_event_shown, WAIT_S, "the new process's batch indexed")
        row = await worker(fleet, address)
        assert row["last_kv_event_unix_s"] >= row["kv_events_since_unix_s"]
