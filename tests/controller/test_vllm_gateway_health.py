"""`grpc.health.v1` for the controller's `vllm.Generate`: what a load balancer or a
Kubernetes gRPC probe pointed at the vLLM front end reads. It follows the fleet as the
gateway's OpenEngine Health judges it: NOT_SERVING while no engine is routable and from the
moment the controller shuts down, SERVING while an engine is. Real processes (`kvplane
controller serve`, `kvplane engine serve --model sim`), engines registered and removed
through the admin API, the status read with Check and with Watch (a subscriber sees each
change)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvplane_api.v1 import admin_pb2 as apb
from kvplane_api.v1 import admin_pb2_grpc as apb_grpc
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.test_processes import controller_process, sim_engine_process
from tests.polling import eventually

pytestmark = pytest.mark.timeout(90)

VLLM = "vllm.Generate"
SERVING: int = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING: int = health_pb2.HealthCheckResponse.NOT_SERVING

Watch = grpc.aio.UnaryStreamCall[health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse]


async def checked(channel: grpc.aio.Channel, service: str = VLLM) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service)
    )
    return int(reply.status)


def watch(channel: grpc.aio.Channel) -> Watch:
    call: Watch = health_pb2_grpc.HealthStub(channel).Watch(
        health_pb2.HealthCheckRequest(service=VLLM)
    )
    return call


async def watched(call: Watch) -> int:
    """The next status the Watch stream sends (it sends one at each change)."""
    reply = await call.read()
    assert isinstance(reply, health_pb2.HealthCheckResponse), reply
    return int(reply.status)


async def fleet_state(channel: grpc.aio.Channel) -> pb.HealthState.ValueType:
    return (await pb_grpc.OpenEngineStub(channel).Health(pb.HealthRequest())).state


async def test_with_no_engine_vllm_generate_is_not_serving(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    """A controller with no engine can serve no vllm.Generate: a probe must not send it
    traffic. The empty name still says the process is up."""
    _, target = await asyncio.to_thread(
        controller_process, tmp_path, "controller", "127.0.0.1:0", processes
    )
    async with grpc.aio.insecure_channel(target) as channel:
        assert await fleet_state(channel) == pb.HEALTH_STATE_NOT_READY
        assert await checked(channel) == NOT_SERVING
        call = watch(channel)
        assert await watched(call) == NOT_SERVING
        call.cancel()
        assert await checked(channel, "") == SERVING


async def test_vllm_generate_serves_while_a_registered_engine_is_routable_and_not_once_removed(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    _, target = await asyncio.to_thread(
        controller_process, tmp_path, "controller", "127.0.0.1:0", processes
    )
    engine = await asyncio.to_thread(sim_engine_process, tmp_path, processes)
    async with grpc.aio.insecure_channel(target) as channel:
        admin = apb_grpc.AdminStub(channel)
        call = watch(channel)
        assert await watched(call) == NOT_SERVING

        await admin.RegisterEngine(apb.RegisterEngineRequest(address=engine))
        assert await watched(call) == SERVING  # once the engine answered ready
        assert await checked(channel) == SERVING
        assert await fleet_state(channel) == pb.HEALTH_STATE_READY

        await admin.RemoveEngine(apb.EngineRef(engine=engine))
        assert await watched(call) == NOT_SERVING
        assert await checked(channel) == NOT_SERVING
        assert await fleet_state(channel) == pb.HEALTH_STATE_NOT_READY
        call.cancel()


async def test_vllm_generate_is_not_serving_from_the_moment_the_controller_shuts_down(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    """SIGTERM: a subscriber learns NOT_SERVING before the server stops (its calls in
    flight have the shutdown's grace to end), not only by losing the stream."""
    engine = await asyncio.to_thread(sim_engine_process, tmp_path, processes)
    controller, target = await asyncio.to_thread(
        controller_process, tmp_path, "controller", "127.0.0.1:0", processes, [engine]
    )
    async with grpc.aio.insecure_channel(target) as channel:

        async def serving() -> bool:
            return await checked(channel) == SERVING

        await eventually(serving, 30, "vllm.Generate SERVING with its engine routable")
        call = watch(channel)
        assert await watched(call) == SERVING

        controller.send_signal(signal.SIGTERM)
        assert await watched(call) == NOT_SERVING
        call.cancel()  # the server need not wait out its grace for it
    assert await asyncio.to_thread(controller.wait) == 0
