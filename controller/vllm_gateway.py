"""The gateway's `vllm.Generate` surface: the same routing as OpenEngine Generate, for
clients of vLLM's gRPC front end. The chosen engine's own `vllm.Generate` service (served on
the same port as its OpenEngine service) answers; the response is relayed unchanged. A failure
before anything was relayed is retried once on another engine; later, the status passes
through (this API has no in-band error event)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from controller.router import NoEngineAvailableError
from controller.service import Controller, PromptInput
from kvplane.server import abort_with
from vllm_grpc import vllm_grpc_pb2 as vpb
from vllm_grpc import vllm_grpc_pb2_grpc as vpb_grpc

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]
_RETRYABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNKNOWN}
)


class VllmGatewayServicer(vpb_grpc.GenerateServicer):
    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> vpb_grpc.GenerateAsyncStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address)
        return vpb_grpc.GenerateStub(channel)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    async def Generate(
        self, request: vpb.GenerateRequest, context: Context
    ) -> vpb.GenerateResponse:
        last: vpb.GenerateResponse | None = None
        async for response in self._relay(request, context, unary=True):
            last = response
        assert last is not None
        return last

    async def GenerateStream(
        self, request: vpb.GenerateRequest, context: Context
    ) -> AsyncIterator[vpb.GenerateResponse]:
        async for response in self._relay(request, context, unary=False):
            yield response

    async def _relay(
        self, request: vpb.GenerateRequest, context: Context, *, unary: bool
    ) -> AsyncIterator[vpb.GenerateResponse]:
        c = self.controller
        which = request.WhichOneof("prompt")
        query = PromptInput(
            request_id=request.request_id,
            prompt=request.text if which == "text" else None,
            token_ids=tuple(request.token_ids.ids) if which == "token_ids" else None,
            model=request.model,
            cache_salt=request.kv.cache_salt,
        )
        plan = await c.plan(query)
        tried: set[str] = set()
        for attempt in range(2):
            try:
                decision = c.route(plan, frozenset(tried))
            except NoEngineAvailableError as exc:
                await abort_with(context, grpc.StatusCode.UNAVAILABLE, str(exc))
            tried.add(decision.engine_id)
            relayed = False
            try:
                stub = self._stub(decision.engine_id)
                if unary:
                    reply = await stub.Generate(request)
                    relayed = True
                    yield reply
                else:
                    async for response in stub.GenerateStream(request):
                        if not relayed:
                            c.router.first_token(request.request_id)
                        relayed = True
                        yield response
                return
            except grpc.aio.AioRpcError as exc:
                if not relayed and attempt == 0 and exc.code() in _RETRYABLE:
                    log.info("vllm request %s: %s failed (%s); retrying elsewhere",
                             request.request_id, decision.engine_id, exc.code().name)  # fmt: skip
                    continue
                await abort_with(context, exc.code(), exc.details() or exc.code().name)
            finally:
                c.router.finish(request.request_id)
        await abort_with(context, grpc.StatusCode.UNAVAILABLE, "no engine could take the request")
