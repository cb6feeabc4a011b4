"""Request loops between controllers, found as HTTP proxies find theirs: a hop header.

A controller's gateway answers like an engine, so one controller may front another (a
hierarchical fleet: a regional controller in front of per-rack ones). Two that front each
other, directly or around a longer ring, would pass a request on forever. Every call a
controller makes to its engines carries `kvplane-via` metadata: one entry per controller the
request passed, in order, this one last. A controller that finds its own instance id among a
call's entries refuses it with FAILED_PRECONDITION naming the loop (`loop_problem`), which the
controllers on the way hand back to the client.

The ids a request passed reach the calls made for it through a context variable: `LoopGuard`
sets it in each gateway handler (wrapped once as it is registered: no server interceptor),
and the engine channels' interceptors (`via_interceptors`) read it, so no call site passes it
on by hand. A call made outside any gateway request (the fleet's polls, the admin API's)
carries none: it is no hop of a request.

GetEngineInfo is never refused: it forwards nothing, and it is how a controller recognises
another one (and itself, `controller.registry`) before any request can loop.
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

import grpc

from kvplane.channels import Metadata, aio_metadata_interceptors
from kvplane.request_decoding import Context

if TYPE_CHECKING:
    from kvplane.request_decoding import Handler


VIA_METADATA_KEY = "kvplane-via"
# Trailing metadata of a controller's GetEngineInfo: one entry per controller it fronts, its
# own engines' and theirs in turn (`Registry.fronted_controller_ids`), so that a controller
# about to front it sees a ring before any request runs around it.
FRONTS_METADATA_KEY = "kvplane-fronts"
# The gateway methods that never pass a call on (see the module docstring).
_NEVER_FORWARDED = frozenset({"GetEngineInfo"})

# The controllers the request being served passed before this one, in order; None outside
# any gateway request (the fleet's polls, the admin API's calls).
_passed: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar(
    "kvplane_via", default=None
)


def metadata_values(metadata: Iterable[tuple[str, Any]] | None, key: str) -> tuple[str, ...]:
    """Every value of `key` in call metadata, in order (bytes values decoded)."""
    return tuple(
        value.decode() if isinstance(value, bytes) else str(value)
        for k, value in (metadata or ())
        if k == key
    )


def loop_problem(own_id: str, passed: tuple[str, ...]) -> str | None:
    """Why a call that passed the controllers `passed` must not be served by `own_id`, or
    None."""
    if own_id not in passed:
        return None
    ring = " -> ".join((*passed[passed.index(own_id) :], own_id))
    return (
        f"request loop between controllers: {ring} (instance ids; kvplane-via). Controllers "
        "that front each other pass a request on forever: remove one from the other's engines"
    )


class LoopGuard:
    """Wraps the gateway services' method handlers as they are registered
    (`kvplane.server.create_server`'s `handler_wrapper`): a call that passed this controller
    already is refused; the others are served with the controllers they passed in `_passed`.
    `services`: the full names of the services whose calls may be passed on to engines."""

    def __init__(self, own_id: str, services: Iterable[str]) -> None:
        self._own_id = own_id
        self._prefixes = tuple(f"/{name}/" for name in services)

    def __call__(self, method: str, handler: Handler) -> Handler:
        if not method.startswith(self._prefixes) or method.rpartition("/")[2] in _NEVER_FORWARDED:
            return handler
        if handler.unary_stream is not None:
            # grpc's stubs type the sync server's behaviours; a grpc.aio server's are async
            # generators here (every gateway stream yields its responses).
            behaviour_stream = cast(
                Callable[[Any, Context], AsyncIterator[Any]], handler.unary_stream
            )

            async def stream(request: Any, context: Context) -> AsyncIterator[Any]:
                await self._enter(context)
                async for response in behaviour_stream(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(
                stream, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_unary is None:
            return handler  # (request streams: no kvplane service takes one)
        behaviour = cast(Callable[[Any, Context], Awaitable[Any]], handler.unary_unary)

        async def unary(request: Any, context: Context) -> Any:
            await self._enter(context)
            return await behaviour(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary, handler.request_deserializer, handler.response_serializer
        )

    async def _enter(self, context: Context) -> None:
        """Refuse a looping call; note which controllers the others passed. (Each call runs
        in a task of its own, whose context ends with it: nothing to reset.)"""
        passed = metadata_values(context.invocation_metadata(), VIA_METADATA_KEY)
        problem = loop_problem(self._own_id, passed)
        if problem is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        _passed.set(passed)


def via_metadata(own_id: str) -> tuple[tuple[str, str], ...]:
    """The hop entries of a call this controller makes now for a gateway request: those the
    request brought, then its own; nothing outside one: a poll is no hop of a request (and
    a poll of the controller's own address must reach GetEngineInfo's check, "this is the
    controller itself", rather than be refused as a loop)."""
    passed = _passed.get()
    if passed is None:
        return ()
    return tuple((VIA_METADATA_KEY, hop) for hop in (*passed, own_id))


def via_interceptors(own_id: str) -> tuple[grpc.aio.ClientInterceptor, ...]:
    """For the channels to engines: every call carries `via_metadata(own_id)` after its own."""

    def with_via(given: Any) -> Metadata | None:
        via = via_metadata(own_id)
        return (*(given or ()), *via) if via else None

    return tuple(aio_metadata_interceptors(with_via))
