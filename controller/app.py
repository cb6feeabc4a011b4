"""Assemble and run the controller process: the Controller (fleet, router, index), the
gateway (`openengine.v1.OpenEngine`) and the admin API (`kvplane.v1.Admin`) on one gRPC
server, and Prometheus metrics on a side port when configured.

The process runs on uvloop: grpc.aio wakes the event loop at least once per completed gRPC
operation, several times per relayed Generate, and on uvloop the controller spends about 8%
less CPU a request than on asyncio's own loop, and adds a little less latency
(docs/benchmarks/e2e.md, "The floor of a Python hop")."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import uvloop
from grpc_health.v1 import health

from controller.admin import GUARDED_METHODS as ADMIN_GUARDED
from controller.admin import STRICT_METHODS as ADMIN_STRICT
from controller.admin import AdminServicer
from controller.config import ControllerConfig
from controller.gateway import GatewayServicer
from controller.hops import LoopGuard
from controller.service import Controller
from controller.vllm_gateway import SERVICE_NAME as VLLM_SERVICE
from controller.vllm_gateway import VllmGatewayServicer
from indexer.backend import IndexBackend
from kvplane.metrics import start_metrics_server
from kvplane.server import Service, create_server, publish_port, serve_until_signal
from kvplane_api.v1 import admin_pb2_grpc as apb_grpc
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from vllm_grpc import vllm_grpc_pb2_grpc as vpb_grpc

log = logging.getLogger(__name__)

GATEWAY_MUTATING = frozenset({"Abort", "Drain", "LoadLora", "UnloadLora"})
# The gateway's calls that refuse fields outside their request's schema themselves
# (kvplane.request_decoding), as an engine does: those it answers or acts on itself (an Abort
# it may end at the relay, its own drain, the LoRA intent it records, the fleet's load and
# health). The calls it relays to one engine (Generate, Embed, Classify, Score, GetModelInfo)
# pass such fields on, intact, and that engine decides (the bundled one refuses them); those it
# refuses whatever the request (GetKvConnectorInfo, ...: UNIMPLEMENTED) and GetEngineInfo (the
# revision handshake) are not strict.
GATEWAY_STRICT = frozenset(
    {"Abort", "Drain", "LoadLora", "UnloadLora", "ListLoras", "GetLoad", "Health"}
)
ADMIN_SERVICE = "kvplane.v1.Admin"


@dataclass
class ControllerApp:
    controller: Controller
    gateway: GatewayServicer
    admin: AdminServicer
    vllm: VllmGatewayServicer
    server: grpc.aio.Server
    port: int
    metrics_server: Any | None = None
    metrics_port: int | None = None

    async def begin_shutdown(self) -> None:
        """A shutdown's first step, before the server stops taking calls: the controller
        stops accepting new requests, so that its health says so at once (OpenEngine Health
        DRAINING, `vllm.Generate` NOT_SERVING, to Watch subscribers too) while the calls in
        flight end within the grace."""
        self.controller.stop_accepting()
        await self.vllm.update_health()

    async def close(self, grace_s: float = 1.0) -> None:
        await self.begin_shutdown()
        await self.server.stop(grace_s)
        await self.close_controller()

    async def close_controller(self) -> None:
        await self.controller.close()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
            self.metrics_server = None


async def start_controller(
    config: ControllerConfig, index: IndexBackend | None = None
) -> ControllerApp:
    controller = Controller(config, index)
    await controller.start()
    gateway = GatewayServicer(controller)
    admin = AdminServicer(controller)
    vllm = VllmGatewayServicer(controller, gateway.relay)
    services = [
        Service(
            "openengine.v1.OpenEngine",
            lambda s: pb_grpc.add_OpenEngineServicer_to_server(gateway, s),
            GATEWAY_MUTATING,
            GATEWAY_STRICT,
        ),
        Service(
            VLLM_SERVICE,
            lambda s: vpb_grpc.add_GenerateServicer_to_server(vllm, s),
            reports_own_health=True,
        ),
        Service(
            ADMIN_SERVICE,
            lambda s: apb_grpc.add_AdminServicer_to_server(admin, s),
            ADMIN_GUARDED,
            ADMIN_STRICT,
        ),
    ]
    try:
        # A gateway call that passed this controller already is a loop (`controller.hops`);
        # the admin API's calls are no hops of a request.
        loop_guard = LoopGuard(
            controller.instance_id, [s.name for s in services if s.name != ADMIN_SERVICE]
        )
        health_servicer = health.aio.HealthServicer()
        await vllm.report_health(health_servicer)
        server, port = await create_server(
            config, services, handler_wrapper=loop_guard, health_servicer=health_servicer
        )
    except Exception:
        await controller.close()
        raise
    app = ControllerApp(controller, gateway, admin, vllm, server, port)
    if config.metrics_listen is not None:
        try:
            app.metrics_server, app.metrics_port = start_metrics_server(
                config.metrics_listen, controller.metrics.registry
            )
        except Exception:
            await app.close(0)
            raise
    return app


def _freeze_startup_heap() -> None:
    """Leave what the process holds once started (modules, descriptors, its configuration:
    some 74,000 objects) out of every later garbage collection. A full collection walks every
    object the collector tracks, and the KV-event indexing allocates enough to run one every
    1,000-2,000 requests at 8 engines; each took 48-55 ms of the event loop, against 7-18 ms
    without the startup heap (docs/benchmarks/fleet_scale.md, "The gateway's CPU a
    request"). What that heap held as garbage is collected first."""
    gc.collect()
    gc.freeze()


def serve_controller(config: ControllerConfig, *, port_file: Path | None = None) -> None:
    """The `kvplane controller serve` process: `run_controller` on a uvloop event loop."""
    uvloop.run(run_controller(config, port_file=port_file))


async def run_controller(config: ControllerConfig, *, port_file: Path | None = None) -> None:
    """Serve until SIGTERM/SIGINT, then stop cleanly."""
    app = await start_controller(config)
    _freeze_startup_heap()
    try:
        await publish_port(app.server, port_file, app.port)
        await serve_until_signal(app.server, config.shutdown_grace_s, on_stop=app.begin_shutdown)
    finally:
        await app.close_controller()
    log.info("controller stopped")
