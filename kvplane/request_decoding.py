"""A request the server cannot parse is INVALID_ARGUMENT, as every other bad request.

gRPC parses a request before the servicer runs; when that fails (protobuf refuses messages
nested deeper than 100, which a `google.protobuf.Struct` of a few dozen levels reaches), grpc
answers UNKNOWN "Unexpected <class 'DecodeError'>", the status of a server bug.
`DecodeErrorInterceptor` gives every unary-request method a deserializer that turns the
failure into an `Undecodable` request, and a behaviour that refuses that one with
INVALID_ARGUMENT before the servicer sees it. Every kvplane service takes one request message
per call, so request streams are left as they are.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import grpc
from google.protobuf.message import DecodeError

Context = grpc.aio.ServicerContext[Any, Any]
if TYPE_CHECKING:
    Handler = grpc.RpcMethodHandler[Any, Any]


@dataclass(frozen=True, slots=True)
class Undecodable:
    """What the tolerant deserializer returns for bytes that do not parse."""

    error: str


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            return Undecodable(str(exc))

    return deserialize


async def _refuse(context: Context, request: Undecodable) -> None:
    # protobuf's message is one short line (the type and the reason).
    message = f"the request does not parse: {request.error}"
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)


def _refusing(handler: Handler) -> Handler:
    """`handler` with the tolerant deserializer, refusing an `Undecodable` request."""
    deserializer = _tolerant(handler.request_deserializer)
    if handler.unary_stream is not None:
        # grpc's stubs type the sync server's behaviours; a grpc.aio server's are async.
        behaviour_stream = cast(Callable[[Any, Context], AsyncIterator[Any]], handler.unary_stream)

        async def stream(request: Any, context: Context) -> AsyncIterator[Any]:
            if isinstance(request, Undecodable):
                await _refuse(context, request)
            async for response in behaviour_stream(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(
            stream, deserializer, handler.response_serializer
        )
    behaviour = cast(Callable[[Any, Context], Awaitable[Any]], handler.unary_unary)

    async def unary(request: Any, context: Context) -> Any:
        if isinstance(request, Undecodable):
            await _refuse(context, request)
        return await behaviour(request, context)

    return grpc.unary_unary_rpc_method_handler(unary, deserializer, handler.response_serializer)


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a request that does not parse with INVALID_ARGUMENT (see the module). Nothing
    is cached per method: an interceptor before this one (the bearer token's) decides per
    call."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler  # unknown methods are UNIMPLEMENTED; request streams: see above
        return _refusing(handler)
