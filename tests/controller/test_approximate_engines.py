"""Engines whose KV events the controller does not read, through a real controller and real
sim engines: with `kv_events: approximate` the router predicts each one's cache from the
prompts it routed there, so a prompt sent again long after `router.pending_ttl_s` lands where
it is cached (and the engine says so); with `kv_events: none` it is routed cache-blind. The
admin commands show the prediction for what it is. Controller replicas in sync predict from
each other's routes too, from the engine's registration and after its restarts."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from controller.config import ControllerConfig
from controller.route_report import read_route
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from tests.controller.conftest import (
    Fleet,
    close_fleet,
    generate_request,
    make_fleet,
    start_sim_engine,
)
from tests.controller.test_admin_cli import cli, cli_json
from tests.polling import eventually
from tests.redis_servers import RedisServer

pytestmark = pytest.mark.timeout(60)

PENDING_TTL_S = 0.2
WAIT_S = 20.0
PROMPT = [*range(100, 164), 1, 2, 3]  # four full blocks of 16 tokens, then three
CACHED = 64


def target(fleet: Fleet) -> list[str]:
    return ["--target", fleet.target]


async def served(fleet: Fleet, request_id: str) -> tuple[dict[str, object], pb.GenerateResponse]:
    """The prompt, sent and run to its end: its `kvplane-route` and its last message."""
    call = fleet.gateway.Generate(generate_request(request_id, PROMPT))
    replies = [r async for r in call]
    route = read_route(await call.trailing_metadata())
    assert route is not None and replies[-1].WhichOneof("event") == "finished"
    return route, replies[-1]


async def sent_twice(kv_events: str) -> tuple[Fleet, dict[str, object], dict[str, object], int]:
    """A fleet of three engines followed as `kv_events` says, the prompt sent, finished, then
    sent again once the router's short claim on it has expired: both routes, and the
    engine's own count of cached tokens the second time."""
    fleet = await make_fleet(
        3, kv_events=kv_events, router={"pending_ttl_s": PENDING_TTL_S, "approximate_ttl_s": 600}
    )
    first, _ = await served(fleet, "first")
    await asyncio.sleep(PENDING_TTL_S * 2)
    second, finished = await served(fleet, "second")
    return fleet, first, second, finished.usage.cached_prompt_tokens


async def test_a_prompt_sent_again_lands_where_the_router_predicts_it_is_cached() -> None:
    fleet, first, second, cached = await sent_twice("approximate")
    try:
        assert second["engine"] == first["engine"]
        assert (second["reason"], second["predicted_cached_tokens"]) == ("cache", CACHED)
        assert cached == CACHED  # the engine served it from its cache, as predicted
    finally:
        await close_fleet(fleet)


async def test_without_kv_events_nor_predictions_the_router_cannot_know() -> None:
    fleet, _, second, _ = await sent_twice("none")
    try:
        assert second["reason"] != "cache" and second["predicted_cached_tokens"] == 0
    finally:
        await close_fleet(fleet)


async def test_the_admin_commands_show_the_prediction(tmp_path: Path) -> None:
    fleet, first, _, _ = await sent_twice("approximate")
    t = target(fleet)
    tokens = tmp_path / "prompt.json"
    tokens.write_text(json.dumps(PROMPT))
    holder = fleet.engine_at(str(first["engine"])).instance_id
    try:
        workers = await cli_json("workers", *t)
        assert {w["kv_events"] for w in workers["workers"]} == {"approximate"}
        assert {w["kv_events_reason"] for w in workers["workers"]} == {"kv_events: approximate"}

        matched = await cli_json("match", "--tokens-file", str(tokens), *t)
        rows = {m["instance_id"]: m for m in matched["matches"]}
        assert rows[holder]["device_blocks"] == 4 and rows[holder]["predicted"] is True
        assert all(m["predicted"] for m in rows.values())
        table = await cli("match", "--tokens-file", str(tokens), *t)
        assert f"{CACHED} (predicted)" in table.stdout
        assert "predicted from the prompts this controller routed there" in table.stdout

        routed = await cli_json("route", "--tokens-file", str(tokens), *t)
        assert (routed["instance_id"], routed["reason"]) == (holder, "cache")
        costs = {c["instance_id"]: c for c in routed["costs"]}
        assert costs[holder]["cached_tokens"] == CACHED and costs[holder]["predicted"] is True
        table = await cli("route", "--tokens-file", str(tokens), *t)
        assert f"{CACHED} (predicted)" in table.stdout
    finally:
        await close_fleet(fleet)


