"""An in-process engine (real gRPC server on 127.0.0.1 port 0) with real stubs, for the
server tests. Not a test module itself."""

from __future__ import annotations

import asyncio
import threading
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc

from engine.config import EngineConfig, SimTimingConfig
from engine.server.engine_service import EngineService
from engine.server.service import EngineApp, start_engine
from kvplane.channels import INSECURE, ClientChannels
from kvplane_api.v1 import kv_transfer_pb2_grpc as kt_grpc
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.polling import eventually
from vllm_grpc import vllm_grpc_pb2_grpc as vllm_grpc


@dataclass
class Engine:
    app: EngineApp
    channel: grpc.aio.Channel
    stub: pb_grpc.OpenEngineAsyncStub
    vllm: vllm_grpc.GenerateAsyncStub


def sim_config(**overrides: Any) -> EngineConfig:
    """A small sim engine: block size 4, 64 blocks, steps take no wall time."""
    values: dict[str, Any] = {
        "model": "sim",
        "listen": "127.0.0.1:0",
        "block_size": 4,
        "num_kv_blocks": 64,
        "max_model_len": 256,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 256,
        "sim": SimTimingConfig(time_scale=0.0, vocab_size=1000),
        "shutdown_grace_s": 1.0,
    }
    values.update(overrides)
    return EngineConfig(**values)


def torch_config(model: str, **overrides: Any) -> EngineConfig:
    """A small torch engine serving `model`: block size 16, 256 blocks, one thread."""
    from tests.engine.torch_reference import TEST_DEVICE  # torch: only where a test needs it

    values: dict[str, Any] = {
        "model": model,
        "listen": "127.0.0.1:0",
        "block_size": 16,
        "num_kv_blocks": 256,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "num_threads": 1,
        "shutdown_grace_s": 1.0,
        "device": TEST_DEVICE,
    }
    values.update(overrides)
    return EngineConfig(**values)


@asynccontextmanager
async def running_engine(
    config: EngineConfig | None = None, channels: ClientChannels = INSECURE
) -> AsyncIterator[Engine]:
    """The engine `config` makes, dialled as `channels` says (one serving TLS: with TLS)."""
    app = await start_engine(config or sim_config())
    channel = channels.aio_channel(f"127.0.0.1:{app.port}")
    try:
        yield Engine(
            app,
            channel,
            pb_grpc.OpenEngineStub(channel),
            vllm_grpc.GenerateStub(channel),
        )
    finally:
        await channel.close()
        await app.close()


def generate_request(
    ids: list[int], *, max_tokens: int = 4, n: int | None = None, **fields: Any
) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids),
        stopping=pb.StoppingOptions(max_tokens=max_tokens),
        **fields,
    )
    if n is not None:
        request.sampling.num_sequences = n
    return request


async def collect(
    stub: pb_grpc.OpenEngineAsyncStub, request: pb.GenerateRequest
) -> list[pb.GenerateResponse]:
    return [response async for response in stub.Generate(request)]


async def rpc_error(call: Awaitable[Any] | Callable[[], Awaitable[Any]]) -> grpc.aio.AioRpcError:
    """Await a call expected to fail; return its error."""
    try:
        await (call() if callable(call) else call)
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError("the call succeeded")


async def stream_error(stream: Any) -> tuple[list[Any], grpc.aio.AioRpcError]:
    """Drain a server stream expected to fail; return what came before and the error."""
    got: list[Any] = []
    try:
        async for item in stream:
            got.append(item)
    except grpc.aio.AioRpcError as exc:
        return got, exc
    raise AssertionError(f"the stream succeeded with {len(got)} messages")


async def idle(engine: Engine) -> bool:
    """Nothing running or queued and no KV block referenced."""
    load = await engine.stub.GetLoad(pb.GetLoadRequest())
    return (
        load.running_requests == 0
        and load.queued_requests == 0
        and load.used_kv_blocks == 0
        and engine.app.service.num_in_flight == 0
    )


@asynccontextmanager
async def engine_thread_held(service: EngineService) -> AsyncIterator[None]:
    """The engine thread busy in one command (a step that takes long) until the block ends:
    what arrives meanwhile waits for it."""
    in_step, step_over = threading.Event(), threading.Event()

    def long_step(_core: object) -> None:
        in_step.set()
        step_over.wait(30)

    step = asyncio.wrap_future(service.engine_loop.call(long_step))
    await eventually(in_step.is_set, what="the long step")
    try:
        yield
    finally:
        step_over.set()
        await step


async def metrics_text(engine: Engine) -> str:
    """The engine's Prometheus exposition, as a scraper reads it."""
    url = f"http://127.0.0.1:{engine.app.metrics_port}/metrics"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
    return str(body.decode())


@asynccontextmanager
async def fake_prefill_engine(
    servicer: kt_grpc.KvTransferServicer, session_id: str
) -> AsyncIterator[pb.KvSessionRef]:
    """A bare `kvplane.v1.KvTransfer` server on loopback that answers as `servicer` scripts
    it, and the KV session ref (backend `kvplane-pull`) that names it."""
    server = grpc.aio.server()
    kt_grpc.add_KvTransferServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    session = pb.KvSessionRef(session_id=session_id, transfer_backend="kvplane-pull")
    session.endpoints.add(host="127.0.0.1", port=port, protocol="grpc")
    try:
        yield session
    finally:
        await server.stop(0)
