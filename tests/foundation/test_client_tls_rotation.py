"""A client's TLS files followed as they change (`kvplane.client_tls`): each channel is
dialled with the files as they are then, so a client certificate or CA bundle renewed on disk
is used without a restart, and a rotation caught halfway keeps the files read before. A real
mutual-TLS server on 127.0.0.1, openssl-made certificates (the `pki` fixture)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import kvplane.channels
from kvplane.channels import ClientChannels, Redialling
from kvplane.config import ClientTlsConfig, ServerConfig, TlsConfig
from kvplane.errors import ConfigError
from kvplane.redialled_stream import MAX_UNMATCHED, redialled_stream
from kvplane.server import create_server
from kvplane.server_tls import server_credentials
from tests.rotation import replace_file

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def mutual_tls_port(pki: Path) -> AsyncIterator[int]:
    tls = TlsConfig(
        cert_file=pki / "server.pem", key_file=pki / "server.key", client_ca_file=pki / "ca.pem"
    )
    server, port = await create_server(ServerConfig(listen="127.0.0.1:0", tls=tls), [])
    yield port
    await server.stop(None)


async def health_check(channels: ClientChannels, port: int) -> str:
    """A new channel's Health check: "SERVING", or the failed call's details."""
    async with channels.aio_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
        except grpc.aio.AioRpcError as exc:
            return exc.details() or ""
    status: str = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return status


async def test_a_renewed_client_certificate_is_presented_by_the_next_channel(
    pki: Path, tmp_path: Path, mutual_tls_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A certificate the server does not trust, renewed on disk with one it does: the next
    channel presents the new one, the same ClientChannels (no restart). Caught halfway (the
    certificate written, not yet its key), the files read before are used, with a warning.
    (The files were read once, at start: every channel presented the old certificate.)"""
    cert, key = tmp_path / "client.pem", tmp_path / "client.key"
    cert.write_bytes((pki / "other-ca-client.pem").read_bytes())
    key.write_bytes((pki / "other-ca-client.key").read_bytes())
    tls = ClientTlsConfig(ca_file=pki / "ca.pem", cert_file=cert, key_file=key)
    channels = ClientChannels.load(tls, "engine_tls")
    assert await health_check(channels, mutual_tls_port) != "SERVING"
    replace_file(cert, (pki / "client.pem").read_bytes())
    with caplog.at_level(logging.WARNING, logger="kvplane.tls_files"):
        assert await health_check(channels, mutual_tls_port) != "SERVING"
    assert f"engine_tls: TLS key file {key} cannot be used with certificate {cert}" in caplog.text
    assert "dialling with the files read before" in caplog.text
    replace_file(key, (pki / "client.key").read_bytes())
    assert await health_check(channels, mutual_tls_port) == "SERVING"


async def test_a_renewed_ca_file_verifies_the_next_channels_server(
    pki: Path, tmp_path: Path, mutual_tls_port: int
) -> None:
    """A CA bundle replaced on disk (the server's certificate now from the CA it holds)
    verifies the server from the next channel on."""
    ca = tmp_path / "ca.pem"
    ca.write_bytes((pki / "other-ca.pem").read_bytes())
    tls = ClientTlsConfig(ca_file=ca, cert_file=pki / "client.pem", key_file=pki / "client.key")
    channels = ClientChannels.load(tls)
    assert "CERTIFICATE_VERIFY_FAILED" in await health_check(channels, mutual_tls_port)
    replace_file(ca, (pki / "ca.pem").read_bytes())
    assert await health_check(channels, mutual_tls_port) == "SERVING"


def test_a_ca_file_openssl_cannot_load_is_a_config_error_naming_it(tmp_path: Path) -> None:
    """A CA file with a PEM header and no certificate in it is refused at start, as one
    without any is, rather than failing every handshake."""
    ca = tmp_path / "ca.pem"
    ca.write_text(
        "-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n"
    )
    with pytest.raises(ConfigError, match=rf"^engine_tls: TLS CA file {ca} holds no usable "):
        ClientChannels.load(ClientTlsConfig(ca_file=ca), "engine_tls")


