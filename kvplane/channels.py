"""How every kvplane client dials a server: insecure, or TLS (mutual TLS with a client
certificate) from a `ClientTlsConfig`. The admin CLIs, the controller's channels to its
engines and to a remote indexer, and the OpenEngine KV-event sources all open their channels
here, so the credentials are built in one place.

`ClientChannels.load` reads and checks the PEM files (a missing or unusable file is a
one-line TlsFileError, a ConfigError saying which file); each channel it opens is dialled with
the files as they are then (`kvplane.client_tls`: a renewed client certificate or CA is used
from the next channel; a long-running client's `Redialling` dials again before its next
call). A `Redialling`'s channels each have a connection of its own, so that a client whose
call its server let time out can dial afresh (`Redialling.dial_afresh`: the connection may be
dead without a reset). Every channel pings a connection that has calls under way
(`KEEPALIVE_TIME_S`), so that a subscription on one gone silent ends instead of waiting for
ever. `with_metadata` adds metadata (a bearer token) to every call of its channels that
brings no `authorization` of its own (an interceptor, installed only then);
`with_token_file` adds the bearer token a client's setting names, its file followed as it
changes (`kvplane.token_file`: a token rotated on disk is sent from the next call).

`setting_hint` says which setting a failed call most likely lacks or has wrong (TLS, a client
certificate, a certificate's CA or name, a token, the server's address where nothing listens),
in the words of the client's own settings
(CLI flags, config keys); `failure_details` are a failed call's details as an operator reads
them, gRPC's trail of a TLS handshake that failed cut to OpenSSL's reason, with that hint.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Generic, NamedTuple, TypeVar

import grpc

from kvplane.client_tls import ClientTlsFiles
from kvplane.config import ClientTlsConfig
from kvplane.server import AUTH_METADATA_KEY, bearer_token_metadata
from kvplane.token_file import TokenFile

# What a channel reports when the server hangs up on it, as a TLS server does on plaintext and
# a mutual-TLS server on a client without a certificate.
HUNG_UP = "Socket closed"
# How a controller's status about one of its engines begins ("engine HOST:PORT ..."): a hang-up
# it names is that engine's (its process died), not one of the connection to the controller.
RELAYED_ENGINE_FAILURE = "engine "
# What a gRPC server (grpcio, as every kvplane server) answers for a method it does not have:
# the address is another kind of server (an indexer's, an engine's, for a controller's).
METHOD_NOT_FOUND = "Method not found!"
log = logging.getLogger(__name__)

ChannelOptions = tuple[tuple[str, Any], ...]
Metadata = tuple[tuple[str, str], ...]

# gRPC's own reconnect backoff grows (x1.6 from 1 s) to 120 s, and a channel in backoff fails
# every call at once: a peer back after a long outage (a controller for the planner, an engine
# for the planner or a decode engine, an indexer for a bridge) stayed unreachable for up to two
# minutes more. Every channel retries at least every 5 s (a few connection attempts a minute
# to a peer that stays down); a client with its own schedule sets it with `reconnecting`.
MAX_RECONNECT_BACKOFF_MS = 5000
# The longest wait between a channel's attempts to reconnect to a server that must be found
# again at once (`ClientChannels.reconnecting_promptly`): a controller's to its engines, whose
# return is seen as their channel connects (`reconnected`), and to a remote indexer, which
# every routed request asks. A connection attempt a second costs nothing (no call is made).
RECONNECT_MAX_S = 1.0

# Keepalive pings, so that a call under way on a connection gone silent without a reset (its
# peer's host gone, a NAT entry expired, a blackholed path) fails (UNAVAILABLE) within
# KEEPALIVE_TIME_S + KEEPALIVE_TIMEOUT_S, instead of waiting until the kernel gives up on the
# connection (some 15 minutes): a subscription that never ends (KV events, runtime events)
# noticed nothing before, and was never made again. Pinged only while calls are under way
# (gRPC's `keepalive_permit_without_calls` left off): a call made on an idle connection that
# went silent fails on its own deadline, and a `Redialling` client dials afresh then.
# Every 5 minutes: a server with gRPC's defaults (vLLM's gRPC server among them) takes a
# ping less than 5 minutes after the last, with nothing sent meanwhile, as a strike, and
# after two answers the third with GOAWAY `too_many_pings`, ending every call on the
# connection (a subscription to a quiet engine sends nothing for that long); kvplane's own
# servers take one a second (`kvplane.server.MIN_PING_INTERVAL_S`), for a client that sets
# its own with `keeping_alive`.
KEEPALIVE_TIME_S = 300.0
KEEPALIVE_TIMEOUT_S = 20.0


def _keepalive(time_s: float, timeout_s: float) -> ChannelOptions:
    timeout_ms = max(1, round(timeout_s * 1000))
    return (
        ("grpc.keepalive_time_ms", max(1, round(time_s * 1000))),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        # (gRPC 1.85 waits for a keepalive ping's answer as for any ping, 60 s by default,
        # whatever `keepalive_timeout_ms` says.)
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        # Any number of pings on a call that sends nothing (gRPC stops after two otherwise,
        # and a subscription sends nothing after its request).
        ("grpc.http2.max_pings_without_data", 0),
    )


_DEFAULT_OPTIONS: ChannelOptions = (
    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    *_keepalive(KEEPALIVE_TIME_S, KEEPALIVE_TIMEOUT_S),
)
_Stub = TypeVar("_Stub")


@dataclass(frozen=True)
class ClientChannels:
    """TLS files (None: insecure) and channel options for dialling servers."""

    # The TLS files the channels are dialled with (None: insecure), read again as they change.
    tls_files: ClientTlsFiles | None = None
    options: ChannelOptions = _DEFAULT_OPTIONS
    # Sent with every call that has no authorization of its own (a bearer token).
    metadata: Metadata = ()
    # The file of the bearer token every call carries (in place of `metadata`), read again
    # as it changes.
    token_file: TokenFile | None = None
    # Run on every call of the aio channels, after the metadata's (the controller's hop
    # header, `controller.hops`).
    interceptors: tuple[grpc.aio.ClientInterceptor, ...] = ()

    @classmethod
    def load(cls, tls: ClientTlsConfig | None, where: str = "") -> ClientChannels:
        """Insecure for None; else TLS from `tls`'s files, followed as they change. `where`
        ("engine_tls") prefixes the error of a missing or unusable file (a TlsFileError)."""
        if tls is None:
            return cls()
        options = _DEFAULT_OPTIONS
        if tls.server_name is not None:
            options = (*options, ("grpc.ssl_target_name_override", tls.server_name))
        return cls(ClientTlsFiles(tls, where), options)

    @property
    def tls(self) -> bool:
        return self.tls_files is not None

    @property
    def client_certificate(self) -> bool:
        """A client certificate is presented (mutual TLS)."""
        return self.tls_files is not None and self.tls_files.client_certificate

    def credentials(self) -> grpc.ChannelCredentials | None:
        """What a channel dialled now is dialled with (None: insecure): the TLS files as they
        are now, once they can be used."""
        return None if self.tls_files is None else self.tls_files.current()

    def dialled_with_old_files(self, credentials: grpc.ChannelCredentials | None) -> bool:
        """Whether a channel dialled with `credentials` (`credentials()` then) would be
        dialled otherwise now: the TLS files changed since, and can be used. A long-running
        client dials its server again then (`Redialling`: gRPC's channels keep the
        credentials they were made with, at every reconnection)."""
        return self.credentials() is not credentials

    @property
    def bearer_token(self) -> bool:
        """Its calls carry a bearer token."""
        return self.token_file is not None or any(
            key == AUTH_METADATA_KEY for key, _ in self.metadata
        )

    def reconnecting(self, initial_s: float, max_s: float) -> ClientChannels:
        """The same, with gRPC's reconnect backoff from `initial_s` up to `max_s`. gRPC's own
        grows to 120 s, and a channel in backoff fails every call at once: a server back after
        an outage of a few minutes stayed unreachable for up to two minutes more."""
        initial_ms, max_ms = max(1, round(initial_s * 1000)), max(1, round(max_s * 1000))
        return self.with_options(
            ("grpc.initial_reconnect_backoff_ms", min(initial_ms, max_ms)),
            ("grpc.max_reconnect_backoff_ms", max_ms),
        )

    def reconnecting_promptly(self, initial_s: float) -> ClientChannels:
        """The same, reconnecting from `initial_s` (at most `RECONNECT_MAX_S`) and then every
        `RECONNECT_MAX_S`: a server back is connected to within about a second."""
        return self.reconnecting(min(initial_s, RECONNECT_MAX_S), RECONNECT_MAX_S)

    def keeping_alive(self, time_s: float, timeout_s: float) -> ClientChannels:
        """The same, pinging a connection with calls under way every `time_s` and ending them
        (UNAVAILABLE) when a ping has no answer within `timeout_s`: sooner than the default
        (`KEEPALIVE_TIME_S`) for servers known to take pings that often."""
        return self.with_options(*_keepalive(time_s, timeout_s))

    def receiving_any_size(self) -> ClientChannels:
        """The same, taking replies of any size (gRPC's default stops at 4 MiB): a relay passes
        on whatever its servers send, and the clients it relays to set their own limits."""
        return self.with_options(("grpc.max_receive_message_length", -1))

    def with_options(self, *options: tuple[str, Any]) -> ClientChannels:
        """The same, with `options` in place of any option of the same name (one value for
        each: which of two duplicates gRPC would take is not documented)."""
        names = {name for name, _ in options}
        kept = tuple(option for option in self.options if option[0] not in names)
        return replace(self, options=(*kept, *options))

    def with_metadata(self, metadata: Metadata) -> ClientChannels:
        """The same, every call carrying `metadata` (in place of any token file's) unless it
        brings an authorization."""
        return replace(self, metadata=metadata, token_file=None)

    def with_token_file(self, token_file: Path | None, setting: str) -> ClientChannels:
        """The same, every call carrying the bearer token `token_file` holds when it is made
        (None: as it is); a ConfigError naming `setting` when the file cannot be read or is
        empty now."""
        if token_file is None:
            return self
        return replace(self, metadata=(), token_file=TokenFile(token_file, setting))

    def call_metadata(self) -> Metadata:
        """What a call without an authorization of its own carries now."""
        if self.token_file is None:
            return self.metadata
        return bearer_token_metadata(self.token_file.current())

    @property
    def _adds_metadata(self) -> bool:
        return bool(self.metadata) or self.token_file is not None

    def with_interceptors(
        self, interceptors: tuple[grpc.aio.ClientInterceptor, ...]
    ) -> ClientChannels:
        """The same, the aio channels' calls also passing through `interceptors`."""
        return replace(self, interceptors=(*self.interceptors, *interceptors))

    def aio_channel(self, target: str) -> grpc.aio.Channel:
        """A grpc.aio channel to `target` (HOST:PORT)."""
        interceptors = [
            *(
                aio_metadata_interceptors(partial(_with_default, default=self.call_metadata))
                if self._adds_metadata
                else ()
            ),
            *self.interceptors,
        ] or None
        credentials = self.credentials()
        if credentials is None:
            return grpc.aio.insecure_channel(
                target, options=list(self.options), interceptors=interceptors
            )
        return grpc.aio.secure_channel(
            target, credentials, options=list(self.options), interceptors=interceptors
        )

    def channel(self, target: str) -> grpc.Channel:
        """A synchronous channel to `target` (the CLIs)."""
        credentials = self.credentials()
        if credentials is None:
            channel = grpc.insecure_channel(target, options=list(self.options))
        else:
            channel = grpc.secure_channel(target, credentials, options=list(self.options))
        if not self._adds_metadata:
            return channel
        return grpc.intercept_channel(channel, _DefaultMetadata(self.call_metadata))


async def reconnected(channel: grpc.aio.Channel) -> None:
    """Return once `channel` connects (READY) after a time it was not connected: its server,
    down, answers connections again. The channel is asked to connect, which it does at its
    own reconnect backoff, no call made; one connected throughout (its server up, or hung with
    its port open) never returns, nor one closed. Cancelled, its wait stays in gRPC until
    the channel's state next changes: not for a channel connected now, whose state may stay
    for long."""
    state = channel.get_state(try_to_connect=True)
    while state is not grpc.ChannelConnectivity.SHUTDOWN:
        await channel.wait_for_state_change(state)
        state = channel.get_state(try_to_connect=True)
        if state is grpc.ChannelConnectivity.READY:
            return
    await asyncio.Event().wait()  # closed: never


class Redialling(Generic[_Stub]):
    """A long-running client's channel to one server (`target`) and the `stub` made on it,
    dialled again with its TLS files when they change: gRPC keeps a channel's credentials at
    every reconnection, so an expired client certificate, or a server certificate from a new
    CA, left the server unreachable until the client was restarted.

    `channel` and `stub` are what a new call is made on: each look checks the TLS files (a
    `stat` a file) and, once they changed and can be used (a rotation caught halfway keeps
    the channel it has), dials the server with them. The calls and streams already on the
    old channel finish there, however long they run (as a TLS connection keeps the session it
    was made with, in gRPC and Envoy alike): it is closed once the last of them ended. Each
    old channel is one connection (one fd) and the buffers of its calls, kept only as long as
    a call made before the renewal: a unary call or KV pull its deadline, a relayed generation
    its request; a subscription that never ends moves to the new channel itself
    (`dialled_again`, `kvplane.redialled_stream`). A call that failed with no connection up
    and files changed since (`after_failure`) closes its channel at once: nothing on it
    reaches the server. An old channel dialled past because a deadline passed on it
    (`dial_afresh(doubted=True)`) is kept open with its calls, not closing, until the client
    asks it whether its connection is alive (`check_doubted`): one that does not answer while
    the server answers on the new one is dead without a reset, and its calls are ended
    (`end_calls_on`) rather than left to wait for keepalive."""

    def __init__(
        self,
        channels: ClientChannels,
        target: str,
        stub: Callable[[grpc.aio.Channel], _Stub],
    ) -> None:
        # Each channel with a connection of its own (gRPC shares one between the channels of
        # a process to one address by default): `dial_afresh` would go on using the
        # connection gone silent otherwise.
        self._channels = channels.with_options(("grpc.use_local_subchannel_pool", 1))
        self.target = target
        self._make_stub = stub
        # Old channels closing as their calls end (`_follow_files`), each with its task.
        self._retiring: dict[grpc.aio.Channel, asyncio.Task[None]] = {}
        # Old channels whose connection is doubted, kept open with their calls until
        # `check_doubted` (or `redial`, `close`) decides.
        self._doubted: list[grpc.aio.Channel] = []
        # Set (and replaced) each time the server is dialled again (`dialled_again`).
        self._redialled = asyncio.Event()
        self._channel, self._stub = self._dial()

    def _dial(self) -> tuple[grpc.aio.Channel, _Stub]:
        self._dialled_with = self._channels.credentials()
        channel = self._channels.aio_channel(self.target)
        return channel, self._make_stub(channel)

    def _dial_again(self) -> grpc.aio.Channel:
        """Dial the server again (the TLS files as they are now); the old channel, for the
        caller to close."""
        old = self._channel
        self._channel, self._stub = self._dial()
        self._redialled.set()
        self._redialled = asyncio.Event()
        return old

    def dialled_again(self) -> asyncio.Event:
        """An event set once the server is dialled again after this call: renewed TLS files
        seen by a look at `channel` or `stub`, `after_failure`, `redial`."""
        return self._redialled

    @property
    def channel(self) -> grpc.aio.Channel:
        """The channel for a new call: dialled with the TLS files as they are now."""
        self._follow_files()
        return self._channel

    @property
    def stub(self) -> _Stub:
        """The stub for a new call, on `channel`."""
        self._follow_files()
        return self._stub

    def _follow_files(self) -> None:
        """Dial the server again when the TLS files changed since (a `stat` a file), the old
        channel closed in the background once its calls ended."""
        if not self._channels.dialled_with_old_files(self._dialled_with):
            return
        log.info("%s: dialling it with its renewed TLS files from now on", self.target)
        self.dial_afresh()

    def dial_afresh(self, doubted: bool = False) -> None:
        """Make new calls on a new channel, a new connection; the calls under way end on the
        old one, which is closed once they have. For a server that let a deadline pass: its
        connection may be gone without a reset (its host vanished, a NAT entry expired), and
        gRPC goes on sending there until the kernel gives up (some 15 minutes; keepalive pings
        only while calls are under way, and minutes apart, `KEEPALIVE_TIME_S`), while a new
        connection reaches the server at once if it is back. `doubted` (the deadline passed
        on the old connection): one still holding calls is kept open, not closing, until
        `check_doubted` asks it whether it is alive."""
        old = self._dial_again()
        if doubted and _holds_calls(old):
            self._doubted.append(old)
        else:
            self._retire_later(old)

    def _retire_later(self, old: grpc.aio.Channel) -> None:
        """Close `old` in the background once its calls have ended."""
        self._retiring[old] = asyncio.create_task(
            self._retire(old), name=f"close a channel to {self.target}"
        )

    @property
    def doubted(self) -> bool:
        """Whether an old channel, its connection doubted, waits for `check_doubted`."""
        return bool(self._doubted)

    async def check_doubted(
        self, answers: Callable[[grpc.aio.Channel], Awaitable[bool]]
    ) -> list[grpc.aio.Channel]:
        """Ask each doubted old channel (`dial_afresh`) whether its connection is alive:
        `answers(channel)`, a call on it answered. One that answers, or whose calls have all
        ended meanwhile, is closed once its calls end, as any old channel; those that do not
        are returned, still doubted, for `end_calls_on` (their connection is dead without a
        reset: their calls would wait for keepalive)."""
        silent = []
        for old in list(self._doubted):
            if _holds_calls(old) and not await answers(old):
                silent.append(old)
            elif old in self._doubted:  # (not ended by `redial` or `close` meanwhile)
                self._doubted.remove(old)
                self._retire_later(old)
        return [old for old in silent if old in self._doubted]

    async def end_calls_on(self, silent: list[grpc.aio.Channel]) -> None:
        """End every call on the doubted old channels `silent` (each fails as cancelled) and
        close them."""
        for old in silent:
            self._doubted.remove(old)
        for old in silent:
            await old.close()  # (not closing yet: a close without grace cancels its calls)

    async def _retire(self, old: grpc.aio.Channel) -> None:
        try:
            # (grpc.aio refuses new calls on a closing channel, waits `grace` for those under
            # way, and cancels them then: an infinite grace waits for them all.)
            await old.close(math.inf)
        finally:
            self._retiring.pop(old, None)

    def renewed(self) -> bool:
        """The channel has no connection up (a call on it just failed) and the TLS files
        changed since it was dialled."""
        return self._channel.get_state() is not grpc.ChannelConnectivity.READY and (
            self._channels.dialled_with_old_files(self._dialled_with)
        )

    async def redial(self) -> None:
        """Dial the server again (the TLS files as they are now), ending every call on the
        channel and on the old ones still closing; cancelled meanwhile, all the same."""
        old = self._dial_again()
        try:
            await self._close_retiring()
        finally:
            await old.close()

    async def after_failure(self) -> None:
        """When a call just failed for want of the files `renewed` since: dial again, and
        close the channel it failed on (it has no connection up)."""
        if self.renewed():
            log.info("%s: dialling it again with its renewed TLS files", self.target)
            await self._dial_again().close()

    async def _close_retiring(self) -> None:
        """Close the old channels at once, ending their calls: each one's close, waiting for
        them, goes on once they are cancelled. Not by cancelling the close: grpc.aio marks a
        channel closing before it waits, and a later close of a channel so marked returns at
        once, leaving its calls running (a relayed stream on a channel retired after a poll
        timed out outlived its engine's abandonment so). Cancelled meanwhile, all the same
        (their closes waited for with `asyncio.wait`: awaiting a task cancelled here raises
        CancelledError, and swallowing it swallowed this caller's own cancellation). A grpcio
        that keeps no record of a channel's calls (`_CALLS_RECORD`) leaves them running (a
        warning): their channels close as they end, never waited for here. The doubted ones
        (`dial_afresh`) with them."""
        for old in self._doubted:
            self._retire_later(old)
        self._doubted.clear()
        retiring, self._retiring = list(self._retiring.items()), {}
        running = [(old, task) for old, task in retiring if not _cancel_calls(old)]
        if running:
            # (Waited for, they would hold the caller until the last of them ended: an
            # engine's polls stopped behind its abandonment for a generation's whole length.)
            log.warning(
                "%s: this grpcio (%s) keeps no record of a channel's calls (%s): the calls "
                "on %d old channel(s) run on until they end, each channel closed then",
                self.target,
                grpc.__version__,
                _CALLS_RECORD,
                len(running),
            )
            self._retiring.update(running)
            retiring = [item for item in retiring if item not in running]
        try:
            if retiring:
                await asyncio.wait([task for _, task in retiring])
        finally:
            for old, task in retiring:
                task.cancel()  # (done by now, unless this caller was cancelled)
                await old.close()

    async def close(self) -> None:
        """Close the channel, and any old one at once (their calls end)."""
        try:
            await self._close_retiring()
        finally:
            await self._channel.close()


# Where a grpc.aio channel records its calls under way (grpcio 1.85; private, as it has no
# public record): `Redialling` cancels those on its old channels from it.
_CALLS_RECORD = "_active_calls"


class CallsHeard:
    """How many responses each call under way has brought so far, counted by whoever reads
    them (`heard`, per response; `forget` once the call ended): whether a channel's
    connection brought anything over a while (`of`, then `since`), which tells a congested
    connection from a dead one when a call made on it answers late (`Redialling.check_doubted`:
    a dead one brings nothing, a congested one goes on bringing its calls' responses, late)."""

    def __init__(self) -> None:
        self._counts: dict[object, int] = {}

    def heard(self, call: object) -> None:
        """`call` brought a response."""
        self._counts[call] = self._counts.get(call, 0) + 1

    def forget(self, call: object) -> None:
        """`call` ended."""
        self._counts.pop(call, None)

    def of(self, channel: grpc.aio.Channel) -> dict[object, int]:
        """What the calls under way on `channel` brought so far (`since` compares)."""
        calls = getattr(channel, _CALLS_RECORD, None) or ()
        return {call: self._counts.get(call, 0) for call in calls}

    def since(self, before: dict[object, int]) -> bool:
        """Whether one of the calls of `before` (`of`) brought a response since."""
        return any(self._counts.get(call, 0) > count for call, count in before.items())


def _holds_calls(channel: grpc.aio.Channel) -> bool:
    """Whether `channel` has calls under way (always, for a grpcio that keeps no record of
    them: `_CALLS_RECORD`)."""
    calls = getattr(channel, _CALLS_RECORD, None)
    return calls is None or bool(calls)


def _cancel_calls(channel: grpc.aio.Channel) -> bool:
    """Cancel every call under way on `channel`, from grpc.aio's own record of them (a
    close's grace cannot be cut short once it runs); False where this grpcio keeps no such
    record (`_CALLS_RECORD`, another version): nothing is cancelled."""
    calls = getattr(channel, _CALLS_RECORD, None)
    if calls is None:
        return False
    for call in list(calls):
        call.cancel()
    return True


@dataclass(frozen=True)
class ClientSettings:
    """How a client's user names its settings, for `setting_hint`: the one that turns TLS on
    ("--tls-ca", "live.controller_tls"), the client certificate's, and the bearer token's
    ("live.controller_token_file"; None: no hint about the token), the one overriding the
    name checked in the server's certificate ("--tls-server-name"), and the one giving the
    server's address ("--target"; None: no hint when nothing listens there)."""

    tls: str
    client_certificate: str
    token: str | None = None
    server_name: str | None = None
    address: str | None = None


# What a server with bearer-token authentication answers a call without the right token
# (kvplane's servers say UNAUTHENTICATED; PERMISSION_DENIED is the other code for it).
_REFUSED_TOKEN = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def setting_hint(
    channels: ClientChannels,
    code: grpc.StatusCode | None,
    details: str,
    settings: ClientSettings,
) -> str:
    """Which of `settings` a failed call (its status `code` and `details`) most likely lacks:
    " (...)" to append to its details, or "" when nothing is likely. A status a controller
    relays about one of its engines ("engine ADDRESS failed the Drain: ...") gets none: it
    is about the controller's settings, which its own message names."""
    if details.startswith(RELAYED_ENGINE_FAILURE):
        return ""
    if code in _REFUSED_TOKEN and settings.token is not None:
        if channels.bearer_token:
            return f" (not the server's token? check {settings.token})"
        return f" (a server requiring a token? give {settings.token})"
    if settings.address is not None and _refused(details):
        return f" (nothing listens there: start the server, or give {settings.address})"
    if settings.address is not None and _UNRESOLVED.match(details):
        return f" (a misspelt host? give {settings.address})"
    return _tls_hint(channels, details, settings)


def _refused(details: str) -> bool:
    """Whether a call could not connect because its server's port refused the connection
    (no process listens on it): gRPC's "failed to connect to all addresses; last error:
    UNKNOWN: ipv4:127.0.0.1:8100: Failed to connect to remote host: Connection refused"."""
    connect = _CONNECT_FAILED.search(details)
    return connect is not None and details.endswith(_CONNECTION_REFUSED)


def _tls_hint(channels: ClientChannels, details: str, settings: ClientSettings) -> str:
    """What a server that hung up on the connection most likely wants, or why a TLS handshake
    failed: a record that is not TLS (a plaintext server), a server certificate that does
    not verify (another CA, expired, for another name)."""
    if channels.tls and "WRONG_VERSION_NUMBER" in details:
        return f" (a plaintext server? leave out {settings.tls})"
    if _CERTIFICATE_UNVERIFIED in details:
        if _EXPIRED in details:
            return " (the server's certificate has expired: renew it)"
        if _NOT_YET_VALID in details:
            return " (the server's certificate is not valid yet: check both hosts' clocks)"
        return f" (a server certificate not signed by the CA of {settings.tls}?)"
    if _WRONG_NAME in details:
        override = f", or set {settings.server_name}" if settings.server_name else ""
        return (
            " (a server certificate for another name? give the server one for the host "
            f"dialled{override})"
        )
    if not _hung_up(details):
        return ""
    if not channels.tls:
        return f" (a TLS server? give {settings.tls})"
    if not channels.client_certificate:
        return f" (a server requiring a client certificate? give {settings.client_certificate})"
    return f" (a client certificate the server does not trust? check {settings.client_certificate})"


def _hung_up(details: str) -> bool:
    """Whether the server closed (or, as the connection was made, reset) the connection."""
    connect = _CONNECT_FAILED.search(details)
    return HUNG_UP in details or (
        connect is not None and _RESET.match(details, connect.end()) is not None
    )


def failure_details(
    channels: ClientChannels,
    code: grpc.StatusCode | None,
    details: str,
    settings: ClientSettings,
) -> str:
    """A failed call's `details` as an operator reads them: gRPC's account of a connection
    that could not be made cut to what to act on (`plain_details`), with the `setting_hint`.
    For streams that may be cut as they run (a relay's, a CLI's drain): a hang-up is put down
    to the settings only as the connection is made, not once the server answered (its
    process died, which a TLS hint would misread)."""
    if HUNG_UP in details and _CONNECT_FAILED.search(details) is None:
        return details
    return plain_details(details) + setting_hint(channels, code, details, settings)


# gRPC's account of a connection it could not make, as it begins, and of a TLS handshake that
# failed there: "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:9001:
# Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL
# routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: unable to get local issuer
# certificate: OK" (the reason, and for a certificate that did not verify, why).
_CONNECT_FAILED = re.compile(r"failed to connect to all addresses; last error: \w+: [^ ]+: ")
_CONNECTION_REFUSED = "Connection refused"
_HANDSHAKE_FAILED = re.compile(r"Tls handshake failed .*:OPENSSL_internal:(\w+)(?:: ([^:]*))?")
_CERTIFICATE_UNVERIFIED = "CERTIFICATE_VERIFY_FAILED"
_EXPIRED = "certificate has expired"
_NOT_YET_VALID = "certificate is not yet valid"
# What gRPC says of a server certificate whose names do not include the host dialled.
_WRONG_NAME = "Hostname Verification Check failed"
# What gRPC says of a server that answers in anything but HTTP/2: "Failed parsing HTTP/2
# (Expected SETTINGS frame as the first frame, got frame type 82)", the "type" being the
# answer's fourth byte (Redis's "-ERR ...": 82). An HTTP/1 server shows as such: its status
# line ("... (Trying to connect an http1.x server (HTTP status 400))"), or the HTML page that
# Python's HTTP servers, a /metrics address's included, send a request they cannot read
# ("<!DOCTYPE": 79).
_NOT_HTTP2 = "Failed parsing HTTP/2"
_HTTP1 = re.compile(r"http1\.x server|got frame type 79\)")
# What gRPC says of a server that takes the connection and sends nothing (a stopped or hung
# process, a service that waits for its client to speak first) when its connect timeout
# passes: a call without a deadline of its own (a drain, an index dump) fails so.
_SILENT = "connection attempt timed out before receiving SETTINGS frame"
# The same over TLS: the server sent nothing back to the client's handshake.
_SILENT_TO_HANDSHAKE = "Handshake read failed (Endpoint closing)"
# What gRPC says of a server that resets the connection on the client's first bytes, as an
# OpenSSL TLS server (a TLS proxy's port, say) does with plaintext: a hang-up too.
_RESET = re.compile(r"recvmsg:Connection reset by peer\b")
# The same as the TLS handshake begins: "Handshake read failed (recvmsg:Connection reset by
# peer (104))" (a server that is not TLS, or a firewall, dropping the client's hello).
_HANDSHAKE_RESET = re.compile(r"Handshake read failed \((recvmsg:Connection reset by peer\b.*)\)$")
# What gRPC says of a TLS server that does not offer HTTP/2 (ALPN): a TLS service, not gRPC.
_NO_ALPN = "Cannot check peer: missing selected ALPN property"
# What gRPC says of a target whose host does not resolve, by resolver: "errors resolving
# nope.invalid:8100: [field:hostname lookup error:address lookup failed for
# nope.invalid:8100: Domain name not found]" (its own), "DNS resolution failed for
# nope.invalid:8100: C-ares status is not ARES_SUCCESS qtype=A name=nope.invalid
# is_balancer=0: Domain name not found" (c-ares): the reason last.
_UNRESOLVED = re.compile(r"^(?:errors resolving|DNS resolution failed for) .*: ([^:\]]+)\]?$")


def plain_details(details: str) -> str:
    """`details` of a call that could not connect, as an operator reads them: "TLS handshake
    failed: CERTIFICATE_VERIFY_FAILED: certificate has expired", "TLS handshake failed: the
    server certificate's names do not include the host dialled", "the server closed the
    connection (Socket closed)", "the server answers HTTP/1, not gRPC (a /metrics address?)",
    "the server does not speak gRPC (another service listens there?)" (a Redis; over TLS, a
    server without HTTP/2), "the server reset the connection (...)" (also "... in the TLS
    handshake (...)"), "the server took the connection but did not answer (...)", "the host
    does not resolve (Domain name not found)"; any other details as they are."""
    unresolved = _UNRESOLVED.match(details)
    if unresolved is not None:
        return f"the host does not resolve ({unresolved.group(1)})"
    connect = _CONNECT_FAILED.search(details)
    if connect is None:
        return details
    cause = details[connect.end() :]
    handshake = _HANDSHAKE_FAILED.search(cause)
    if handshake is not None:
        reason, why = handshake.groups()
        # (The text after another reason than a verification's is OpenSSL's state, not why.)
        return f"TLS handshake failed: {reason}" + (
            f": {why}" if reason == _CERTIFICATE_UNVERIFIED and why else ""
        )
    if _WRONG_NAME in cause:
        return (
            "TLS handshake failed: the server certificate's names do not include the host dialled"
        )
    if cause == HUNG_UP:
        return f"the server closed the connection ({HUNG_UP})"
    if _RESET.match(cause):
        return f"the server reset the connection ({cause})"
    handshake_reset = _HANDSHAKE_RESET.match(cause)
    if handshake_reset is not None:
        return f"the server reset the connection in the TLS handshake ({handshake_reset.group(1)})"
    if cause.startswith(_NO_ALPN):
        return (
            "the server does not speak gRPC (a TLS service without HTTP/2: another listens there?)"
        )
    if cause.startswith(_NOT_HTTP2):
        if _HTTP1.search(cause):
            return "the server answers HTTP/1, not gRPC (a /metrics address?)"
        return "the server does not speak gRPC (another service listens there?)"
    if cause.startswith(_SILENT) or cause == _SILENT_TO_HANDSHAKE:
        return (
            "the server took the connection but did not answer (is its process hung, stopped "
            "or overloaded, or is it not a gRPC server? check it and its log)"
        )
    return details


# The metadata a channel adds to a call, as it is when the call is made (a token file's token
# changes as the file does).
DefaultMetadata = Callable[[], Metadata]


def _with_default(given: Any, default: DefaultMetadata) -> Metadata | None:
    """`default()` appended to a call's metadata, unless it has an authorization of its own
    (None: leave the call as it is)."""
    pairs = tuple((key, value) for key, value in (given or ()))
    if any(key == AUTH_METADATA_KEY for key, _ in pairs):
        return None
    return pairs + default()


class _CallDetails(
    NamedTuple(
        "_CallDetails",
        [
            ("method", str),
            ("timeout", float | None),
            ("metadata", Any),
            ("credentials", Any),
            ("wait_for_ready", bool | None),
            ("compression", Any),
        ],
    ),
    grpc.ClientCallDetails,
):
    """A synchronous call's details with other metadata (grpc.ClientCallDetails is
    abstract)."""


class _DefaultMetadata(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, metadata: DefaultMetadata) -> None:
        self._metadata = metadata

    def _details(self, details: Any) -> Any:
        metadata = _with_default(details.metadata, self._metadata)
        if metadata is None:
            return details
        return _CallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


def aio_metadata_interceptors(
    rewrite: Callable[[Any], Metadata | None],
) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for grpc.aio channels giving every call the metadata `rewrite` makes of
    its own (None: leave the call as it is). grpc.aio files each interceptor under the first
    kind it is (an `elif` chain), so one object of all four kinds would only see unary-unary
    calls: one of each."""
    return [
        _AioUnaryUnary(rewrite),
        _AioUnaryStream(rewrite),
        _AioStreamUnary(rewrite),
        _AioStreamStream(rewrite),
    ]


class _AioMetadata:
    def __init__(self, rewrite: Callable[[Any], Metadata | None]) -> None:
        self._rewrite = rewrite

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = self._rewrite(details.metadata)
        if metadata is None:
            return details
        return grpc.aio.ClientCallDetails(
            details.method,
            details.timeout,
            grpc.aio.Metadata(*metadata),
            details.credentials,
            details.wait_for_ready,
        )


class _AioUnaryUnary(_AioMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioUnaryStream(_AioMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioStreamUnary(_AioMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


class _AioStreamStream(_AioMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


INSECURE = ClientChannels()
