"""gRPC server scaffolding shared by every kvplane server.

`create_server(config, services)` builds a `grpc.aio` server with the given servicers, the
standard health service and reflection, optional TLS/mTLS (its files followed as they change,
`kvplane.server_tls`) and an optional bearer token (likewise, `kvplane.token_file`); it binds
and returns `(server, port)` so tests can bind port 0; it takes its clients' keepalive pings
as often as every second (`MIN_PING_INTERVAL_S`). `serve_until_signal` runs a started
server until SIGTERM/SIGINT and stops it gracefully. Servicers stay thin over a core object and
report domain errors through `abort_with`, never as a traceback.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvplane.config import ServerConfig, join_host_port, parse_host_port
from kvplane.errors import ConfigError
from kvplane.request_decoding import TolerantRegistration
from kvplane.server_tls import server_credentials
from kvplane.token_file import TokenFile

if TYPE_CHECKING:
    from kvplane.request_decoding import HandlerWrapper

log = logging.getLogger(__name__)

AUTH_METADATA_KEY = "authorization"

# Keepalive pings taken from a client as often as every second, calls under way or not: gRPC's
# defaults take one less than 5 minutes after the last (2 hours with no call under way), with
# nothing sent meanwhile, as a strike, and answer the third with GOAWAY `too_many_pings`,
# ending every call on the connection (a KV-event subscription to a quiet engine sends nothing
# for minutes). Kvplane's clients ping every `kvplane.channels.KEEPALIVE_TIME_S` unless told
# otherwise (the controller's `health.keepalive_s`); a ping costs the server a frame.
MIN_PING_INTERVAL_S = 1.0
_KEEPALIVE_TAKEN = (
    ("grpc.http2.min_ping_interval_without_data_ms", round(MIN_PING_INTERVAL_S * 1000)),
    ("grpc.keepalive_permit_without_calls", 1),
)


def bearer_token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata a client sends for `BearerTokenInterceptor`; empty without a token."""
    return ((AUTH_METADATA_KEY, f"Bearer {token}"),) if token else ()


@dataclass(frozen=True)
class Service:
    """One servicer to register: its full name (for health and reflection), the function
    that adds it to a server, which of its methods need the token without `protect_reads`:
    those that change state (and a check that a caller may call them), and which refuse a
    request carrying fields outside their schema, INVALID_ARGUMENT before the servicer runs
    (`kvplane.request_decoding`): those for which an option of a newer proto, dropped
    unseen, would change what the call does. `reports_own_health`: its `grpc.health.v1`
    status is its servicer's to set, on the health servicer given to `create_server`
    before the server starts (else SERVING once it starts)."""

    name: str
    add_to_server: Callable[[grpc.aio.Server], None]
    guarded_methods: frozenset[str] = field(default_factory=frozenset)
    strict_methods: frozenset[str] = field(default_factory=frozenset)
    reports_own_health: bool = False

    def method_path(self, method: str) -> str:
        return f"/{self.name}/{method}"


class ServiceHealth:
    """A service's `grpc.health.v1` status (`Service.reports_own_health`) kept to
    `serving()`: `update` sets it now (call it before the server starts, so a probe never
    reads SERVING too early); `changed` sets it again after a change, from sync code too,
    once for a burst of changes (the update reads `serving()` when it runs)."""

    def __init__(
        self,
        health_servicer: health.aio.HealthServicer,
        name: str,
        serving: Callable[[], bool],
    ) -> None:
        self._health_servicer = health_servicer
        self._name = name
        self._serving = serving
        self._update_due = False
        self._updates: set[asyncio.Task[None]] = set()

    def changed(self) -> None:
        if self._update_due:
            return
        self._update_due = True
        update = asyncio.create_task(self.update())
        self._updates.add(update)
        update.add_done_callback(self._updates.discard)

    async def update(self) -> None:
        self._update_due = False
        status = health_pb2.HealthCheckResponse.NOT_SERVING
        if self._serving():
            status = health_pb2.HealthCheckResponse.SERVING
        await self._health_servicer.set(self._name, status)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects protected RPCs without `authorization: Bearer <token>` as UNAUTHENTICATED. The
    token is the one its file holds at each call: rotated on disk, it takes effect at once.
    The scheme's case does not matter (`bearer` too: RFC 7235 and 6750, as clients and
    proxies send it); the token's does, compared in constant time."""

    def __init__(self, token: TokenFile, protected: Callable[[str], bool]) -> None:
        self._token = token
        self._protected = protected

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = handler_call_details.method
        if not self._protected(method):
            return await continuation(handler_call_details)
        presented = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_METADATA_KEY:
                presented = value.encode() if isinstance(value, str) else value
        scheme, _, token = presented.partition(b" ")
        expected = self._token.current().encode()
        if scheme.lower() == b"bearer" and hmac.compare_digest(token, expected):
            return await continuation(handler_call_details)
        return _unauthenticated_handler(await continuation(handler_call_details))


