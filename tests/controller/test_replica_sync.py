"""Controller replicas that tell each other what they route (`router.replica_sync`): in the
trace replay, replicas in sync decide as one controller does; over a real redis-server, a
replica learns its peers' requests, their first tokens and ends, catches up when it joins
late or after Redis restarts, and releases the requests of a peer killed with SIGKILL; a
session routed through one replica goes to the same engine through the others, one started
after the session's requests ended included."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import os
import random
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from controller.config import ControllerConfig
from controller.metrics import ControllerMetrics
from controller.registry import Registry
from controller.replay import ReplaySettings, replay
from controller.replica_sync import CHANNEL, ReplicaSync
from controller.route_report import read_route
from controller.router import Candidate, Decision, Reason, Router, RouteRequest, make_policy
from controller.router.replicas import PeerRoutes, RouteEvent
from engine.core.mooncake_trace import load_trace
from indexer.redis_client import RedisOptions, connect
from kvplane_api.v1 import admin_pb2 as apb
from kvplane_api.v1 import admin_pb2_grpc as apb_grpc
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import Fleet, close_fleet, generate_request, make_fleet
from tests.controller.test_gateway import generate
from tests.controller.test_processes import (
    _routable,
    controller_process,
    sim_engine_process,
)
from tests.polling import eventually
from tests.redis_servers import RedisClusterNodes, RedisServer
from tests.tcp_forwarder import TcpForwarder

pytestmark = pytest.mark.timeout(120)
WAIT_S = 20.0
ROOT = Path(__file__).resolve().parents[2]


def _bursty_trace(path: Path) -> Path:
    """Bursts of eight distinct prompts arriving together: where a router that does not see
    the others' requests piles them onto the engines that looked idle."""
    rows = []
    for i in range(64):
        rows.append(
            {
                "timestamp": (i // 8) * 400,
                "input_length": 3 * 512 + 50,
                "output_length": 30,
                "hash_ids": [10_000 * i + b for b in range(4)],
            }
        )
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_replicas_in_sync_route_as_one_controller(tmp_path: Path) -> None:
    trace = load_trace(_bursty_trace(tmp_path / "bursts.jsonl"))
    settings = ReplaySettings(workers=4, blocks_per_worker=256)
    alone = replay(trace, "kvplane", settings)
    apart = replay(
        trace, "kvplane", ReplaySettings(workers=4, blocks_per_worker=256, router_replicas=4)
    )
    synced = replay(
        trace,
        "kvplane",
        ReplaySettings(workers=4, blocks_per_worker=256, router_replicas=4, replica_sync=True),
    )
    assert synced.to_json() == alone.to_json()
    assert apart.ttft_ms["mean"] > alone.ttft_ms["mean"]


def test_an_engine_a_replica_forgets_is_released_on_its_peers() -> None:
    """An engine that left the fleet takes its requests out of the router's accounting: its
    peers release them too, and its snapshots no longer carry them."""
    a, b = _router(), _router()
    peer = PeerRoutes(b)
    a.publish_to(lambda event: peer.apply("a", event, 0.0))
    engine = _route(a, "r1")
    assert _requests(b) == {engine: (1, 1)}
    a.forget_engine(engine)
    assert _requests(b) == {}
    assert a.own_routes() == []
    a.finish("r1")  # the relay still ends the request: nothing more to say
    assert _requests(b) == {}


def test_a_streamed_request_publishes_its_first_token_once() -> None:
    """The relay reports a first token with every streamed chunk that has output: peers are
    told of it once, not once per chunk (each event is packed, published on the channel and
    decoded and applied by every peer); a new route of the request (its decode hop) has a
    first token of its own."""
    a = _router()
    events: list[RouteEvent] = []
    a.publish_to(events.append)
    engine = _route(a, "r1")
    for _ in range(3):
        a.first_token("r1")
    a.route_decode(_request("r1"), [Candidate(engine)], random.Random(0))
    for _ in range(3):
        a.first_token("r1")
    a.finish("r1")
    assert [type(e).__name__ for e in events] == [
        "Routed",
        "FirstToken",
        "Routed",
        "FirstToken",
        "Finished",
    ]


def test_a_session_routed_through_one_replica_sticks_to_its_engine_on_the_others() -> None:
    """A balancer that does not keep a session on one replica: its next request, through
    another replica, goes to the engine that holds its prefix, not where that replica's
    policy would send a new prompt (away from the engine its peer's request loads), and a
    replica that joins later learns the session from the snapshot."""
    a, b = _router(), _router()
    peer = PeerRoutes(b)
    a.publish_to(lambda event: peer.apply("a", event, 0.0))
    b.publish_to(lambda _: None)
    engine = _route_session(a, "r1", "chat").engine_id
    assert _route(b, "r2") != engine  # a new prompt: away from the engine a's request loads
    second = _route_session(b, "r3", "chat")
    assert (second.engine_id, second.reason) == (engine, Reason.SESSION)
    late = _router()
    PeerRoutes(late).replace("b", b.own_routes(), 0.0)
    third = _route_session(late, "r4", "chat")
    assert (third.engine_id, third.reason) == (engine, Reason.SESSION)


def test_replica_sync_needs_a_redis_index() -> None:
    with pytest.raises(ValueError, match="replica_sync needs the replicas' shared index on Redis"):
        ControllerConfig.model_validate({"router": {"replica_sync": True}})
    config = ControllerConfig.model_validate(
        {"index": {"backend": "redis://127.0.0.1:6379/0"}, "router": {"replica_sync": True}}
    )
    assert config.router.replica_sync
    with pytest.raises(ValueError, match="replica_timeout_s must be longer"):
        ControllerConfig.model_validate(
            {
                "index": {"backend": "redis://127.0.0.1:6379/0"},
                "router": {"replica_sync": True, "replica_heartbeat_s": 2, "replica_timeout_s": 1},
            }
        )


def _router() -> Router:
    return Router(make_policy("kvplane"))


def _request(request_id: str, session: str | None = None) -> RouteRequest:
    """A prompt of 2,000 tokens of its own (no block shared with another request's)."""
    base = 1_000 * int(request_id.removeprefix("r"))
    return RouteRequest(request_id, 2_000, 16, tuple(range(base, base + 125)), session_key=session)


def _route(router: Router, request_id: str) -> str:
    return _route_session(router, request_id, None).engine_id


def _route_session(router: Router, request_id: str, session: str | None) -> Decision:
    candidates = [Candidate(e) for e in ("e1", "e2", "e3")]
    return router.route(_request(request_id, session), candidates, random.Random(0), 0.0)


def _requests(router: Router) -> dict[str, tuple[int, int]]:
    """Per engine: (requests in flight, of them prefilling), as the router charges them."""
    out = {}
    for engine in ("e1", "e2", "e3"):
        inflight = router.inflight.of(engine)
        if inflight.requests:
            out[engine] = (inflight.requests, inflight.prefilling)
    return out


class _Replicas:
    def __init__(self, url: str, timeout_s: float = 1.0) -> None:
        self.url = url
        self.timeout_s = timeout_s  # Redis's, per command
        self.syncs: list[ReplicaSync] = []

    async def start(self, name: str) -> ReplicaSync:
        client, _ = connect(self.url, RedisOptions(timeout_s=self.timeout_s))
        sync = ReplicaSync(
            _router(),
            client,
            RedisOptions().partition_key(CHANNEL),
            name,
            heartbeat_s=0.1,
            timeout_s=1.0,
            owns_client=True,
        )
        await sync.start()
        self.syncs.append(sync)
        return sync

    async def close(self) -> None:
        for sync in self.syncs:
            await sync.close()


@pytest.fixture
async def replicas(redis: RedisServer) -> AsyncIterator[_Replicas]:
    group = _Replicas(redis.url)
    yield group
    await group.close()


async def test_a_replica_charges_what_its_peer_routes_until_it_ends(replicas: _Replicas) -> None:
    a = await replicas.start("a")
    b = await replicas.start("b")
    await eventually(lambda: _ready(a, b), WAIT_S, "peers")
    engine = _route(a.router, "r1")
    await eventually(lambda: _requests(b.router) == {engine: (1, 1)}, WAIT_S, "the peer's request")
    a.router.first_token("r1")
    await eventually(lambda: _requests(b.router) == {engine: (1, 0)}, WAIT_S, "its first token")
    a.router.finish("r1")
    await eventually(lambda: _requests(b.router) == {}, WAIT_S, "its end")
    # A second request from b avoids the engine a now loads.
    first = _route(a.router, "r2")
    await eventually(lambda: _requests(b.router) == {first: (1, 1)}, WAIT_S, "the peer's request")
    assert _route(b.router, "r3") != first
    await eventually(
        lambda: sum(n for n, _ in _requests(a.router).values()) == 2, WAIT_S, "b's request"
    )


async def test_two_replicas_requests_of_one_id_are_two_requests(replicas: _Replicas) -> None:
    """Request ids are each replica's own (a client's, a gateway's counter): a peer's request
    that has the id of one of this replica's is charged beside it, not in its place, and each
    is released when its own replica ends it."""
    a = await replicas.start("a")
    b = await replicas.start("b")
    await eventually(lambda: _ready(a, b), WAIT_S, "peers")
    first = _route(a.router, "r1")
    await eventually(lambda: _requests(b.router) == {first: (1, 1)}, WAIT_S, "a's request")
    second = _route(b.router, "r1")
    both = {first: (2, 2)} if second == first else {first: (1, 1), second: (1, 1)}
    await eventually(
        lambda: _requests(a.router) == _requests(b.router) == both, WAIT_S, "both requests"
    )
    a.router.finish("r1")
    left = {second: (1, 1)}
    await eventually(
        lambda: _requests(a.router) == _requests(b.router) == left, WAIT_S, "b's request left"
    )


async def test_a_replica_that_stops_has_its_requests_released_at_once(
    replicas: _Replicas,
) -> None:
    """A replica that stops (scaled down, rolled) says bye: its peers release its requests in
    flight at once, not after `replica_timeout_s` of silence (here far longer than the test)."""
    a = await replicas.start("a")
    b = await replicas.start("b")
    for sync in (a, b):
        sync.timeout_s = 3600.0
    await eventually(lambda: _ready(a, b), WAIT_S, "peers")
    engine = _route(a.router, "r1")
    await eventually(lambda: _requests(b.router) == {engine: (1, 1)}, WAIT_S, "a's request")
    await a.close()
    await eventually(lambda: _requests(b.router) == {}, WAIT_S, "a's request released")
    assert "a" not in b.protocol.heard


async def test_a_session_follows_its_engine_through_every_replica(replicas: _Replicas) -> None:
    """Over Redis: a session routed by one replica is routed to the same engine by its peer,
    and by a replica that joins once the session's first request ended on the one that
    routed it (the peer's request of the session is still in flight: its snapshot)."""
    a = await replicas.start("a")
    b = await replicas.start("b")
    await eventually(lambda: _ready(a, b), WAIT_S, "peers")
    engine = _route_session(a.router, "r1", "chat").engine_id
    await eventually(lambda: _requests(b.router) == {engine: (1, 1)}, WAIT_S, "the peer's request")
    second = _route_session(b.router, "r2", "chat")
    assert (second.engine_id, second.reason) == (engine, Reason.SESSION)
    a.router.finish("r1")
    late = await replicas.start("late")
    await eventually(lambda: _requests(late.router) == {engine: (1, 1)}, WAIT_S, "the snapshot")
    third = _route_session(late.router, "r3", "chat")
    assert (third.engine_id, third.reason) == (engine, Reason.SESSION)


def _ready(a: ReplicaSync, b: ReplicaSync) -> bool:
    """Both subscribed: each has heard the other (a beat, a hello or a snapshot)."""
    return "a" in b.protocol.heard and "b" in a.protocol.heard


async def test_a_replica_that_joins_late_learns_what_its_peers_have_in_flight(
    replicas: _Replicas,
) -> None:
    a = await replicas.start("a")
    engine = _route(a.router, "r1")
    a.router.first_token("r1")
    late = await replicas.start("late")
    await eventually(lambda: _requests(late.router) == {engine: (1, 0)}, WAIT_S, "the snapshot")
    a.router.finish("r1")
    await eventually(lambda: _requests(late.router) == {}, WAIT_S, "its end")


async def test_a_replica_publishes_its_messages_in_the_order_of_their_numbers(
    redis: RedisServer,
) -> None:
    """A replica's answer to a joining peer's hello (its snapshot) and the messages it numbers
    after it reach Redis in that order, even when the answer's connection is slow: the new
    peer finds no gap. Before, the events and beats went ahead on another pooled connection
    while the snapshot waited, and a replica joining peers that routed counted gaps, each
    answered by another snapshot (four at a live join under load; the metric an operator
    alerts on for lost messages)."""
    forwarder = await TcpForwarder.start(f"127.0.0.1:{redis.port}")
    through = _Replicas(forwarder.endpoint.replace("tcp://", "redis://"), timeout_s=30.0)
    direct = _Replicas(redis.url)
    try:
        a = await through.start("a")
        forwarder.hold_requests(b"snapshot")  # a's answers to the hello below wait
        late = await direct.start("late")
        await forwarder.held.wait()
        engine = _route(a.router, "r1")  # numbered after the snapshot
        with contextlib.suppress(AssertionError):  # before: it reached late first
            await eventually(lambda: _requests(late.router) != {}, 1.0, "a's request")
        forwarder.let_through()
        await eventually(lambda: _requests(late.router) == {engine: (1, 1)}, WAIT_S, "r1")
        await eventually(lambda: "a" in late.protocol.heard, WAIT_S, "a's beats")
        assert late.protocol.num_gaps == 0
    finally:
        await direct.close()
        await through.close()
        await forwarder.cut()


async def test_a_redis_restart_loses_nothing_for_long(
    redis: RedisServer, replicas: _Replicas, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="controller.replica_sync")
    a = await replicas.start("a")
    b = await replicas.start("b")
    await eventually(lambda: _ready(a, b), WAIT_S, "peers")
    before = _route(a.router, "r1")
    await eventually(lambda: _requests(b.router) == {before: (1, 1)}, WAIT_S, "the peer's request")
    redis.kill()
    during = _route(a.router, "r2")  # published into the void
    a.router.finish("r1")
    await asyncio.sleep(2.0)  # down long enough for several tries to reconnect
    redis.start()
    assert during != before
    await eventually(
        lambda: _requests(b.router) == {during: (1, 1)}, WAIT_S, "the snapshot after the restart"
    )
    # One warning per replica for the outage, however many tries failed, and one line back.
    said = [r.getMessage() for r in caplog.records]
    assert sum("lost the channel" in m for m in said) == 2, said
    await eventually(
        lambda: sum("back on the channel" in r.getMessage() for r in caplog.records) == 2,
        WAIT_S,
        "both replicas back",
    )


async def test_metrics_say_whether_a_replica_hears_its_peers(
    redis: RedisServer, replicas: _Replicas
) -> None:
    """What an operator reads on /metrics: b is on the channel, hears a and accounts its
    request; while Redis is down b is off the channel and hears nobody; back after it."""
    a = await replicas.start("a")
    b = await replicas.start("b")
    metrics = ControllerMetrics(Registry())
    metrics.watch_replica_sync(b)

    def sample(name: str) -> float | None:
        return metrics.registry.get_sample_value(name)

    await eventually(lambda: _ready(a, b), WAIT_S, "peers")
    engine = _route(a.router, "r1")
    await eventually(lambda: _requests(b.router) == {engine: (1, 1)}, WAIT_S, "the peer's request")
    assert sample("kvplane_controller_replica_sync_subscribed") == 1
    assert sample("kvplane_controller_replica_peers") == 1
    assert sample("kvplane_controller_replica_peer_requests") == 1
    assert sample("kvplane_controller_replica_sync_gaps_total") == 0
    redis.kill()
    await eventually(
        lambda: sample("kvplane_controller_replica_sync_subscribed") == 0, WAIT_S, "off"
    )
    assert sample("kvplane_controller_replica_peers") == 0
    assert sample("kvplane_controller_replica_peer_requests") == 0
    redis.start()
    await eventually(lambda: sample("kvplane_controller_replica_peers") == 1, WAIT_S, "back")
    assert sample("kvplane_controller_replica_sync_subscribed") == 1
    await eventually(
        lambda: sample("kvplane_controller_replica_peer_requests") == 1, WAIT_S, "the snapshot"
    )


async def test_peer_requests_metric_counts_the_peers_requests_in_flight(
    replicas: _Replicas,
) -> None:
    """The peers' requests in flight on /metrics go down as they end (not only when their
    replica leaves)."""
    a = await replicas.start("a")
    b = await replicas.start("b")
    metrics = ControllerMetrics(Registry())
    metrics.watch_replica_sync(b)

    def peer_requests() -> float | None:
        return metrics.registry.get_sample_value("kvplane_controller_replica_peer_requests")

    await eventually(lambda: _ready(a, b), WAIT_S, "peers")
    _route(a.router, "r1")
    _route(a.router, "r2")
    await eventually(lambda: peer_requests() == 2, WAIT_S, "a's two requests")
    a.router.finish("r1")
    await eventually(lambda: sum(n for n, _ in _requests(b.router).values()) == 1, WAIT_S, "end")
    assert peer_requests() == 1


_KILLED_REPLICA = """
import asyncio, random, sys
from controller.replica_sync import CHANNEL, ReplicaSync
from controller.router import Candidate, Router, RouteRequest, make_policy
from indexer.redis_client import RedisOptions, connect

async def main():
    client, _ = connect(sys.argv[1], RedisOptions())
    router = Router(make_policy("kvplane"))
    sync = ReplicaSync(router, client, RedisOptions().partition_key(CHANNEL), "doomed",
                       heartbeat_s=0.1, timeout_s=1.0)
    await sync.start()
    await asyncio.sleep(0.5)
    request = RouteRequest("r1", 2000, 16, tuple(range(1, 126)))
    router.route(request, [Candidate("e1")], random.Random(0), 0.0)
    print("routed", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_a_killed_replica_has_its_requests_released(
    redis: RedisServer, replicas: _Replicas
) -> None:
    survivor = await replicas.start("survivor")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'proto'}"}
    doomed = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _KILLED_REPLICA, redis.url, env=env
    )
    try:
        await eventually(
            lambda: _requests(survivor.router) == {"e1": (1, 1)}, WAIT_S, "the doomed's request"
        )
        doomed.send_signal(signal.SIGKILL)  # no bye
        await doomed.wait()
        await eventually(lambda: _requests(survivor.router) == {}, WAIT_S, "its requests released")
        assert survivor.peers.origins == []
    finally:
        if doomed.returncode is None:
            doomed.kill()
            await doomed.wait()


@pytest.mark.timeout(180)
async def test_controller_processes_in_sync_see_each_others_requests(
    tmp_path: Path, redis: RedisServer, processes: list[subprocess.Popen[bytes]]
) -> None:
    """Two `kvplane controller serve` replicas with `replica_sync` in front of the same sim
    engines: a stream routed by one shows in the other's `admin workers` while it runs, and
    not after it ends."""
    engines = [
        await asyncio.to_thread(sim_engine_process, tmp_path, processes, f"e{i}") for i in range(2)
    ]
    settings = f"index: {{backend: '{redis.url}'}}\nrouter: {{replica_sync: true}}\n"
    targets = []
    for name in ("a", "b"):
        _, target = await asyncio.to_thread(
            controller_process, tmp_path, name, "127.0.0.1:0", processes, engines, settings=settings
        )
        targets.append(target)
    async with (
        grpc.aio.insecure_channel(targets[0]) as to_a,
        grpc.aio.insecure_channel(targets[1]) as to_b,
    ):
        a, b = apb_grpc.AdminStub(to_a), apb_grpc.AdminStub(to_b)
        await eventually(lambda: _routable(a, 2), WAIT_S, "a routes to both engines")
        await eventually(lambda: _routable(b, 2), WAIT_S, "b too")
        stream = pb_grpc.OpenEngineStub(to_a).Generate(
            generate_request("long", list(range(1, 200)), max_tokens=100_000)
        )
        await anext(aiter(stream))
        routed_by_a = await _in_flight(a)
        assert list(routed_by_a.values()) == [1]
        seen: dict[str, int] = {}

        async def seen_by_b() -> bool:
            seen.update(await _in_flight(b))
            return bool(seen)

        await eventually(seen_by_b, WAIT_S, "a's request seen by b")
        assert seen == routed_by_a
        stream.cancel()

        async def none_seen_by_b() -> bool:
            return not await _in_flight(b)

        await eventually(none_seen_by_b, WAIT_S, "the end of a's stream seen by b")


@pytest.mark.timeout(180)
async def test_a_replica_that_joins_keeps_its_peers_requests_past_its_first_contact(
    tmp_path: Path, redis: RedisServer, processes: list[subprocess.Popen[bytes]]
) -> None:
    """A stream routed by replica a runs on an engine that stops answering (SIGSTOP) before
    replica b starts: b learns a's request from a's snapshot before it has ever reached the
    engine. Once the engine answers again and b meets it for the first time, b still charges
    the engine with a's request (`admin workers`). (b's first contact forgot the engine as a
    restart does, and with it the request its peer's snapshot had brought: b saw the engine
    idle until the request ended.)"""
    engine = await asyncio.to_thread(sim_engine_process, tmp_path, processes, "e0")
    frozen = processes[-1]
    settings = f"index: {{backend: '{redis.url}'}}\nrouter: {{replica_sync: true}}\n"
    _, target_a = await asyncio.to_thread(
        controller_process, tmp_path, "a", "127.0.0.1:0", processes, [engine], settings=settings
    )
    async with grpc.aio.insecure_channel(target_a) as to_a:
        a = apb_grpc.AdminStub(to_a)
        await eventually(lambda: _routable(a, 1), WAIT_S, "a routes to the engine")
        stream = pb_grpc.OpenEngineStub(to_a).Generate(
            generate_request("long", list(range(1, 200)), max_tokens=100_000)
        )
        await anext(aiter(stream))
        assert await _in_flight(a) == {engine: 1}
        try:
            async with _replica_joining_while_frozen(
                tmp_path,
                processes,
                [engine],
                [frozen],
                settings=settings,
                peers_in_flight={engine: 1},
            ) as to_b:
                b = apb_grpc.AdminStub(to_b)
                assert await _in_flight(a) == {engine: 1}  # the request still runs
                assert await _in_flight(b) == {engine: 1}
                stream.cancel()

                async def none_seen_by_b() -> bool:
                    return not await _in_flight(b)

                await eventually(none_seen_by_b, WAIT_S, "the end of a's stream seen by b")
        finally:
            stream.cancel()


async def test_a_replica_that_joins_keeps_its_peers_sessions_past_its_first_contact(
    tmp_path: Path, redis: RedisServer, processes: list[subprocess.Popen[bytes]]
) -> None:
    """A chat's first turn, through replica a, ends on one of two engines; both then stop
    answering (SIGSTOP) before replica b starts, so b learns the chat's session from a's
    snapshot before it has ever reached either engine. Once they answer again and b has met
    both, the chat's next turn through b goes to the engine of its first turn (`kvplane-route`
    reason `session`) and reuses its cached prefix there, though b's round robin alone would
    send it to the other engine. (b's first contact forgot each engine as a restart does, and
    with it the session its peer's snapshot had brought: the turn went to the other engine and
    computed its whole prompt again.)"""
    engines = [
        await asyncio.to_thread(sim_engine_process, tmp_path, processes, f"e{i}") for i in range(2)
    ]
    frozen = processes[-2:]
    router = "{replica_sync: true, policy: round_robin, session_metadata_key: session}"
    settings = f"index: {{backend: '{redis.url}'}}\nrouter: {router}\n"
    _, target_a = await asyncio.to_thread(
        controller_process, tmp_path, "a", "127.0.0.1:0", processes, engines, settings=settings
    )
    async with grpc.aio.insecure_channel(target_a) as to_a:
        a = apb_grpc.AdminStub(to_a)
        gateway_a = pb_grpc.OpenEngineStub(to_a)
        await eventually(lambda: _routable(a, 2), WAIT_S, "a routes to both engines")
        await _generate_routed(gateway_a, generate_request("plain", [9] * 40))  # a's turns
        first_turn = [5] * 64
        _, first = await _generate_routed(
            gateway_a, generate_request("turn1", first_turn, session="chat")
        )
        # A stream on the other engine, still running when b joins: its charge marks a's
        # snapshot (which brings the session with it) heard by b.
        stream = gateway_a.Generate(
            generate_request("long", list(range(1, 200)), max_tokens=100_000)
        )
        await anext(aiter(stream))
        (marked,) = await _in_flight(a)
        assert marked != first["engine"]
        try:
            async with _replica_joining_while_frozen(
                tmp_path, processes, engines, frozen, settings=settings, peers_in_flight={marked: 1}
            ) as to_b:
                reply, second = await _generate_routed(
                    pb_grpc.OpenEngineStub(to_b),
                    generate_request("turn2", [*first_turn, 6], session="chat"),
                )
                assert (second["engine"], second["reason"]) == (first["engine"], "session")
                assert reply[-1].usage.cached_prompt_tokens == 64
        finally:
            stream.cancel()


@contextlib.asynccontextmanager
async def _replica_joining_while_frozen(
    tmp_path: Path,
    processes: list[subprocess.Popen[bytes]],
    engines: list[str],
    frozen: list[subprocess.Popen[bytes]],
    *,
    settings: str,
    peers_in_flight: dict[str, int],
) -> AsyncIterator[grpc.aio.Channel]:
    """Replica b (`settings`), started while the engines' processes (`frozen`) stop answering
    (SIGSTOP): it hears a's snapshot (it charges the engines with `peers_in_flight`, a's
    requests) before it has reached any engine; then they answer again and b meets each for
    the first time. A channel to b once it routes to every engine; the engines answer again
    however it ends."""
    for process in frozen:
        process.send_signal(signal.SIGSTOP)
    try:
        _, target_b = await asyncio.to_thread(
            controller_process, tmp_path, "b", "127.0.0.1:0", processes, engines,
            settings=settings,
        )  # fmt: skip
        async with grpc.aio.insecure_channel(target_b) as to_b:
            b = apb_grpc.AdminStub(to_b)

            async def snapshot_heard() -> bool:
                return await _in_flight(b) == peers_in_flight

            await eventually(snapshot_heard, WAIT_S, "a's snapshot heard by b")
            assert not await _routable(b, len(engines))  # b has reached no engine yet
            for process in frozen:
                process.send_signal(signal.SIGCONT)
            await eventually(lambda: _routable(b, len(engines)), WAIT_S, "b's first contacts")
            yield to_b
    finally:
        for process in frozen:
            process.send_signal(signal.SIGCONT)


async def _generate_routed(
    gateway: pb_grpc.OpenEngineAsyncStub, request: pb.GenerateRequest
) -> tuple[list[pb.GenerateResponse], dict[str, Any]]:
    """A Generate through a controller: its stream, and the route it reports
    (`kvplane-route`: the engine that served, and why)."""
    call = gateway.Generate(request)
    reply = [r async for r in call]
    route = read_route(await call.trailing_metadata())
    assert route is not None
    return reply, route


async def _in_flight(admin: apb_grpc.AdminAsyncStub) -> dict[str, int]:
    """Per engine, the requests in flight the controller charges it with (`admin workers`)."""
    workers = (await admin.ListWorkers(apb.ListWorkersRequest())).workers
    return {w.address: w.inflight_requests for w in workers if w.inflight_requests}


@pytest.mark.timeout(180)
async def test_replicas_in_sync_over_a_redis_cluster_survive_a_failover(
    replicated_cluster: RedisClusterNodes,
) -> None:
    """On `redis+cluster://` (PUBLISH reaches every node's subscribers): a request routed on
    one replica is charged on the other; the primary serving the channel's slot (where both
    subscriptions are) killed and its replica promoted, the replicas subscribe again and
    catch up by snapshots."""
    replicas = _Replicas(replicated_cluster.url)
    try:
        a = await replicas.start("a")
        b = await replicas.start("b")
        await eventually(lambda: _ready(a, b), WAIT_S, "peers")
        first = _route(a.router, "r1")
        await eventually(lambda: _requests(b.router) == {first: (1, 1)}, WAIT_S, "a's request")
        primary = replicated_cluster.node_of(RedisOptions().partition_key(CHANNEL))
        replica = replicated_cluster.replica_of(primary)
        primary.kill()
        during = _route(a.router, "r2")  # while the channel's node is down
        a.router.finish("r1")
        await asyncio.to_thread(replicated_cluster.fail_over, primary, replica)
        await eventually(
            lambda: _requests(b.router) == {during: (1, 1)}, WAIT_S, "the sync after the failover"
        )
        third = _route(b.router, "r3")
        await eventually(
            lambda: sum(n for n, _ in _requests(a.router).values()) == 2, WAIT_S, "b's request"
        )
        assert third != during
    finally:
        await replicas.close()


async def test_a_replica_that_joins_sends_a_finished_session_to_its_engine(
    redis: RedisServer,
) -> None:
    """A chat's first turn, through replica a, ends; a replica started afterwards (scaled up,
    or restarted: it knows only what its peers' snapshots bring) takes the chat's next turn:
    it goes to the engine that served the first, and reuses its cached prefix there, though
    the round robin alone would send it to the other engine. (Snapshots carried the sessions
    of requests in flight only: the next turn went to the other engine and computed its
    whole prompt again.)"""
    router = {"replica_sync": True, "policy": "round_robin", "session_metadata_key": "session"}
    settings: dict[str, Any] = {"index": {"backend": redis.url}, "router": router}
    a = await make_fleet(2, **copy.deepcopy(settings))
    late: Fleet | None = None
    try:
        await generate(a, generate_request("plain", [9] * 40))  # a's round robin turns
        first_turn = [5] * 64
        await generate(a, generate_request("turn1", first_turn, session="chat"))
        late = await make_fleet(engines=a.engines, **copy.deepcopy(settings))
        late_sync = late.app.controller.replica_sync
        assert late_sync is not None
        await eventually(
            lambda: a.app.controller.instance_id in late_sync.peers.origins,
            WAIT_S,
            "a's snapshot",
        )
        reply = await generate(late, generate_request("turn2", [*first_turn, 6], session="chat"))
        assert reply[-1].usage.cached_prompt_tokens == 64
    finally:
        if late is not None:
            await late.channel.close()
            await late.app.close(0.2)
        await close_fleet(a)
