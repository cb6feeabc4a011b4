"""The controller's KV-event paths through real servers: `kv_events: zmq` (the engine's
vLLM-style ZMQ publisher found through GetKvEventSources) feeds the router, and both paths
export each engine's event lag on /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import msgpack
import pytest
import zmq.asyncio
from typer.testing import CliRunner

from controller.app import start_controller
from controller.config import ControllerConfig
from controller.route_report import read_route
from engine.config import KvEventsConfig
from engine.server.service import EngineApp
from indexer.batch import Component
from indexer.keys import block_keys
from indexer.memory_backend import MemoryBackend
from indexer.sources.openengine import OpenEngineSource
from indexer.sources.zmq import ZmqSource
from kvplane.cli import app
from kvplane.config import load_config
from kvplane.errors import ConfigError
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import (
    EngineFleet,
    Fleet,
    ServedEngine,
    close_fleet,
    engines_of_kinds,
    generate_request,
    make_fleet,
    start_sim_engine,
)
from tests.controller.fronted_engine import Forwarding, start_fronted_engine
from tests.indexer.fake_kv_publisher import FakeKvPublisher
from tests.indexer.hybrid_events import (
    HYBRID_BLOCK_SIZE,
    HYBRID_TOKEN_IDS,
    EventForm,
    hybrid_payload,
)
from tests.polling import eventually

pytestmark = pytest.mark.timeout(60)

WAIT_S = 15.0
BLOCK = 16


def zmq_events_config(
    endpoints: tuple[str, str] = ("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"),
) -> KvEventsConfig:
    """An engine's ZMQ publisher on `endpoints` (publisher, replay; default: free ports)."""
    endpoint, replay_endpoint = endpoints
    return KvEventsConfig(zmq_enabled=True, endpoint=endpoint, replay_endpoint=replay_endpoint)


async def start_zmq_engine(
    name: str, port: int = 0, *, endpoints: tuple[str, str] | None = None, **config: Any
) -> EngineApp:
    """A sim engine on `port` (0: a free one) that also publishes its KV events on ZMQ, on
    `endpoints` (publisher, replay; default: free ports); `config`: more EngineConfig fields."""
    kv_events = zmq_events_config() if endpoints is None else zmq_events_config(endpoints)
    return await start_sim_engine(name, port=port, kv_events=kv_events, **config)


async def zmq_fleet(
    engines: list[EngineApp] | None = None, health: dict[str, float] | None = None
) -> Fleet:
    """A controller following `engines` (default: two fresh ZMQ engines) with
    `kv_events: zmq` (`health`: settings over the quick polls)."""
    if engines is None:
        engines = [await start_zmq_engine(f"z{i}") for i in range(2)]
    return await make_fleet(
        engines=engines, kv_events="zmq", metrics_listen="127.0.0.1:0", health=health or {}
    )


async def scrape(fleet: EngineFleet[Any]) -> str:
    url = f"http://127.0.0.1:{fleet.app.metrics_port}/metrics"
    return await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())


def sample(text: str, name: str, engine: str) -> float | None:
    """The value of metric `name` whose `engine` label is `engine` (None when absent)."""
    match = re.search(rf'^{name}{{engine="{re.escape(engine)}"[^}}]*}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else None


def assert_event_lag_exported(text: str, engine: str, elapsed: float) -> None:
    """The engine's last event lag lies between 0 and the time elapsed since its events were
    caused, and its lag histogram counted at least one batch."""
    lag = sample(text, "kvplane_controller_engine_event_lag_seconds", engine)
    assert lag is not None and 0.0 <= lag <= elapsed, (lag, elapsed)
    batches = sample(text, "kvplane_controller_event_lag_seconds_count", engine)
    assert batches is not None and batches >= 1


async def index_holder(fleet: EngineFleet[Any], tokens: list[int], blocks: int) -> str | None:
    reply = await fleet.admin.Match(apb.PromptQuery(token_ids=pb.TokenIds(ids=tokens)))
    full = [m.engine for m in reply.matches if m.device_blocks >= blocks]
    return full[0] if full else None


async def generate(fleet: EngineFleet[Any], request: pb.GenerateRequest) -> pb.GenerateResponse:
    responses = [r async for r in fleet.gateway.Generate(request)]
    assert responses[-1].WhichOneof("event") == "finished", responses[-1]
    return responses[-1]


async def index_through_zmq(
    fleet: Fleet, base: int, block_size: int = BLOCK
) -> tuple[list[int], str]:
    """A prompt's prefix of 4 blocks of 16, from token id `base` on, and the engine the index
    places it on (all of it: its blocks of the engine's `block_size`), once it is there. A SUB
    socket joins its publisher asynchronously: a batch published before it joined is missed,
    and the next one rebuilds the worker from the replay socket. So fresh prompts are sent
    until the first reaches the index through ZMQ."""
    async with asyncio.timeout(WAIT_S):
        for attempt in itertools.count():
            start = base + 1000 * attempt
            prefix = list(range(start, start + 4 * BLOCK))
            await generate(fleet, generate_request(f"z{start}", [*prefix, 1]))
            for _ in range(20):
                holder = await index_holder(fleet, [*prefix, 2], 4 * BLOCK // block_size)
                if holder is not None:
                    return prefix, holder
                await asyncio.sleep(0.05)
    raise AssertionError("unreachable")


async def test_zmq_kv_events_feed_the_router_and_report_their_lag() -> None:
    fleet = await zmq_fleet()
    try:
        sources = [fleet.app.controller.fleet.source_of(fleet.address(e)) for e in fleet.engines]
        assert all(isinstance(s, ZmqSource) for s in sources), sources
        started = time.time()
        prefix, holder = await index_through_zmq(fleet, 1000)
        held_by = fleet.app.controller.fleet.source_of(holder)
        assert isinstance(held_by, ZmqSource) and held_by.counters.num_events > 0

        route = await fleet.admin.Route(apb.PromptQuery(token_ids=pb.TokenIds(ids=[*prefix, 3])))
        assert (route.engine, route.reason) == (holder, "cache")
        finished = await generate(fleet, generate_request("b", [*prefix, 3]))
        assert finished.usage.cached_prompt_tokens == 4 * BLOCK

        text = await scrape(fleet)
        elapsed = time.time() - started
        assert_event_lag_exported(text, holder, elapsed)
    finally:
        await close_fleet(fleet)


async def test_a_controller_started_beside_an_idle_warm_zmq_engine_indexes_its_cache() -> None:
    """An engine that cached a prompt before the controller started (the controller was
    restarted, say) and publishes nothing since: the controller rebuilds its worker from the
    engine's replay at once, so the prompt is routed by its cache without waiting for the
    engine's next event."""
    engine = await start_zmq_engine("warm")
    prefix = list(range(7000, 7000 + 4 * BLOCK))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{engine.port}") as channel:
        direct = pb_grpc.OpenEngineStub(channel)
        [_ async for _ in direct.Generate(generate_request("before", [*prefix, 1]))]
    fleet = await zmq_fleet([engine])
    try:

        async def held() -> bool:
            return await index_holder(fleet, [*prefix, 2], 4) == fleet.address(engine)

        await eventually(held, WAIT_S)
        route = await fleet.admin.Route(apb.PromptQuery(token_ids=pb.TokenIds(ids=[*prefix, 2])))
        assert (route.reason, route.predicted_cached_tokens) == ("only", 4 * BLOCK)
    finally:
        await close_fleet(fleet)


async def test_openengine_event_lag_is_exported_per_engine_and_dropped_with_it() -> None:
    """SubscribeKvEvents batches carry the engine's timestamp_unix_nanos: the lag of a batch
    stamped after `started` and in the index before the scrape lies between 0 and the time
    elapsed (engine and controller share this machine's clock)."""
    fleet = await make_fleet(2, metrics_listen="127.0.0.1:0")
    try:
        prefix = list(range(2000, 2000 + 4 * BLOCK))
        started = time.time()
        await generate(fleet, generate_request("a", [*prefix, 1]))
        holder = None
        async with asyncio.timeout(WAIT_S):
            while holder is None:
                holder = await index_holder(fleet, [*prefix, 2], 4)
                await asyncio.sleep(0.02)
        text = await scrape(fleet)
        elapsed = time.time() - started
        assert_event_lag_exported(text, holder, elapsed)
        assert f'kvplane_controller_event_lag_seconds_bucket{{engine="{holder}",le="0.01"}}' in text

        await fleet.admin.RemoveEngine(apb.EngineRef(engine=holder))
        text = await scrape(fleet)
        assert sample(text, "kvplane_controller_engine_event_lag_seconds", holder) is None
        assert sample(text, "kvplane_controller_event_lag_seconds_count", holder) is None

        # Back in the fleet (the other engine cordoned, so that it takes the next request):
        # its batches (a snapshot of what it holds, then the new prompt's) are counted again.
        await fleet.admin.RegisterEngine(apb.RegisterEngineRequest(address=holder))
        other = next(a for a in map(fleet.address, fleet.engines) if a != holder)
        await fleet.admin.Cordon(apb.EngineRef(engine=other))
        await fleet.wait_routable(1)
        again = list(range(3000, 3000 + 4 * BLOCK))
        await generate(fleet, generate_request("b", [*again, 1]))

        async def held_again() -> bool:
            return await index_holder(fleet, [*again, 2], 4) == holder

        await eventually(held_again, WAIT_S)
        text = await scrape(fleet)
        batches = sample(text, "kvplane_controller_event_lag_seconds_count", holder)
        assert batches is not None and batches >= 1
    finally:
        await close_fleet(fleet)


class RankedZmqEngine(Forwarding):
    """A sim engine without SubscribeKvEvents whose KV events come from one ZMQ publisher per
    data-parallel rank (as a vLLM engine with data parallelism advertises them)."""

    def __init__(self, inner: pb_grpc.OpenEngineAsyncStub, ranks: list[FakeKvPublisher]) -> None:
        super().__init__(inner)
        self.ranks = ranks

    async def SubscribeKvEvents(
        self, request: pb.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.SubscribeKvEventsResponse]:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no gRPC KV events here")
        yield pb.SubscribeKvEventsResponse()  # unreachable: makes this a stream handler

    async def GetKvEventSources(
        self, request: pb.GetKvEventSourcesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetKvEventSourcesResponse:
        sources = []
        for rank, publisher in enumerate(self.ranks):
            host, port = publisher.endpoint.removeprefix("tcp://").rsplit(":", 1)
            sources.append(
                pb.KvEventSource(
                    transport="zmq",
                    endpoint_addr=pb.KvEndpoint(host=host, port=int(port), protocol="tcp"),
                    replay_endpoint=publisher.replay_endpoint,
                    data_parallel_rank=rank,
                    encoding="msgpack",
                )
            )
        return pb.GetKvEventSourcesResponse(sources=sources)


@contextlib.asynccontextmanager
async def ranked_fleet(
    **controller: Any,
) -> AsyncIterator[tuple[EngineFleet[Any], str, list[FakeKvPublisher]]]:
    """A controller (`controller`: more ControllerConfig fields) in front of one engine
    followed rank by rank (`RankedZmqEngine`, two ranks): the fleet, the engine's address
    and its ranks' publishers, subscribed to."""
    context = zmq.asyncio.Context()
    ranks = [FakeKvPublisher(context), FakeKvPublisher(context)]
    for publisher in ranks:
        publisher.start_replay()
    engine = await start_fronted_engine("ranked", lambda inner: RankedZmqEngine(inner, ranks))
    fleet = await make_fleet(engines=[engine], **controller)
    try:
        for publisher in ranks:
            await publisher.wait_subscribed()
        yield fleet, f"127.0.0.1:{engine.port}", ranks
    finally:
        await close_fleet(fleet)
        for publisher in ranks:
            await publisher.close()
        context.term()


async def publish_on_rank(ranks: list[FakeKvPublisher], rank: int, *events: list[Any]) -> None:
    """One batch of `events` on rank `rank`'s publisher, numbered 0 and stamped now."""
    batch = msgpack.packb([time.time(), list(events), rank])
    await ranks[rank].publish([b"", (0).to_bytes(8, "big"), batch])


async def seen_holding(
    fleet: EngineFleet[Any], prompt: list[int], indexed: dict[str, int]
) -> tuple[apb.EngineMatch, apb.EngineCost]:
    """Once the index holds `indexed` (each rank's worker and its blocks of the prompt, on
    any tier), the one engine's hit of `prompt` as admin `match` shows it, and its cost row
    in admin `route` (which predicts the cached tokens of that row)."""
    index = fleet.app.controller.index
    assert index is not None
    keys = block_keys(prompt, BLOCK)

    async def ranks_indexed() -> bool:
        matches = await index.match_prefix_by_tier(keys, 0)
        return {m.worker_id: m.any_tier_blocks for m in matches} == indexed

    await eventually(ranks_indexed, WAIT_S)
    query = apb.PromptQuery(token_ids=pb.TokenIds(ids=prompt))
    [held] = (await fleet.admin.Match(query)).matches
    route = await fleet.admin.Route(query)
    [row] = route.costs
    assert route.predicted_cached_tokens == row.cached_tokens + row.host_cached_tokens
    return held, row


async def test_an_engine_followed_rank_by_rank_is_routed_by_its_best_rank() -> None:
    """Each rank is a worker of its own in the index (`<address>/dp<r>`); the router sees the
    engine holding what its best rank holds, and removing the engine removes every rank."""
    prefix = list(range(5000, 5000 + 4 * BLOCK))
    async with ranked_fleet() as (fleet, address, ranks):
        stored = ["BlockStored", [11, 12, 13, 14], None, prefix, BLOCK, None, "GPU"]
        await publish_on_rank(ranks, 1, stored)

        async def held() -> bool:
            return await index_holder(fleet, [*prefix, 1], 4) == address

        await eventually(held, WAIT_S)
        index = fleet.app.controller.index
        assert index is not None
        assert f"{address}/dp1" in {w.worker_id for w in (await index.stats()).workers}
        await fleet.admin.RemoveEngine(apb.EngineRef(engine=address))
        assert not [w for w in (await index.stats()).workers if w.worker_id.startswith(address)]


async def test_an_engine_s_best_rank_is_the_one_that_saves_the_most_prefill() -> None:
    """Of an engine's ranks, the router takes the hit worth the most to its policy, not the
    one with the most device blocks: 4 host blocks of the prompt on one rank save `kvplane`
    more prefill (each 1 - host_weight of a block) than 1 device block on the other, so
    admin `match` and `route` show the engine holding the 4 host blocks."""
    prefix = list(range(6000, 6000 + 4 * BLOCK))
    prompt = [*prefix, 1]
    async with ranked_fleet() as (fleet, address, ranks):
        await publish_on_rank(
            ranks, 1, ["BlockStored", [31, 32, 33, 34], None, prefix, BLOCK, None, "CPU"]
        )
        await publish_on_rank(
            ranks, 0, ["BlockStored", [41], None, prefix[:BLOCK], BLOCK, None, "GPU"]
        )
        held, row = await seen_holding(fleet, prompt, {f"{address}/dp0": 1, f"{address}/dp1": 4})
        assert (held.device_blocks, held.host_blocks, held.disk_blocks) == (0, 4, 0)
        assert (row.cached_tokens, row.host_cached_tokens) == (0, 4 * BLOCK)


@pytest.mark.parametrize(
    ("policy", "best", "served"),
    [("kvplane", (3, 0, 0), (3, 0)), ("llmd_longest_prefix", (2, 2, 0), (2, 1))],
)
async def test_an_engine_s_best_rank_is_weighed_on_the_blocks_the_prompt_can_be_served(
    policy: str, best: tuple[int, int, int], served: tuple[int, int]
) -> None:
    """A prompt of exactly 4 blocks is served at most 3 from cache (its last token is always
    computed): rank 0 holding its first 3 blocks on the device saves `kvplane` 3 blocks of
    prefill, rank 1 holding 2 on the device and the next 2 on the host only 2.75 of them (the
    3rd block at 1 - host_weight; the 4th, past the cap, nothing). So admin `match` and
    `route` show the engine holding rank 0's 3 device blocks. Before, the ranks were weighed
    on all their blocks (rank 1's 4th host block too: 3.5), and the route predicted 16 of its
    48 cached tokens loaded from the host. `llmd_longest_prefix` scores every block an
    engine holds (device 1.0, host 0.8: rank 1's 3.6 beats rank 0's 3), the cap or not: the
    engine holds rank 1's hit, the one it would route to (it was seen holding rank 0's
    while every policy's ranks were weighed within the cap), and the route predicts the 3
    cacheable blocks of that hit (2 on the device, 1 on the host)."""
    prefix = list(range(7000, 7000 + 4 * BLOCK))
    async with ranked_fleet(router={"policy": policy}) as (fleet, address, ranks):
        await publish_on_rank(
            ranks, 0, ["BlockStored", [61, 62, 63], None, prefix[: 3 * BLOCK], BLOCK, None, "GPU"]
        )
        await publish_on_rank(
            ranks,
            1,
            ["BlockStored", [71, 72], None, prefix[: 2 * BLOCK], BLOCK, None, "GPU"],
            ["BlockStored", [73, 74], 72, prefix[2 * BLOCK :], BLOCK, None, "CPU"],
        )
        held, row = await seen_holding(fleet, prefix, {f"{address}/dp0": 3, f"{address}/dp1": 4})
        assert (held.device_blocks, held.host_blocks, held.disk_blocks) == best
        device, host = served
        assert (row.cached_tokens, row.host_cached_tokens) == (device * BLOCK, host * BLOCK)


async def test_implausible_event_stamps_are_counted_not_taken_as_lag(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A batch stamped 0 (an engine that stamps nothing, or whose clock was never set) would
    read as ~1.8e9 s of lag, and one stamped an hour ahead as none: both are counted as
    implausible, with one warning for the source naming the engine, and neither reaches the
    lag histogram; the next batch, stamped now, is taken as lag."""
    caplog.set_level("WARNING", logger="controller.fleet")
    context = zmq.asyncio.Context()
    publisher = FakeKvPublisher(context)
    publisher.start_replay()
    engine = await start_fronted_engine(
        "clockless", lambda inner: RankedZmqEngine(inner, [publisher])
    )
    fleet = await make_fleet(engines=[engine], metrics_listen="127.0.0.1:0")
    address = f"127.0.0.1:{engine.port}"
    try:
        await publisher.wait_subscribed()
        started = time.time()
        stamps = (0.0, started + 3600, started)
        for seq, stamp in enumerate(stamps):
            tokens = list(range(8000 + 100 * seq, 8000 + 100 * seq + BLOCK))
            stored = ["BlockStored", [seq + 1], None, tokens, BLOCK, None, "GPU"]
            frames = [b"", seq.to_bytes(8, "big"), msgpack.packb([stamp, [stored], 0])]
            await publisher.publish(frames)

        implausible = "kvplane_controller_event_timestamps_implausible_total"

        def counted(text: str, name: str) -> float:
            return sample(text, name, address) or 0.0

        async def all_counted() -> bool:
            text = await scrape(fleet)
            lags = counted(text, "kvplane_controller_event_lag_seconds_count")
            return lags + counted(text, implausible) == len(stamps)

        await eventually(all_counted, WAIT_S)
        text = await scrape(fleet)
        elapsed = time.time() - started
        assert sample(text, implausible, address) == 2
        assert sample(text, "kvplane_controller_event_lag_seconds_count", address) == 1
        assert_event_lag_exported(text, address, elapsed)
        lag_sum = sample(text, "kvplane_controller_event_lag_seconds_sum", address)
        assert lag_sum is not None and 0.0 <= lag_sum <= elapsed
        warnings = [m for m in caplog.messages if "not taken as event lag" in m]
        assert len(warnings) == 1, warnings
        assert warnings[0].startswith(f"engine {address}: a KV-event batch stamped at unix 0.000")
    finally:
        await close_fleet(fleet)
        await publisher.close()
        context.term()


async def test_zmq_events_of_an_engine_without_get_kv_event_sources_are_none(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    """`kv_events: zmq` on an engine that does not implement GetKvEventSources (UNIMPLEMENTED):
    as one advertising no ZMQ source, it is routed without cache knowledge, with a warning;
    it is not taken for unreachable."""
    engine = await start_fronted_engine("no-sources", Forwarding)
    try:
        address = f"127.0.0.1:{engine.port}"
        register = apb.RegisterEngineRequest(address=address, kv_events="zmq")
        await fleet.admin.RegisterEngine(register)
        await fleet.wait_routable(len(fleet.engines) + 1)
        assert fleet.app.controller.fleet.source_of(address) is None
        assert f"engine {address} advertises no ZMQ KV-event source" in caplog.text
    finally:
        await engine.close()


class WildcardZmqEngine(RankedZmqEngine):
    """A `RankedZmqEngine` that advertises its publisher at the bind wildcard 0.0.0.0, against
    the seed (an endpoint_addr is a connectable host:port)."""

    async def GetKvEventSources(
        self, request: pb.GetKvEventSourcesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetKvEventSourcesResponse:
        response = await super().GetKvEventSources(request, context)
        for source in response.sources:
            source.endpoint_addr.host = "0.0.0.0"
        return response


async def test_zmq_events_advertised_at_a_bind_wildcard_are_not_followed(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    """Dialling 0.0.0.0 would reach whatever publisher listens on that port of the
    controller's own machine (here: the engine's, by chance), so the advert is refused with a
    warning and the engine is routed without cache knowledge."""
    context = zmq.asyncio.Context()
    publisher = FakeKvPublisher(context)
    engine = await start_fronted_engine(
        "wildcard", lambda inner: WildcardZmqEngine(inner, [publisher])
    )
    try:
        address = f"127.0.0.1:{engine.port}"
        register = apb.RegisterEngineRequest(address=address, kv_events="zmq")
        await fleet.admin.RegisterEngine(register)
        await fleet.wait_routable(len(fleet.engines) + 1)
        assert fleet.app.controller.fleet.source_of(address) is None
        assert f"engine {address}: not following its ZMQ source" in caplog.text
        assert "bind wildcard" in caplog.text
    finally:
        await engine.close()
        await publisher.close()
        context.term()


class NamedZmqEngine(RankedZmqEngine):
    """A `RankedZmqEngine` with one rank that calls itself `engine_name` in GetEngineInfo (as
    a vLLM engine, whose KV events come from its one ZMQ publisher)."""

    def __init__(
        self, inner: pb_grpc.OpenEngineAsyncStub, engine_name: str, publisher: FakeKvPublisher
    ) -> None:
        super().__init__(inner, [publisher])
        self.engine_name = engine_name

    async def GetEngineInfo(
        self, request: pb.GetEngineInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.EngineInfo:
        info = await self.inner.GetEngineInfo(request)
        info.engine_name = self.engine_name
        return info


@dataclass(frozen=True)
class HybridCase:
    form: EventForm
    engine_name: str
    entry: dict[str, str]  # the engine entry's options besides its address
    groups_read: bool


# Each engine publishes the hybrid model's stream; the first, as maps, is the reference.
HYBRID_CASES = {
    "maps": HybridCase("map", "kvplane", {"kv_events": "zmq"}, True),
    "configured vllm": HybridCase(
        "array", "kvplane", {"kv_events": "zmq", "array_tail": "vllm"}, True
    ),
    "named vllm": HybridCase("array", "vllm", {"kv_events": "zmq"}, True),
    "named vLLM, grpc fallback": HybridCase("array", "vLLM", {}, True),
    "named vllm, configured ignore": HybridCase(
        "array", "vllm", {"kv_events": "zmq", "array_tail": "ignore"}, False
    ),
    "named sglang": HybridCase("array", "sglang", {"kv_events": "zmq"}, False),
}


async def test_array_events_keep_a_hybrid_models_groups_when_entry_or_engine_says_vllm() -> None:
    """The array form's group fields (past index 7) are read as vLLM's when the engine entry
    says `array_tail: vllm`, or, unset, when GetEngineInfo names the engine vllm (a vLLM
    engine's ZMQ publisher is vLLM's own); then the index holds what the map form gives.
    Otherwise they are ignored: both groups' stores read as group 0's (no component masks),
    and the sliding-window eviction finds nothing of block 2 there to remove."""
    context = zmq.asyncio.Context()
    publishers = {name: FakeKvPublisher(context) for name in HYBRID_CASES}
    for publisher in publishers.values():
        publisher.start_replay()  # advertised: the sources ask it at start (empty then)
    engines = {
        name: await start_fronted_engine(
            f"hybrid-{i}",
            partial(NamedZmqEngine, engine_name=case.engine_name, publisher=publishers[name]),
        )
        for i, (name, case) in enumerate(HYBRID_CASES.items())
    }
    address = {name: f"127.0.0.1:{engine.port}" for name, engine in engines.items()}
    config = ControllerConfig.model_validate(
        {
            "listen": "127.0.0.1:0",
            "engines": [{"address": address[n], **c.entry} for n, c in HYBRID_CASES.items()],
            "health": {"poll_interval_s": 0.2, "backoff_initial_s": 0.1, "backoff_max_s": 1.0},
            "shutdown_grace_s": 0.5,
        }
    )
    app = await start_controller(config)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{app.port}")
    fleet = EngineFleet(list(engines.values()), app, channel)
    try:
        await fleet.wait_routable(len(engines))
        index = app.controller.index
        assert isinstance(index, MemoryBackend)
        for name, publisher in publishers.items():
            await publisher.wait_subscribed()
            await publisher.send(
                [b"", (0).to_bytes(8, "big"), hybrid_payload(HYBRID_CASES[name].form)]
            )
        masks: dict[str, dict[int, int]] = {}
        for name in HYBRID_CASES:
            source = app.controller.fleet.source_of(address[name])
            if isinstance(source, OpenEngineSource):  # following the advertised ZMQ source
                (source,) = source.zmq_sources
            assert isinstance(source, ZmqSource)

            def first_read(source: ZmqSource = source) -> bool:
                return source.last_seq == 0

            await source.wait_until(first_read, WAIT_S)
            masks[name] = {p.key: p.component_mask for p in index.index.placements(address[name])}
    finally:
        await close_fleet(fleet)
        for publisher in publishers.values():
            await publisher.close()
        context.term()
    full, swa = Component.FULL, Component.SWA
    key_1, key_2, key_3 = block_keys(list(HYBRID_TOKEN_IDS), HYBRID_BLOCK_SIZE)
    assert masks["maps"] == {key_1: full | swa, key_2: full, key_3: full | swa}
    for name, case in HYBRID_CASES.items():
        plain = {key_1: 0, key_2: 0, key_3: 0}
        assert masks[name] == (masks["maps"] if case.groups_read else plain), name


def test_an_engine_entrys_unknown_array_tail_is_a_one_line_config_error(tmp_path: Path) -> None:
    path = tmp_path / "controller.yaml"
    path.write_text("engines:\n  - {address: 127.0.0.1:9001, kv_events: zmq, array_tail: VLLM}\n")
    with pytest.raises(ConfigError) as raised:
        load_config(ControllerConfig, path)
    assert str(raised.value) == (
        f"invalid config in {path}: engines.0.array_tail: Input should be 'ignore' or 'vllm'"
    )


class _EventsOnMedium(Forwarding):
    """The sim engine's KV events as if its blocks lived on `medium` (an engine offloading
    its prefix cache to host memory or to disk says so in each event)."""

    medium: int = pb.STORAGE_MEDIUM_GPU

    async def SubscribeKvEvents(
        self, request: pb.SubscribeKvEventsRequest, context: Any
    ) -> AsyncIterator[pb.SubscribeKvEventsResponse]:
        async for reply in self.inner.SubscribeKvEvents(request):
            for event in reply.batch.events:
                if event.HasField("block_stored"):
                    event.block_stored.medium = self.medium  # type: ignore[assignment]
                elif event.HasField("block_removed"):
                    event.block_removed.medium = self.medium  # type: ignore[assignment]
            yield reply


class _OnHost(_EventsOnMedium):
    medium = pb.STORAGE_MEDIUM_CPU_PINNED


class _OnDisk(_EventsOnMedium):
    medium = pb.STORAGE_MEDIUM_DISK


async def warmed_fleet(
    warm: dict[str, ServedEngine], prompt: list[int]
) -> tuple[EngineFleet[ServedEngine], apb.PromptQuery]:
    """A controller over the `warm` engines and a cold one (`pending_ttl_s` 0: no claim of
    the router's on a prompt), once each warm engine computed `prompt` (sent to it directly)
    and the index holds it there, whatever the tier; and the query for it plus one token."""
    engines = engines_of_kinds(*warm.values(), await start_sim_engine("cold"))
    fleet = await make_fleet(engines=engines, router={"pending_ttl_s": 0})
    try:
        for name, engine in warm.items():
            async with grpc.aio.insecure_channel(fleet.address(engine)) as channel:
                stub = pb_grpc.OpenEngineStub(channel)
                async for _ in stub.Generate(generate_request(f"warm-{name}", prompt)):
                    pass
        index = fleet.app.controller.fleet.index
        assert index is not None

        async def indexed() -> bool:
            stats = await index.stats()
            held = {w.worker_id for w in stats.workers if w.num_blocks >= len(prompt) // BLOCK}
            return held >= {fleet.address(e) for e in warm.values()}

        await eventually(indexed, WAIT_S)
    except BaseException:
        await close_fleet(fleet)
        raise
    return fleet, apb.PromptQuery(token_ids=pb.TokenIds(ids=[*prompt, 1]))


async def test_a_prefix_on_the_host_tier_is_discounted_and_one_on_disk_more() -> None:
    """What an operator reads in admin `route` for engines whose KV events carry a medium:
    a prefix held in host memory (CPU_PINNED -> DRAM) is HOST cached, its prefill cost
    `host_weight` (0.25) of recomputing it; one held on disk (DISK -> SSD) is DISK cached,
    at `disk_weight` (0.75); the host engine wins. Each prefix is computed by sending it to
    its engine directly (no claim of the router's on it: `pending_ttl_s` 0)."""
    on_host = await start_fronted_engine("host", _OnHost)
    on_disk = await start_fronted_engine("disk", _OnDisk)
    prompt = list(range(500, 500 + 20 * BLOCK))
    fleet, query = await warmed_fleet({"host": on_host, "disk": on_disk}, prompt)
    try:
        route = await fleet.admin.Route(query)
        rows = {c.instance_id: c for c in route.costs}
        cached = {n: (r.cached_tokens, r.host_cached_tokens, r.disk_cached_tokens)
                  for n, r in rows.items()}  # fmt: skip
        assert cached == {"host": (0, 20 * BLOCK, 0), "disk": (0, 0, 20 * BLOCK), "cold": (0, 0, 0)}
        # overlap x (1 uncached + 0.25 (0.75) x 320 on the host (disk)) against overlap x 321
        uncached = rows["cold"].prefill_cost / (20 * BLOCK + 1)
        assert rows["host"].prefill_cost == pytest.approx(uncached * (1 + 0.25 * 20 * BLOCK))
        assert rows["disk"].prefill_cost == pytest.approx(uncached * (1 + 0.75 * 20 * BLOCK))
        assert (route.instance_id, route.reason) == ("host", "cache")
        assert route.predicted_cached_tokens == 20 * BLOCK
    finally:
        await close_fleet(fleet)


async def test_an_engine_holding_a_prefix_on_disk_wins_over_a_cold_one_not_over_the_gpu(
    tmp_path: Path,
) -> None:
    """Engines whose OpenEngine KV events say DISK (vLLM offloading its prefix cache to
    disk): the controller indexes their blocks at the SSD tier and its router counts them
    as cached at a discount. A prompt they hold goes to such an engine rather than to a cold
    one, and to an engine holding it on the GPU rather than to either; admin `match` shows
    the blocks on disk."""
    on_disk = await start_fronted_engine("disk", _OnDisk)
    on_gpu = await start_sim_engine("gpu")
    prompt = list(range(900, 900 + 12 * BLOCK))
    fleet, query = await warmed_fleet({"disk": on_disk, "gpu": on_gpu}, prompt)
    try:
        match = await fleet.admin.Match(query)
        held = {m.instance_id: (m.device_blocks, m.host_blocks, m.disk_blocks, m.cached_tokens)
                for m in match.matches}  # fmt: skip
        assert held == {
            "disk": (0, 0, 12, 12 * BLOCK),
            "gpu": (12, 0, 0, 12 * BLOCK),
            "cold": (0, 0, 0, 0),
        }
        # The operator's view: `kvplane admin match` and `route` tables.
        tokens = tmp_path / "tokens.txt"
        tokens.write_text(" ".join(str(t) for t in [*prompt, 1]))
        target = ("--tokens-file", str(tokens), "--target", fleet.target)
        table = await asyncio.to_thread(CliRunner().invoke, app, ["admin", "match", *target])
        assert table.exit_code == 0, table.output
        _, header, *rows = table.stdout.splitlines()
        assert header.split() == [
            *("ENGINE", "ADDRESS", "DEVICE", "BLOCKS", "HOST", "BLOCKS"),
            *("DISK", "BLOCKS", "CACHED", "TOKENS"),
        ]
        by_engine = {row.split()[0]: row.split()[2:] for row in rows}
        assert by_engine["disk"] == ["0", "0", "12", str(12 * BLOCK)]
        table = await asyncio.to_thread(CliRunner().invoke, app, ["admin", "route", *target])
        assert table.exit_code == 0, table.output
        _, header, *rows = table.stdout.splitlines()
        assert header.split()[:4] == ["ENGINE", "CACHED", "HOST", "DISK"]
        by_engine = {row.split()[0]: row.split()[1:4] for row in rows}
        assert by_engine["disk"] == ["0", "0", str(12 * BLOCK)]
        route = await fleet.admin.Route(query)
        assert (route.instance_id, route.reason) == ("gpu", "cache")
        await fleet.admin.Cordon(apb.EngineRef(engine=fleet.address(on_gpu)))
        route = await fleet.admin.Route(query)
        assert (route.instance_id, route.reason) == ("disk", "cache")
        assert route.predicted_cached_tokens == 12 * BLOCK
        # A request through the gateway goes there too (its `kvplane-route` says so).
        call = fleet.gateway.Generate(generate_request("q", [*prompt, 1]))
        replies = [r async for r in call]
        assert replies[-1].WhichOneof("event") == "finished"
        served = read_route(await call.trailing_metadata())
        assert served is not None
        assert (served["instance_id"], served["predicted_cached_tokens"]) == ("disk", 12 * BLOCK)
    finally:
        await close_fleet(fleet)
