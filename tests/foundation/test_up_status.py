"""`kvplane up`'s live status (kvplane/up/status.py) read from real servers: a controller
and sim engines in this process, each a fleet member at its address (no member processes:
the view reads members, not how they were started)."""

from __future__ import annotations

import socket
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry, Counter
from rich.console import Console

from kvplane.metrics import start_metrics_server
from kvplane.up.config import FleetConfig
from kvplane.up.fleet import Fleet
from kvplane.up.status import collect_status, render_status
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import close_fleet, generate_request, make_fleet, start_sim_engine

pytestmark = pytest.mark.timeout(60)

PROMPT = list(range(100, 164))  # four full blocks of 16


def _fleet_of(tmp_path: Path, members: dict[str, str]) -> Fleet:
    """A `kvplane up` fleet whose members (name: kind) are already up at addresses the caller
    sets; none of them references another."""
    config = FleetConfig.model_validate(
        {
            "members": [
                {"name": name, "kind": kind, "config": {"model": "sim"}}
                if kind == "engine"
                else {"name": name, "kind": kind, "config": {"engines": []}}
                for name, kind in members.items()
            ]
        }
    )
    return Fleet(config, tmp_path)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


async def test_status_shows_each_engines_own_cache_beside_the_index_and_a_cordon(
    tmp_path: Path,
) -> None:
    """CACHED is the engine's own prefix cache (GetLoad), INDEXED what the controller's
    index places on it, a cordoned engine says so, the index size is the controller's, and
    the hit ratio is the tokens the engines reported served from cache. An engine without KV
    events (kv_events none) tells cache and index apart: its cache fills, the index stays
    empty."""
    controller_fleet = await make_fleet(1, kv_events="none", metrics_listen="127.0.0.1:0")
    try:
        for request_id in ("a", "b"):  # the repeat is served from the engine's cache
            async for _ in controller_fleet.gateway.Generate(generate_request(request_id, PROMPT)):
                pass
        await controller_fleet.admin.Cordon(apb.EngineRef(engine="e0"))
        fleet = _fleet_of(tmp_path, {"e0": "engine", "controller": "controller"})
        fleet.member("e0").address = controller_fleet.address(controller_fleet.engines[0])
        controller = fleet.member("controller")
        controller.address = controller_fleet.target
        controller.metrics_address = f"127.0.0.1:{controller_fleet.app.metrics_port}"
        address = controller_fleet.address(controller_fleet.engines[0])
        async with grpc.aio.insecure_channel(address) as channel:
            load = await pb_grpc.OpenEngineStub(channel).GetLoad(pb.GetLoadRequest())

        status = await collect_status(fleet)

        [engine] = status.engines
        assert engine.name == "e0"
        assert engine.state == "ready cordoned"
        assert engine.cached_blocks == int(load.attributes["cached_kv_blocks"]) >= 3
        assert engine.indexed_blocks == 0
        assert status.index_blocks == 0
        assert status.prompt_tokens == 2 * len(PROMPT)
        assert status.cached_tokens >= 3 * 16  # the last block is computed again
        assert status.hit_ratio == status.cached_tokens / (2 * len(PROMPT))
        console = Console(record=True, width=80)
        console.print(render_status(status))
        text = " ".join(console.export_text().split())
        assert "e0 ready cordoned 0 0" in text, text
        assert f"{engine.cached_blocks} 0 0" in text, text  # cached, indexed, in flight
        assert "index 0 blocks" in text, text
    finally:
        await close_fleet(controller_fleet)


async def test_status_of_engines_alone_tells_an_unreachable_engine(tmp_path: Path) -> None:
    """Without a controller, each engine's own answer is its health: one whose address
    answers nothing is unreachable, not the `serving` it was when it started."""
    engine = await start_sim_engine("e0")
    try:
        fleet = _fleet_of(tmp_path, {"engine-0": "engine", "engine-1": "engine"})
        for member, port in zip(fleet.members, (engine.port, _closed_port()), strict=True):
            member.address = f"127.0.0.1:{port}"
            member.state = "serving"

        status = await collect_status(fleet)

        assert [(e.name, e.state) for e in status.engines] == [
            ("engine-0", "serving"),
            ("engine-1", "unreachable"),
        ]
        assert status.engines[0].total_kv_blocks == 256
    finally:
        await engine.close()


async def test_status_sums_each_reasons_decisions_over_every_hop(tmp_path: Path) -> None:
    """The controller counts decisions by policy, reason and hop (a disaggregated fleet's
    prefill and decode hops): the view shows each reason's sum over them, and the hit ratio
    from the cached tokens the engines reported."""
    registry = CollectorRegistry()
    decisions = Counter(
        "kvplane_controller_route_decisions", "", ["policy", "reason", "hop"], registry=registry
    )
    decisions.labels("kvplane", "prefix", "prefill").inc(2)
    decisions.labels("kvplane", "prefix", "decode").inc(3)
    decisions.labels("kvplane", "load", "decode").inc(1)
    for name, value in (("prompt_tokens", 400), ("actual_cached_tokens", 300)):
        Counter(f"kvplane_controller_{name}", "", registry=registry).inc(value)
    Counter("kvplane_controller_predicted_cached_tokens", "", registry=registry).inc(100)
    server, port = start_metrics_server("127.0.0.1:0", registry)
    try:
        fleet = _fleet_of(tmp_path, {"controller": "controller"})
        controller = fleet.member("controller")
        controller.address = f"127.0.0.1:{_closed_port()}"  # its admin API does not answer
        controller.metrics_address = f"127.0.0.1:{port}"

        status = await collect_status(fleet)

        assert status.decisions == {"prefix": 5, "load": 1}
        console = Console(record=True, width=80)
        console.print(render_status(status))
        text = " ".join(console.export_text().split())
        assert "decisions load 1, prefix 5" in text, text
        assert "75.0% (300 of 400 prompt tokens from cache; 100 predicted)" in text, text
    finally:
        server.shutdown()
        server.server_close()