def _unauthenticated_handler(
    handler: grpc.RpcMethodHandler[Any, Any] | None,
) -> grpc.RpcMethodHandler[Any, Any]:
    message = "missing or invalid bearer token (metadata 'authorization: Bearer <token>')"

    async def unary(_request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(_request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    deserializer = getattr(handler, "request_deserializer", None)
    serializer = getattr(handler, "response_serializer", None)
    if handler is not None and handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, deserializer, serializer)
    return grpc.unary_unary_rpc_method_handler(unary, deserializer, serializer)


async def create_server(
    config: ServerConfig,
    services: Iterable[Service],
    *,
    options: Iterable[tuple[str, Any]] = (),
    handler_wrapper: HandlerWrapper | None = None,
    health_servicer: health.aio.HealthServicer | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Build, bind and start a server for `services`; returns it with the bound port.
    `handler_wrapper` wraps each of their methods' handlers as they are registered (see
    `TolerantRegistration`: calls pay no interceptor).

    Health reports SERVING for the empty service name and every registered service once the
    server starts (but those that report their own, `Service.reports_own_health`); pass
    `health_servicer` to change a service's status later.
    """
    services = list(services)
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if config.auth is not None:
        token = TokenFile(config.auth.token_file, "auth.token_file")
        guarded = {s.method_path(m) for s in services for m in s.guarded_methods}
        protect_reads = config.auth.protect_reads
        infrastructure = ("/grpc.health.v1.Health/", "/grpc.reflection.")

        def protected(method: str) -> bool:
            if method.startswith(infrastructure):
                return False
            return protect_reads or method in guarded

        interceptors.append(BearerTokenInterceptor(token, protected))
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[("grpc.so_reuseport", 0), *_KEEPALIVE_TAKEN, *options],
    )
    if health_servicer is None:
        health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    strict = {s.method_path(m) for s in services for m in s.strict_methods}
    registration = cast(grpc.aio.Server, TolerantRegistration(server, handler_wrapper, strict))
    for service in services:
        service.add_to_server(registration)
    names = [s.name for s in services]
    reflection.enable_server_reflection(
        [
            *names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    host, port = parse_host_port(config.listen)
    check_bindable(config.listen, host, port)
    address = join_host_port(host, port)
    try:
        if config.tls is not None:
            bound = server.add_secure_port(address, server_credentials(config.tls))
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise ConfigError(f"cannot listen on {config.listen}: {exc}") from exc
    if bound == 0:
        raise ConfigError(f"cannot listen on {config.listen}")
    await server.start()
    serving = health_pb2.HealthCheckResponse.SERVING
    for name in ["", *(s.name for s in services if not s.reports_own_health)]:
        await health_servicer.set(name, serving)
    log.info("serving %s on %s:%d", ", ".join(names) or "health", host, bound)
    return server, bound


def read_server_files(config: ServerConfig) -> None:
    """Read the files `create_server` reads for `config` (its TLS certificate, key and CA
    files, its auth token file), as it reads them; a ConfigError naming the setting of the
    first that is missing or cannot be used: for a check before the server starts."""
    if config.tls is not None:
        server_credentials(config.tls)
    if config.auth is not None:
        TokenFile(config.auth.token_file, "auth.token_file")


def check_bindable(listen: str, host: str, port: int) -> None:
    """Refuse a port another process holds, or one this user may not bind, in one line, by
    binding it and closing it at once (so `kvplane up` also checks its members' ports with it
    before starting any). gRPC would log a line of its own on stderr first (from its C core,
    whatever our logging says) and then raise only "Failed to bind"; a plain socket says why.
    Other failures (an address family the host lacks for one of a name's addresses) are left
    to gRPC, which binds what it can."""
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return  # gRPC reports a name it cannot resolve
    for family, kind, proto, _name, sockaddr in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                    raise ConfigError(f"cannot listen on {listen}: {exc.strerror}") from None


def write_port_file(path: Path | None, port: int) -> None:
    """Publish the bound port atomically (readers, such as `kvplane up` and tests, never see
    a partial file). The CLI checked the folder before serving (`PortFileOption`); one that
    went away since is a ConfigError of one line."""
    if path is None:
        return
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        partial.write_text(f"{port}\n")
        partial.replace(path)
    except OSError as exc:
        raise ConfigError(f"cannot write --port-file {path}: {exc.strerror}") from exc


async def publish_port(server: grpc.aio.Server, path: Path | None, port: int) -> None:
    """`write_port_file` for a server that is serving already. One whose port cannot be
    written (a folder not writable) is stopped before the error goes up: left running, it
    would be torn down at exit by grpc's finaliser on a closed event loop, with a traceback
    after the error line."""
    try:
        write_port_file(path, port)
    except ConfigError:
        await server.stop(None)
        raise


async def serve_until_signal(
    server: grpc.aio.Server,
    grace_s: float,
    on_stop: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Wait for SIGTERM or SIGINT (or the server ending), then stop gracefully."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        waiter = asyncio.ensure_future(server.wait_for_termination())
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        log.info("shutting down (grace %.1fs)", grace_s)
        if on_stop is not None:
            await on_stop()
        await server.stop(grace_s)
        waiter.cancel()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


# The most UTF-8 bytes of a status message. gRPC sends the message percent-encoded in a
# trailer (up to 3 bytes a byte), and a client drops a call whose trailers pass its metadata
# limit (8 KiB by default), reporting RESOURCE_EXHAUSTED "Stream removed" in place of the real
# status. Messages quote what the client sent (a model name, an id), which can be any length.
MAX_STATUS_MESSAGE_BYTES = 1024
_ELISION = " ... "


def status_message(message: str) -> str:
    """`message`, cut in the middle to at most MAX_STATUS_MESSAGE_BYTES of UTF-8: the head
    says what was wrong and the tail often how to fix it, a quoted value between them is what
    grows."""
    encoded = message.encode()
    if len(encoded) <= MAX_STATUS_MESSAGE_BYTES:
        return message
    keep = (MAX_STATUS_MESSAGE_BYTES - len(_ELISION)) // 2
    # errors="ignore" drops a character cut in two at either edge.
    head = encoded[:keep].decode(errors="ignore")
    tail = encoded[-keep:].decode(errors="ignore")
    return head + _ELISION + tail


async def abort_with(
    context: grpc.aio.ServicerContext[Any, Any], code: grpc.StatusCode, message: str
) -> NoReturn:
    """Abort the RPC with `code` and a one-line message (never a traceback), shortened by
    `status_message` so that every client receives the status."""
    await context.abort(code, status_message(message))
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover
