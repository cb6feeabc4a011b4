"""Fixtures: in-process sim engines and a controller in front of them (real gRPC servers on
127.0.0.1, port 0)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, overload

import grpc
import pytest

from controller.app import ControllerApp, start_controller
from controller.config import ControllerConfig
from engine.config import EngineConfig, SimTimingConfig
from engine.server.service import EngineApp, start_engine
from indexer.backend import IndexBackend
from kvplane_api.v1 import admin_pb2_grpc as apb_grpc
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.polling import eventually
from tests.redis_servers import RedisServer
from vllm_grpc import vllm_grpc_pb2 as vpb
from vllm_grpc import vllm_grpc_pb2_grpc as vpb_grpc


async def start_sim_engine(
    name: str, time_scale: float = 0.0, port: int = 0, **config: Any
) -> EngineApp:
    """An in-process sim engine on `port` (0: a free one; `config`: more EngineConfig
    fields, its `sim` a dict of more SimTimingConfig fields)."""
    return await start_engine(
        EngineConfig(
            model="sim",
            listen=f"127.0.0.1:{port}",
            instance_id=name,
            sim=SimTimingConfig(time_scale=time_scale, **config.pop("sim", {})),
            **{"num_kv_blocks": 256, "shutdown_grace_s": 0.5, **config},
        )
    )


async def start_builtin_engines(count: int, **config: Any) -> list[EngineApp]:
    """`count` in-process torch engines on the builtin model (t0, t1, ...; `config`: more
    EngineConfig fields), a text prompt's path end to end: they tokenise and detokenise. The
    caller points $KVPLANE_CACHE_DIR at where the model is built (on first use)."""
    return [
        await start_engine(
            EngineConfig(
                model="builtin",
                listen="127.0.0.1:0",
                instance_id=f"t{i}",
                **{"num_kv_blocks": 64, "num_threads": 1, "shutdown_grace_s": 0.5, **config},
            )
        )
        for i in range(count)
    ]


class ServedEngine(Protocol):
    """What a fleet needs of an engine: the port the controller dials, and its end."""

    @property
    def port(self) -> int: ...

    async def close(self) -> None: ...


E = TypeVar("E", bound=ServedEngine)


@dataclass
class EngineFleet(Generic[E]):
    """A controller in front of engines of one kind: this repository's (`Fleet`), or test
    engines fronted by a scripted server (tests/controller/fronted_engine.py)."""

    engines: list[E]
    app: ControllerApp
    channel: grpc.aio.Channel

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.app.port}"

    @property
    def gateway(self) -> pb_grpc.OpenEngineAsyncStub:
        return pb_grpc.OpenEngineStub(self.channel)

    @property
    def admin(self) -> apb_grpc.AdminAsyncStub:
        return apb_grpc.AdminStub(self.channel)

    def address(self, engine: ServedEngine) -> str:
        return f"127.0.0.1:{engine.port}"

    def engine_at(self, address: str) -> E:
        return next(e for e in self.engines if self.address(e) == address)

    async def wait_routable(self, count: int, timeout_s: float = 30.0) -> None:
        registry = self.app.controller.fleet.registry
        await self.app.controller.fleet.wait_for(
            lambda: len(registry.routable()) == count, timeout_s
        )

    async def answers_as(self, address: str, instance_id: str) -> bool:
        """Whether the engine at `address` answers the controller's own channel to it as
        `instance_id` and is routed to: a process restarted there is back for the gateway
        too, even one under the instance id of the process before (the same to the
        registry)."""
        controller = self.app.controller
        try:
            info = await controller.fleet.stub(address).GetEngineInfo(
                pb.GetEngineInfoRequest(), timeout=1
            )
        except grpc.aio.AioRpcError:
            return False
        return info.instance_id == instance_id and controller.fleet.registry.get(address).routable

    async def restart_engine(
        self: EngineFleet[EngineApp] | EngineFleet[ServedEngine],
        address: str,
        instance_id: str,
        *,
        down_s: float = 0.0,
        timeout_s: float = 30.0,
        routed: bool = True,
        **config: Any,
    ) -> EngineApp:
        """Stop the sim engine at `address`, wait `down_s`, start a new process there (an
        empty cache, `instance_id`) and, with `routed`, wait until the controller routes to
        it under that id. The new process has the old one's config (an engine of this
        repository's; another's: a sim engine's defaults, as `start_sim_engine`), `config`
        the fields that differ: a restart that changed its identity (blocks, model length,
        role...) unasked would be taken for another engine, briefly out of routing. Under
        the old process's instance id, the controller may take the restart for the same
        process (the same identity, its KV events only broken): the wait then tells
        nothing, and the caller waits for what the restart changes."""
        index = next(i for i, e in enumerate(self.engines) if self.address(e) == address)
        old = self.engines[index]
        same: dict[str, Any] = {"model": "sim", "num_kv_blocks": 256, "shutdown_grace_s": 0.5}
        if isinstance(old, EngineApp):
            same = old.config.model_dump(exclude_unset=True)
        await old.close()
        await asyncio.sleep(down_s)
        fresh = await start_engine(
            EngineConfig.model_validate(
                {**same, **config, "listen": address, "instance_id": instance_id}
            )
        )
        self.engines[index] = fresh
        if not routed:
            return fresh
        registry = self.app.controller.fleet.registry
        await self.app.controller.fleet.wait_for(
            lambda: (
                registry.get(address).engine_id == instance_id and registry.get(address).routable
            ),
            timeout_s,
        )
        return fresh


Fleet = EngineFleet[EngineApp]


def engines_of_kinds(*engines: ServedEngine) -> list[ServedEngine]:
    """A fleet's engines of several kinds (in process, fronted, a process of its own), typed
    as what the fleet needs of each."""
    return list(engines)


@overload
async def make_fleet(
    num_engines: int = 3,
    time_scale: float = 0.0,
    engines: None = None,
    index_backend: IndexBackend | None = None,
    kv_events: str = "grpc",
    **controller: Any,
) -> Fleet: ...


@overload
async def make_fleet(
    num_engines: int = 3,
    time_scale: float = 0.0,
    *,
    engines: list[E],
    index_backend: IndexBackend | None = None,
    kv_events: str = "grpc",
    **controller: Any,
) -> EngineFleet[E]: ...


async def make_fleet(
    num_engines: int = 3,
    time_scale: float = 0.0,
    engines: list[Any] | None = None,
    index_backend: IndexBackend | None = None,
    kv_events: str = "grpc",
    **controller: Any,
) -> EngineFleet[Any]:
    """A controller in front of `engines` (else `num_engines` sim engines), each followed as
    `kv_events` says; `controller`: more ControllerConfig fields."""
    if engines is None:
        engines = [await start_sim_engine(f"e{i}", time_scale) for i in range(num_engines)]
    num_engines = len(engines)
    health = {"poll_interval_s": 0.2, "load_poll_interval_s": 0.1, "backoff_initial_s": 0.1,
              "backoff_max_s": 1.0, **controller.pop("health", {})}  # fmt: skip
    config = ControllerConfig.model_validate(
        {
            "listen": "127.0.0.1:0",
            "engines": [
                {"address": f"127.0.0.1:{e.port}", "kv_events": kv_events} for e in engines
            ],
            "router": {"seed": 0, **controller.pop("router", {})},
            "health": health,
            "shutdown_grace_s": 0.5,
            **controller,
        }
    )
    app = await start_controller(config, index_backend)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{app.port}")
    fleet = EngineFleet(engines, app, channel)
    await fleet.wait_routable(num_engines)
    return fleet


async def close_fleet(fleet: EngineFleet[Any]) -> None:
    await fleet.channel.close()
    await fleet.app.close(0.2)
    for engine in fleet.engines:
        await engine.close()


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = await make_fleet()
    try:
        yield f
    finally:
        await close_fleet(f)


def generate_request(
    request_id: str, tokens: list[int], max_tokens: int = 4, **metadata: str
) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        model="sim",
        token_ids=pb.TokenIds(ids=tokens),
        stopping=pb.StoppingOptions(max_tokens=max_tokens, ignore_eos=True),
        metadata=metadata,
    )


@contextlib.asynccontextmanager
async def engine_with_its_seats_taken() -> AsyncIterator[grpc.aio.Channel]:
    """A channel to a sim engine whose 2 seats a request holds: the next one it is sent
    queues there."""
    engine = await start_sim_engine("queues", time_scale=0.5, max_num_seqs=2)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{engine.port}")
    stub = pb_grpc.OpenEngineStub(channel)
    try:
        seats = generate_request("seats", [1, 2, 3], max_tokens=100_000)
        seats.sampling.num_sequences = 2
        running = stub.Generate(seats)
        await running.read()  # its first token: both seats are taken
        yield channel
        running.cancel()
    finally:
        await channel.close()
        await engine.close()


async def abort_once_queued(
    stub: pb_grpc.OpenEngineAsyncStub, request_id: str, num_sequences: int
) -> None:
    """Abort `request_id` on the engine of `stub` once its `num_sequences` queue there."""

    async def queued() -> bool:  # GetLoad counts sequences
        load = await stub.GetLoad(pb.GetLoadRequest())
        return load.queued_requests == num_sequences

    await eventually(queued, what="the request queued")
    reply = await stub.Abort(pb.AbortRequest(request_id=request_id))
    assert reply.status == pb.ABORT_STATUS_ABORTED


async def ended_while_queued(request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    """How the bundled engine ends `request` (up to 2 outputs) aborted before its prefill:
    queued behind the seats taken, an Abort of its id ends it there."""
    async with engine_with_its_seats_taken() as channel:
        stub = pb_grpc.OpenEngineStub(channel)
        stream = stub.Generate(request)
        await abort_once_queued(stub, request.request_id, request.sampling.num_sequences or 1)
        return [r async for r in stream]


async def vllm_ended_while_queued(
    request: vpb.GenerateRequest, unary: bool
) -> list[vpb.GenerateResponse]:
    """`ended_while_queued` for a vllm.Generate (`unary`) or GenerateStream `request`."""
    async with engine_with_its_seats_taken() as channel:
        stub = pb_grpc.OpenEngineStub(channel)
        vllm = vpb_grpc.GenerateStub(channel)
        num_sequences = request.sampling.num_sequences or 1
        if unary:
            reply = asyncio.ensure_future(vllm.Generate(request))
            await abort_once_queued(stub, request.request_id, num_sequences)
            return [await reply]
        stream = vllm.GenerateStream(request)
        await abort_once_queued(stub, request.request_id, num_sequences)
        return [r async for r in stream]


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Child processes a test starts: stopped (SIGTERM, then SIGKILL after 20 s) after it."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in started:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
async def redis(tmp_path: Path) -> AsyncIterator[RedisServer]:
    """A private redis-server: the tests stop and restart it."""
    server = RedisServer(tmp_path / "redis")
    await asyncio.to_thread(server.start)
    try:
        yield server
    finally:
        await asyncio.to_thread(server.stop)
