"""A test OpenEngine server in front of a real sim engine, for what the bundled engine cannot
do on demand (LoRA, Embed, scripted failures, the PREFILL and DECODE roles). `Forwarding`
answers every RPC the controller uses with the sim engine's own answer; a test's servicer
overrides what it plays. The controller sees the front server's address, so it polls,
indexes and routes to it exactly as to any engine."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc

from engine.server.service import EngineApp
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import start_sim_engine
from tests.partial_servicers import PartialOpenEngine

Context = grpc.aio.ServicerContext[Any, Any]


class Forwarding(PartialOpenEngine):
    """Every RPC the controller and the tests use, passed to the sim engine behind."""

    def __init__(self, inner: pb_grpc.OpenEngineAsyncStub) -> None:
        self.inner = inner

    async def GetEngineInfo(self, request: pb.GetEngineInfoRequest, context: Context) -> Any:
        return await self.inner.GetEngineInfo(request)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Context) -> Any:
        return await self.inner.GetModelInfo(request)

    async def Health(self, request: pb.HealthRequest, context: Context) -> Any:
        return await self.inner.Health(request)

    async def GetLoad(self, request: pb.GetLoadRequest, context: Context) -> Any:
        return await self.inner.GetLoad(request)

    async def Abort(self, request: pb.AbortRequest, context: Context) -> Any:
        return await self.inner.Abort(request)

    async def SubscribeKvEvents(
        self, request: pb.SubscribeKvEventsRequest, context: Context
    ) -> AsyncIterator[pb.SubscribeKvEventsResponse]:
        async for reply in self.inner.SubscribeKvEvents(request):
            yield reply

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        async for response in self.inner.Generate(request):
            yield response


class ForwardingLora(Forwarding):
    """`Forwarding`, with the LoRA calls passed on too (a sim engine serving LoRA behind)."""

    async def LoadLora(self, request: pb.LoadLoraRequest, context: Context) -> Any:
        return await self.inner.LoadLora(request)

    async def UnloadLora(self, request: pb.UnloadLoraRequest, context: Context) -> Any:
        return await self.inner.UnloadLora(request)

    async def ListLoras(self, request: pb.ListLorasRequest, context: Context) -> Any:
        return await self.inner.ListLoras(request)


class CancelsAPoll(Forwarding):
    """`Forwarding`, GetEngineInfo's trailing metadata passed on too (a controller behind
    tells whom it fronts and its fleet view there), whose GetLoad, once `then` is set, fails
    CANCELLED once (a poll that reaches a process, or a proxy, shutting down), `then` being
    awaited at the identity read that follows before that is passed on (what changed behind
    meanwhile: the engine restarted, a lower controller's fleet)."""

    def __init__(self, inner: pb_grpc.OpenEngineAsyncStub) -> None:
        super().__init__(inner)
        self.then: Callable[[], Awaitable[None]] | None = None
        self._due: Callable[[], Awaitable[None]] | None = None

    async def GetLoad(self, request: pb.GetLoadRequest, context: Context) -> Any:
        if self.then is not None:
            self._due, self.then = self.then, None
            await context.abort(grpc.StatusCode.CANCELLED, "the server is shutting down")
        return await self.inner.GetLoad(request)

    async def GetEngineInfo(self, request: pb.GetEngineInfoRequest, context: Context) -> Any:
        if self._due is not None:
            due, self._due = self._due, None
            await due()
        call = self.inner.GetEngineInfo(request)
        info = await call
        context.set_trailing_metadata(tuple(await call.trailing_metadata()))
        return info


S = TypeVar("S", bound=Forwarding)


@dataclass
class FrontedEngine(Generic[S]):
    """The front server (its `port` is what the controller dials) and the sim engine."""

    servicer: S
    server: grpc.aio.Server
    port: int
    inner: EngineApp
    channel: grpc.aio.Channel

    async def close(self) -> None:
        await self.server.stop(None)
        await self.channel.close()
        await self.inner.close()


async def start_fronted_engine(
    name: str,
    servicer_for: Callable[[pb_grpc.OpenEngineAsyncStub], S],
    time_scale: float = 0.0,
    port: int = 0,
    serve_also: Callable[[S, grpc.aio.Server, grpc.aio.Channel], None] | None = None,
    **config: Any,
) -> FrontedEngine[S]:
    """A sim engine named `name` (`time_scale`: its sim's; `config`: more EngineConfig
    fields) behind `servicer_for(stub of the sim engine)`, listening on `port` (0: any
    free one; an engine's old port: a new process at its address). `serve_also`: adds more
    services to the front server (such as `vllm.Generate`), given the OpenEngine servicer
    and the channel to the sim engine."""
    inner = await start_sim_engine(name, time_scale, **config)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{inner.port}")
    servicer = servicer_for(pb_grpc.OpenEngineStub(channel))
    server = grpc.aio.server()
    pb_grpc.add_OpenEngineServicer_to_server(servicer, server)
    if serve_also is not None:
        serve_also(servicer, server, channel)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return FrontedEngine(servicer, server, port, inner, channel)


@contextlib.asynccontextmanager
async def served_in_front_of(
    target: str, servicer_for: Callable[[pb_grpc.OpenEngineAsyncStub], S]
) -> AsyncIterator[tuple[S, str]]:
    """`servicer_for(stub of the server at target)` (a controller's gateway, say) served on a
    port of its own: the servicer and its address."""
    channel = grpc.aio.insecure_channel(target)
    servicer = servicer_for(pb_grpc.OpenEngineStub(channel))
    server = grpc.aio.server()
    pb_grpc.add_OpenEngineServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        await server.stop(None)
        await channel.close()