class PeerStub:
    """The client of `peer_server`: `Name`, the common name of the client certificate the
    server saw on the call's connection; `Count`, a stream of b"1", then (once the server's
    `go_on` is set) b"2"; `Events`, a subscription to what the server publishes."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.Name: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
            "/test.Peer/Name"
        )
        self.Count: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(
            "/test.Peer/Count"
        )
        self.Events: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(
            "/test.Peer/Events"
        )


class PeerServer:
    """A mutual-TLS server on 127.0.0.1 (`kvplane.server_tls`: its files followed as they
    change) answering `PeerStub`'s calls."""

    def __init__(self, tls: TlsConfig) -> None:
        self.go_on = asyncio.Event()
        # The `Events` subscriptions open, oldest first.
        self.subscriptions: list[asyncio.Queue[bytes]] = []
        self.subscribed = asyncio.Condition()
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(
                    "test.Peer",
                    {
                        "Name": grpc.unary_unary_rpc_method_handler(self._name),
                        "Count": grpc.unary_stream_rpc_method_handler(self._count),
                        "Events": grpc.unary_stream_rpc_method_handler(self._events),
                    },
                )
            ]
        )
        self.port = self.server.add_secure_port("127.0.0.1:0", server_credentials(tls))

    async def _name(self, request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return next(iter(context.auth_context().get("x509_common_name", [b""])))

    async def _count(
        self, request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        yield b"1"
        await self.go_on.wait()
        yield b"2"

    async def _events(
        self, request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        async with self.subscribed:
            self.subscriptions.append(queue)
            self.subscribed.notify_all()
        try:
            while True:
                yield await queue.get()
        finally:
            self.subscriptions.remove(queue)
            async with self.subscribed:
                self.subscribed.notify_all()

    async def until_subscribed(
        self, count: int, without: asyncio.Queue[bytes] | None = None
    ) -> list[asyncio.Queue[bytes]]:
        """The `Events` subscriptions, once `count` are open (`without` not among them)."""
        async with asyncio.timeout(30), self.subscribed:
            await self.subscribed.wait_for(
                lambda: len(self.subscriptions) == count and without not in self.subscriptions
            )
        return list(self.subscriptions)


@pytest.fixture
async def peer_server(pki: Path, tmp_path: Path) -> AsyncIterator[PeerServer]:
    """A `PeerServer` trusting the client certificates of the CA in tmp_path/client-ca.pem:
    other-ca's at first (other-ca-client.pem)."""
    client_ca = tmp_path / "client-ca.pem"
    client_ca.write_bytes((pki / "other-ca.pem").read_bytes())
    tls = TlsConfig(
        cert_file=pki / "server.pem", key_file=pki / "server.key", client_ca_file=client_ca
    )
    peer = PeerServer(tls)
    await peer.server.start()
    yield peer
    await peer.server.stop(None)


def redialling_peer(pki: Path, tmp_path: Path, port: int) -> Redialling[PeerStub]:
    """A long-running client's channel to `port` presenting other-ca-client.pem, from its
    files tmp_path/client.pem and client.key (followed as they change)."""
    cert, key = tmp_path / "client.pem", tmp_path / "client.key"
    cert.write_bytes((pki / "other-ca-client.pem").read_bytes())
    key.write_bytes((pki / "other-ca-client.key").read_bytes())
    tls = ClientTlsConfig(ca_file=pki / "ca.pem", cert_file=cert, key_file=key)
    return Redialling(ClientChannels.load(tls), f"127.0.0.1:{port}", PeerStub)


def rotate_to_ca(pki: Path, tmp_path: Path) -> None:
    """cert-manager's renewal with a new issuer: the server now trusts ca.pem's client
    certificates only (a client certificate of other-ca is refused on a new connection),
    and the client's files hold client.pem, which ca.pem signed."""
    replace_file(tmp_path / "client-ca.pem", (pki / "ca.pem").read_bytes())
    replace_file(tmp_path / "client.pem", (pki / "client.pem").read_bytes())
    replace_file(tmp_path / "client.key", (pki / "client.key").read_bytes())


async def closed(channel: grpc.aio.Channel) -> None:
    """Return once `channel` is closed: a call on it is refused at once."""
    while True:
        try:
            await PeerStub(channel).Name(b"", timeout=10)
        except grpc.aio.UsageError:
            return
        await asyncio.sleep(0.05)


def hours_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """The event loop's clock moves on two hours (what its timers see): a call that runs that
    long, a generation relayed for hours."""
    loop = asyncio.get_running_loop()
    now = loop.time
    monkeypatch.setattr(loop, "time", lambda: now() + 2 * 3600.0)


async def test_a_stream_open_across_a_rotation_ends_on_the_old_channel_as_new_calls_use_the_new(
    pki: Path, tmp_path: Path, peer_server: PeerServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cert-manager renews a long-running client's certificate (and the server's trust)
    while a stream runs on its channel: the next call is made on a channel dialled with the
    new files (the server sees the new certificate; no call failed first), the stream goes
    on to its end on the old channel, however long it runs (hours: a generation the gateway
    relays), as a TLS connection keeps the session it was made with; the old channel is
    closed then. (The renewed files were used only once a call had failed, and that dial
    ended the streams on the old channel; later, the old channel was closed an hour after
    the rotation, cutting the stream: the gateway said the engine had left.)"""
    dialled = redialling_peer(pki, tmp_path, peer_server.port)
    try:
        assert await dialled.stub.Name(b"", timeout=10) == b"other-ca-client"
        old = dialled.channel
        stream = dialled.stub.Count(b"", timeout=30)
        received = [await stream.read()]
        rotate_to_ca(pki, tmp_path)
        assert await dialled.stub.Name(b"", timeout=10) == b"client"
        assert dialled.channel is not old
        hours_later(monkeypatch)
        assert await dialled.stub.Name(b"", timeout=10) == b"client"  # the loop ran on
        peer_server.go_on.set()
        while (message := await stream.read()) is not grpc.aio.EOF:
            received.append(message)
        assert received == [b"1", b"2"]
        assert await stream.code() is grpc.StatusCode.OK
        await closed(old)  # its last call ended
        assert await dialled.stub.Name(b"", timeout=10) == b"client"
    finally:
        await dialled.close()


async def test_a_rotation_caught_halfway_keeps_the_working_channel(
    pki: Path, tmp_path: Path, peer_server: PeerServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The certificate renewed on disk, not yet its key: the channel dialled before goes on
    serving the calls (a warning), until the key follows; then the next call presents the
    new certificate."""
    dialled = redialling_peer(pki, tmp_path, peer_server.port)
    try:
        working = dialled.channel
        assert await dialled.stub.Name(b"", timeout=10) == b"other-ca-client"
        replace_file(tmp_path / "client.pem", (pki / "client.pem").read_bytes())
        with caplog.at_level(logging.WARNING, logger="kvplane.followed_files"):
            assert await dialled.stub.Name(b"", timeout=10) == b"other-ca-client"
        assert "cannot be used with certificate" in caplog.text
        assert dialled.channel is working
        replace_file(tmp_path / "client-ca.pem", (pki / "ca.pem").read_bytes())
        replace_file(tmp_path / "client.key", (pki / "client.key").read_bytes())
        assert await dialled.stub.Name(b"", timeout=10) == b"client"
    finally:
        await dialled.close()


async def test_a_call_failed_for_files_renewed_as_it_ran_closes_its_channel_at_once(
    pki: Path, tmp_path: Path, peer_server: PeerServer
) -> None:
    """A call made just before the files were renewed fails (its channel dialled with the
    old certificate, which the server now refuses): `after_failure` dials again and closes
    that channel at once (nothing on it reaches the server); a call that failed with the
    files unchanged dials nothing."""
    replace_file(tmp_path / "client-ca.pem", (pki / "ca.pem").read_bytes())
    dialled = redialling_peer(pki, tmp_path, peer_server.port)
    try:
        first = dialled.channel
        stub = dialled.stub
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Name(b"", timeout=10)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        await dialled.after_failure()
        assert dialled.channel is first  # the files did not change: the same channel
        replace_file(tmp_path / "client.pem", (pki / "client.pem").read_bytes())
        replace_file(tmp_path / "client.key", (pki / "client.key").read_bytes())
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Name(b"", timeout=10)  # made on the old channel
        await dialled.after_failure()
        with pytest.raises(grpc.aio.UsageError):
            await PeerStub(first).Name(b"", timeout=10)  # closed
        assert await dialled.stub.Name(b"", timeout=10) == b"client"
    finally:
        await dialled.close()


async def test_a_close_cancelled_as_it_ends_an_old_channel_is_cancelled(
    pki: Path, tmp_path: Path, peer_server: PeerServer
) -> None:
    """A client closes its channel while an old one (left by a rotation, a stream still on
    it) is closing, and that close is cancelled (a planner standing by, a task group failing):
    the cancellation goes on to the caller (closing the old channel swallowed it, so the
    caller went on as if never cancelled); both channels are closed all the same."""
    dialled = redialling_peer(pki, tmp_path, peer_server.port)
    try:
        old = dialled.channel
        stream = dialled.stub.Count(b"", timeout=30)
        assert await stream.read() == b"1"
        rotate_to_ca(pki, tmp_path)
        assert await dialled.stub.Name(b"", timeout=10) == b"client"  # the old channel retires
        closing = asyncio.create_task(dialled.close())
        await asyncio.sleep(0)  # it ends the old channel's close
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        await closed(old)  # closed all the same
        with pytest.raises(grpc.aio.UsageError):
            await PeerStub(dialled.channel).Name(b"", timeout=10)
    finally:
        await dialled.close()


async def test_a_redial_ends_the_streams_on_an_old_channel_too(
    pki: Path, tmp_path: Path, peer_server: PeerServer
) -> None:
    """A client dials afresh while a stream runs (the controller after a poll that timed
    out; a rotation likewise), then dials again ending every call (`redial`: the engine
    unreachable too long): the stream on the old channel ends too, cancelled. (The old
    channel's close, cancelled as it waited for its calls, left it marked closing, and
    closing it again did nothing: the stream ran on until its deadline.)"""
    dialled = redialling_peer(pki, tmp_path, peer_server.port)
    try:
        stream = dialled.stub.Count(b"", timeout=30)
        assert await stream.read() == b"1"
        dialled.dial_afresh()
        assert await dialled.stub.Name(b"", timeout=10) == b"other-ca-client"
        await dialled.redial()
        assert await stream.code() is grpc.StatusCode.CANCELLED
    finally:
        await dialled.close()


async def test_a_redial_cancelled_as_it_ends_an_old_channel_still_ends_the_calls_it_dialled_past(
    pki: Path, tmp_path: Path, peer_server: PeerServer
) -> None:
    """A redial (an engine abandoned as unreachable) cancelled while it ends an old channel's
    calls (the engine removed, the controller closing): the channel it dialled past is closed
    all the same, its stream cancelled, and the client's close after ends everything. (That
    channel was dropped: neither closed nor kept, so its stream ran on after the client
    closed, to a removed engine, until its deadline.)"""
    dialled = redialling_peer(pki, tmp_path, peer_server.port)
    try:
        on_old = dialled.stub.Count(b"", timeout=30)
        assert await on_old.read() == b"1"
        dialled.dial_afresh()
        on_current = dialled.stub.Count(b"", timeout=30)
        assert await on_current.read() == b"1"
        redialling = asyncio.create_task(dialled.redial())
        await asyncio.sleep(0)  # it waits for the old channel's close
        redialling.cancel()
        with pytest.raises(asyncio.CancelledError):
            await redialling
    finally:
        await dialled.close()
    assert await on_old.code() is grpc.StatusCode.CANCELLED
    assert await on_current.code() is grpc.StatusCode.CANCELLED


async def test_a_redial_on_a_grpcio_without_a_record_of_calls_leaves_them_running(
    pki: Path,
    tmp_path: Path,
    peer_server: PeerServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A grpcio whose channels keep no record of their calls where `Redialling` reads it
    (`_active_calls`, grpc.aio's private one; another version, which cannot be installed
    here): a redial does not wait for the stream on an old channel (a warning naming the
    record) and the next call goes on a new channel; the stream runs on to its end, and its
    channel is closed then. (The redial waited for the stream to end, its deadline here: the
    controller's polls of an engine stopped behind its abandonment.)"""
    monkeypatch.setattr(kvplane.channels, "_CALLS_RECORD", "_calls_of_another_grpcio")
    dialled = redialling_peer(pki, tmp_path, peer_server.port)
    try:
        stream = dialled.stub.Count(b"", timeout=30)
        assert await stream.read() == b"1"
        old = dialled.channel
        dialled.dial_afresh()
        with caplog.at_level(logging.WARNING, logger="kvplane.channels"):
            await dialled.redial()
        assert "keeps no record of a channel's calls (_calls_of_another_grpcio)" in caplog.text
        assert await dialled.stub.Name(b"", timeout=10) == b"other-ca-client"
        peer_server.go_on.set()
        assert await stream.read() == b"2"
        assert await stream.code() is grpc.StatusCode.OK
        await closed(old)
    finally:
        await dialled.close()


@contextlib.asynccontextmanager
async def reading_events(
    dialled: Redialling[PeerStub], message_id: Callable[[bytes], str] = bytes.decode
) -> AsyncIterator[asyncio.Queue[bytes]]:
    """The messages of an `Events` subscription on `dialled`, moved at each renewal
    (`redialled_stream`; a message's id: itself, unless `message_id` says), as they come;
    the subscription and `dialled` closed at the end."""
    messages: asyncio.Queue[bytes] = asyncio.Queue()

    async def read() -> None:
        async for message in redialled_stream(dialled, lambda stub: stub.Events(b""), message_id):
            messages.put_nowait(message)

    reader = asyncio.create_task(read())
    try:
        yield messages
    finally:
        reader.cancel()
        await asyncio.wait([reader])
        await dialled.close()


async def renewed_under(
    dialled: Redialling[PeerStub], peer_server: PeerServer, pki: Path, tmp_path: Path
) -> list[asyncio.Queue[bytes]]:
    """`rotate_to_ca` under an `Events` subscription on `dialled`: the next call is made on
    the new channel, and the subscription moves there; its old and new subscriptions."""
    rotate_to_ca(pki, tmp_path)
    assert await dialled.stub.Name(b"", timeout=10) == b"client"
    return await peer_server.until_subscribed(2)


@pytest.mark.parametrize("first", ["old", "new"])
async def test_a_subscription_moves_to_the_new_channel_with_every_message_once(
    pki: Path, tmp_path: Path, peer_server: PeerServer, first: str
) -> None:
    """A subscription that never ends, open across a rotation, moves to the channel dialled
    with the new files, make-before-break: a second subscription is opened there, and the
    first is ended once both carried the same message, whichever stream brings the messages
    first; each message is passed on once, those the two carried together included, and the
    old channel is closed then. (The stream stayed on the old channel, to be cut an hour
    later and subscribed again: the messages in between were lost.)"""
    dialled = redialling_peer(pki, tmp_path, peer_server.port)
    async with reading_events(dialled) as messages:
        old = dialled.channel
        [subscription] = await peer_server.until_subscribed(1)
        subscription.put_nowait(b"1")
        received = [await messages.get()]
        old_one, new_one = await renewed_under(dialled, peer_server, pki, tmp_path)
        # What the server published since both were open, one stream ahead of the other.
        ahead, behind = (old_one, new_one) if first == "old" else (new_one, old_one)
        for message in (b"2", b"3", b"4"):
            ahead.put_nowait(message)
        received += [await messages.get() for _ in range(3)]
        for message in (b"2", b"3", b"4"):
            behind.put_nowait(message)
        assert await peer_server.until_subscribed(1) == [new_one]  # the old one ended
        new_one.put_nowait(b"5")
        received.append(await messages.get())
        assert received == [b"1", b"2", b"3", b"4", b"5"]
        assert messages.empty()
        await closed(old)


async def test_a_subscription_follows_a_second_renewal_made_while_it_moves(
    pki: Path, tmp_path: Path, peer_server: PeerServer
) -> None:
    """The files renewed again while the subscription moves (the server idle: the two
    streams have not overlapped yet): the move under way completes, then the subscription
    moves on to the newest channel; every message once."""
    dialled = redialling_peer(pki, tmp_path, peer_server.port)
    async with reading_events(dialled) as messages:
        await peer_server.until_subscribed(1)
        first, second = await renewed_under(dialled, peer_server, pki, tmp_path)
        replace_file(tmp_path / "client.pem", (pki / "client.pem").read_bytes())  # renewed again
        newest = dialled.channel
        for subscription in (first, second):
            subscription.put_nowait(b"1")
        assert await messages.get() == b"1"
        # The first ended, and a third subscription opened on the newest channel.
        still, third = await peer_server.until_subscribed(2, without=first)
        assert still is second
        for subscription in (second, third):
            subscription.put_nowait(b"2")
        assert await messages.get() == b"2"
        assert await peer_server.until_subscribed(1) == [third]
        third.put_nowait(b"3")
        assert await messages.get() == b"3"
        assert messages.empty()
        assert dialled.channel is newest


def with_id(event: int, event_id: str) -> bytes:
    """An `Events` message carrying `event` with the id `event_id`: b"ID/EVENT"."""
    return f"{event_id}/{event}".encode()


def id_of(message: bytes) -> str:
    return message.partition(b"/")[0].decode()


async def until_received(messages: asyncio.Queue[bytes], event: int, received: list[int]) -> None:
    """Read the events of `with_id` messages into `received` until `event` is among them."""
    async with asyncio.timeout(30):
        while event not in received:
            received.append(int((await messages.get()).partition(b"/")[2]))


@pytest.mark.parametrize("ids", ["per subscription", "empty"])
async def test_a_subscription_whose_event_ids_do_not_line_up_moves_to_the_new_stream_alone(
    pki: Path, tmp_path: Path, peer_server: PeerServer, caplog: pytest.LogCaptureFixture, ids: str
) -> None:
    """An engine that gives each subscription its own event ids (a UUID per send), or none
    (OpenEngine promises neither way): the subscription moved by a renewal ends up on the
    new channel alone (the old call cancelled) once one stream brought `MAX_UNMATCHED` events
    none of which the other carried, with one warning; every event arrives (one only the old
    stream brought included), and each one after the move once. (The streams never
    overlapped: both stayed open for good, each event passed on twice, their ids kept without
    bound; an empty id was taken for an overlap, and the event lost.)"""

    def message(event: int, subscription: str) -> bytes:
        return with_id(event, f"{subscription}-{event}" if ids == "per subscription" else "")

    dialled = redialling_peer(pki, tmp_path, peer_server.port)
    received: list[int] = []
    async with reading_events(dialled, id_of) as messages:
        [old_one] = await peer_server.until_subscribed(1)
        old_one.put_nowait(message(1, "old"))
        await until_received(messages, 1, received)
        with caplog.at_level(logging.WARNING, logger="kvplane.redialled_stream"):
            old_one, new_one = await renewed_under(dialled, peer_server, pki, tmp_path)
            old_one.put_nowait(message(2, "old"))  # published as the new one opened
            await until_received(messages, 2, received)
            last = 2 + MAX_UNMATCHED
            for event in range(3, last + 1):  # published to both, the new one first
                new_one.put_nowait(message(event, "new"))
                await until_received(messages, event, received)
                old_one.put_nowait(message(event, "old"))
            assert await peer_server.until_subscribed(1) == [new_one]  # the old one ended
        assert caplog.text.count("carried no message id in common") == 1
        for event in (last + 1, last + 2):
            new_one.put_nowait(message(event, "new"))
        await until_received(messages, last + 2, received)
        assert sorted(set(received)) == list(range(1, last + 3))
        assert received.count(last + 1) == 1
        assert received[-2:] == [last + 1, last + 2]
        assert messages.empty()


async def test_a_new_subscription_that_brings_nothing_is_ended_and_the_old_one_goes_on(
    pki: Path, tmp_path: Path, peer_server: PeerServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The subscription a renewal opens on the new channel brings nothing while the old one
    brings every event: once the old one brought `MAX_UNMATCHED` events, the new call is cancelled
    (a warning) and the old one goes on, each event once. (The move waited for an overlap
    for good: two streams open, the old one's ids kept without bound.)"""
    dialled = redialling_peer(pki, tmp_path, peer_server.port)
    async with reading_events(dialled) as messages:
        await peer_server.until_subscribed(1)
        old_one, new_one = await renewed_under(dialled, peer_server, pki, tmp_path)
        events = [str(event).encode() for event in range(1, MAX_UNMATCHED + 1)]
        with caplog.at_level(logging.WARNING, logger="kvplane.redialled_stream"):
            for event in events:
                old_one.put_nowait(event)
            assert [await messages.get() for _ in events] == events
            assert await peer_server.until_subscribed(1, without=new_one) == [old_one]
        assert "the subscription on the new channel brought nothing" in caplog.text
        old_one.put_nowait(b"next")
        assert await messages.get() == b"next"
        assert messages.empty()
