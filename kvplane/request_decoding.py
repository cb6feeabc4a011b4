"""A request the server cannot parse is INVALID_ARGUMENT, as every other bad request; so is
one carrying fields its schema lacks, on the methods a service declares strict.

gRPC parses a request before the servicer runs; when that fails (protobuf refuses messages
nested deeper than 100, which a `google.protobuf.Struct` of a few dozen levels reaches), grpc
answers UNKNOWN "Unexpected <class 'DecodeError'>", the status of a server bug.
`TolerantRegistration` gives every unary-request method, once as the servicer is added to
the server, a deserializer that turns the failure into an `Undecodable` request and a
behaviour that refuses that one with INVALID_ARGUMENT before the servicer sees it. Every
kvplane service takes one request message per call, so request streams are left as they
are.

A strict method (`kvplane.server.Service.strict_methods`) also refuses, the same way, a
request holding fields outside its schema (`kvplane.unknown_fields`): an option of a newer
revision of the proto that this server would otherwise drop unseen, serving the request as
if it had not been sent. Which methods are strict is each service's call (docs/engine.md,
"Fields a server does not know").
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import grpc
from google.protobuf.message import DecodeError

from kvplane.unknown_fields import unknown_fields

Context = grpc.aio.ServicerContext[Any, Any]
if TYPE_CHECKING:
    Handler = grpc.RpcMethodHandler[Any, Any]
    # A server's own wrapping of a method's handler (by the method's full path), applied
    # under the tolerant one (e.g. `controller.hops.LoopGuard`).
    HandlerWrapper = Callable[[str, Handler], Handler]


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


def _refusal(request: Any, method: str, strict: bool) -> str | None:
    """Why `request` to `method` is refused before its servicer sees it, or None."""
    if isinstance(request, Undecodable):
        # protobuf's message is one short line (the type and the reason).
        return f"the request does not parse: {request.error}"
    if strict:
        unknown = unknown_fields(request)
        if unknown:
            name = method.lstrip("/").replace("/", ".")
            return (
                f"fields this server's {name} does not have: {', '.join(unknown)} (options "
                "of a newer revision of its proto are refused rather than ignored)"
            )
    return None


def _refusing(handler: Handler, method: str, strict: bool) -> Handler:
    """`handler` with the tolerant deserializer, refusing an `Undecodable` request and, when
    `strict`, one with fields its schema lacks."""
    deserializer = _tolerant(handler.request_deserializer)
    if handler.unary_stream is not None:
        # grpc's stubs type the sync server's behaviours; a grpc.aio server's are async.
        behaviour_stream = cast(Callable[[Any, Context], AsyncIterator[Any]], handler.unary_stream)

        async def stream(request: Any, context: Context) -> AsyncIterator[Any]:
            refusal = _refusal(request, method, strict)
            if refusal is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal)
            async for response in behaviour_stream(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(
            stream, deserializer, handler.response_serializer
        )
    behaviour = cast(Callable[[Any, Context], Awaitable[Any]], handler.unary_unary)

    async def unary(request: Any, context: Context) -> Any:
        refusal = _refusal(request, method, strict)
        if refusal is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal)
        return await behaviour(request, context)

    return grpc.unary_unary_rpc_method_handler(unary, deserializer, handler.response_serializer)


class TolerantRegistration:
    """The server as a servicer's `add_*_to_server` sees it: every method handler it
    registers (registered or generic) is wrapped once, here, to refuse a request that does
    not parse, or one with unknown fields to a method of `strict` (full paths, see the
    module), so calls pay no interceptor; a `wrapper` of the server's own is applied under it
    the same way. Anything else is the server's."""

    def __init__(
        self,
        server: grpc.aio.Server,
        wrapper: HandlerWrapper | None = None,
        strict: Collection[str] = (),
    ) -> None:
        self._server = server
        self._wrapper = wrapper
        self._strict = frozenset(strict)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Handler]) -> None:
        tolerant = {
            method: self.wrapped(f"/{service}/{method}", h) for method, h in handlers.items()
        }
        self._server.add_registered_method_handlers(service, tolerant)

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers([_TolerantGeneric(h, self.wrapped) for h in handlers])

    def wrapped(self, method: str, handler: Handler) -> Handler:
        """`handler` of `method` as the server runs it."""
        if self._wrapper is not None:
            handler = self._wrapper(method, handler)
        if handler.request_streaming:  # every kvplane service takes one request
            return handler
        return _refusing(handler, method, method in self._strict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


class _TolerantGeneric(grpc.GenericRpcHandler):
    """A generic handler whose method handlers refuse what does not parse; each wrapped once
    (a generated service's generic handler answers every call of a method with one handler)."""

    def __init__(
        self, inner: grpc.GenericRpcHandler, wrapped: Callable[[str, Handler], Handler]
    ) -> None:
        self._inner = inner
        self._wrap = wrapped
        self._wrapped: dict[str, tuple[Handler, Handler]] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Handler | None:
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        known = self._wrapped.get(method)
        if known is None or known[0] is not handler:
            known = (handler, self._wrap(method, handler))
            self._wrapped[method] = known
        return known[1]