async def test_register_takes_approximate_and_refuses_unknown_modes() -> None:
    fleet = await make_fleet(1)
    extra = await start_sim_engine("extra")
    address = fleet.address(extra)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.admin.RegisterEngine(
                apb.RegisterEngineRequest(address=address, kv_events="guess")
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "kv_events 'guess'?"
        added = await cli_json("register", address, "--kv-events", "approximate", *target(fleet))
        assert (added["kv_events"], added["kv_events_state"]) == ("approximate", "not_followed")
    finally:
        await close_fleet(fleet)
        await extra.close()


def test_the_config_takes_approximate_and_refuses_unknown_modes() -> None:
    config = ControllerConfig.model_validate(
        {"engines": [{"address": "127.0.0.1:9001", "kv_events": "approximate"}]}
    )
    assert config.engines[0].kv_events == "approximate"
    assert config.router.approximate_ttl_s == 600.0
    with pytest.raises(ValueError, match="'grpc', 'zmq', 'none' or 'approximate'"):
        ControllerConfig.model_validate(
            {"engines": [{"address": "127.0.0.1:9001", "kv_events": "guess"}]}
        )
    with pytest.raises(ValueError, match="approximate_ttl_s"):
        ControllerConfig.model_validate({"router": {"approximate_ttl_s": 0}})


async def test_a_replica_predicts_from_its_peers_routes_before_routing_there_itself(
    redis: RedisServer,
) -> None:
    """Two controller replicas in sync (`router.replica_sync`) in front of one engine: a
    prompt routed through one, then sent through the other once the short claim on it has
    expired, is predicted cached there by the other, which had routed nothing to the engine
    yet; and again after the engine restarts (each replica forgot the old process's cache).
    (The replica that had not routed to the engine itself took its peer's route as a
    `pending_ttl_s` claim, and sent the prompt's repeats cache-blind.)"""
    settings: dict[str, Any] = {
        "index": {"backend": redis.url},
        "router": {
            "replica_sync": True,
            "pending_ttl_s": PENDING_TTL_S,
            "approximate_ttl_s": 600,
        },
    }
    a = await make_fleet(1, kv_events="approximate", **copy.deepcopy(settings))
    b = await make_fleet(engines=a.engines, kv_events="approximate", **copy.deepcopy(settings))
    address = a.address(a.engines[0])
    try:
        await peers_heard(a, b)
        await predicted_through_the_peer(a, b, "first")
        await a.restart_engine(address, "restarted")
        registry = b.app.controller.fleet.registry
        await b.app.controller.fleet.wait_for(
            lambda: (
                registry.get(address).engine_id == "restarted" and registry.get(address).routable
            ),
            WAIT_S,
        )
        await predicted_through_the_peer(a, b, "after-restart")
    finally:
        await b.channel.close()
        await b.app.close(0.2)
        await close_fleet(a)


async def peers_heard(a: Fleet, b: Fleet) -> None:
    """Until each replica has heard the other."""
    a_sync, b_sync = a.app.controller.replica_sync, b.app.controller.replica_sync
    assert a_sync is not None and b_sync is not None
    await eventually(
        lambda: (
            b.app.controller.instance_id in a_sync.peers.origins
            and a.app.controller.instance_id in b_sync.peers.origins
        ),
        WAIT_S,
        "the peers",
    )


async def predicted_through_the_peer(a: Fleet, b: Fleet, name: str) -> None:
    """The prompt through `a`; once `b` credits its engine with it, and the short claim on it
    has expired, through `b`: predicted cached, and served from the cache."""
    await served(a, f"{name}-a")
    query = apb.PromptQuery(token_ids=pb.TokenIds(ids=PROMPT))

    async def b_credits_it() -> bool:
        (match,) = (await b.admin.Match(query)).matches
        return match.device_blocks == len(PROMPT) // 16 and match.predicted

    await eventually(b_credits_it, WAIT_S, "b's prediction of a's route")
    await asyncio.sleep(PENDING_TTL_S * 2)
    route, finished = await served(b, f"{name}-b")
    assert route["predicted_cached_tokens"] == CACHED
    assert finished.usage.cached_prompt_tokens == CACHED
