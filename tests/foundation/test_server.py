"""The gRPC scaffolding every server shares: health, reflection, TLS/mTLS, bearer token."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvplane.channels import ClientChannels
from kvplane.config import AuthConfig, ClientTlsConfig, ServerConfig, TlsConfig
from kvplane.errors import ConfigError
from kvplane.server import MAX_STATUS_MESSAGE_BYTES, Service, create_server, status_message
from tests.rotation import replace_file

ECHO = "kvplane.test.Echo"


def _identity(data: bytes) -> bytes:
    return data


async def _echo(request: bytes, _context: Any) -> bytes:
    return request


async def _echo_stream(request: bytes, _context: Any) -> AsyncIterator[bytes]:
    for _ in range(2):
        yield request


def _add_echo(server: grpc.aio.Server) -> None:
    handlers = {
        "Read": grpc.unary_unary_rpc_method_handler(_echo, _identity, _identity),
        "Write": grpc.unary_unary_rpc_method_handler(_echo, _identity, _identity),
        "WriteStream": grpc.unary_stream_rpc_method_handler(_echo_stream, _identity, _identity),
    }
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(ECHO, handlers)])


ECHO_SERVICE = Service(ECHO, _add_echo, frozenset({"Write", "WriteStream"}))


async def _call(channel: grpc.aio.Channel, method: str, token: str | None = None) -> bytes:
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    if method == "WriteStream":
        stream = channel.unary_stream(f"/{ECHO}/{method}", _identity, _identity)
        return b"".join([chunk async for chunk in stream(b"hi", metadata=metadata)])
    unary = channel.unary_unary(f"/{ECHO}/{method}", _identity, _identity)
    result: bytes = await unary(b"hi", metadata=metadata)
    return result


def _asking_for(token_file: Path, token: str, *, protect_reads: bool = False) -> ServerConfig:
    """A plaintext server's config asking for `token`, written to `token_file`."""
    token_file.write_text(f"{token}\n")
    auth = AuthConfig(token_file=token_file, protect_reads=protect_reads)
    return ServerConfig(listen="127.0.0.1:0", auth=auth)


async def _listed_services(channel: grpc.aio.Channel) -> set[str]:
    """The services the server's reflection lists."""
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    replies = [r async for r in refl.ServerReflectionInfo(iter([request]))]
    return {s.name for s in replies[0].list_services_response.service}


async def test_health_and_reflection_on_port_zero() -> None:
    server, port = await create_server(ServerConfig(listen="127.0.0.1:0"), [ECHO_SERVICE])
    try:
        assert port > 0
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", ECHO):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=name))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            assert {ECHO, "grpc.health.v1.Health"} <= await _listed_services(channel)
    finally:
        await server.stop(None)


async def test_bearer_token_guards_mutating_rpcs_only(tmp_path: Path) -> None:
    server, port = await create_server(_asking_for(tmp_path / "token", "s3cret"), [ECHO_SERVICE])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert await _call(channel, "Read") == b"hi"
            assert await _call(channel, "Write", "s3cret") == b"hi"
            assert await _call(channel, "WriteStream", "s3cret") == b"hihi"
            for method, token in [("Write", None), ("Write", "wrong"), ("WriteStream", None)]:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _call(channel, method, token)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            health = health_pb2_grpc.HealthStub(channel)
            await health.Check(health_pb2.HealthCheckRequest())
    finally:
        await server.stop(None)


async def test_the_bearer_schemes_case_does_not_matter_the_tokens_does(tmp_path: Path) -> None:
    """`authorization: bearer <token>` (RFC 7235: the scheme is case-insensitive; some
    clients and proxies send it so) is taken; a token in another case, or without its
    scheme, is not."""
    server, port = await create_server(_asking_for(tmp_path / "token", "s3cret"), [ECHO_SERVICE])
    write = f"/{ECHO}/Write"
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            unary = channel.unary_unary(write, _identity, _identity)
            for scheme in ("Bearer", "bearer", "BEARER"):
                metadata = (("authorization", f"{scheme} s3cret"),)
                assert await unary(b"hi", metadata=metadata) == b"hi"
            refused = ("Bearer S3CRET", "s3cret", "Basic s3cret", "Bearer  s3cret", "Bearer")
            prefixes = ("Bearer s3cret-and-more", "Bearer s3cre", "Bearer ")
            for value in (*refused, *prefixes):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await unary(b"hi", metadata=(("authorization", value),))
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, value
    finally:
        await server.stop(None)


async def test_protect_reads_guards_every_rpc(tmp_path: Path) -> None:
    server, port = await create_server(
        _asking_for(tmp_path / "token", "s3cret", protect_reads=True), [ECHO_SERVICE]
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _call(channel, "Read")
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert await _call(channel, "Read", "s3cret") == b"hi"
            # Health (probes, load balancers) and reflection (grpcurl) need no token.
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service=ECHO))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            assert ECHO in await _listed_services(channel)
    finally:
        await server.stop(None)


async def test_a_token_rotated_on_disk_is_taken_at_once_and_the_old_one_refused(
    tmp_path: Path,
) -> None:
    """`auth.token_file` replaced (a Secret's update, an operator's `mv`): the next call
    must carry the new token; the old one is UNAUTHENTICATED, without a restart."""
    token_file = tmp_path / "token"
    server, port = await create_server(_asking_for(token_file, "old-token"), [ECHO_SERVICE])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert await _call(channel, "Write", "old-token") == b"hi"
            replace_file(token_file, b"new-token\n")
            assert await _call(channel, "Write", "new-token") == b"hi"
            assert await _call(channel, "WriteStream", "new-token") == b"hihi"
            for method in ("Write", "WriteStream"):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _call(channel, method, "old-token")
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await server.stop(None)


async def test_a_clients_token_file_is_read_again_as_it_is_rotated(
    pki: Path, tmp_path: Path
) -> None:
    """A client's token file (`engine_token_file`, the planner's, ...) rotated with the
    server's: its channel's next call carries the new token, over TLS as over plaintext; a
    call bringing an authorization of its own sends that one in its place."""
    server_token, client_token = tmp_path / "server-token", tmp_path / "client-token"
    server_token.write_text("old-token\n")
    client_token.write_text("old-token\n")
    tls = TlsConfig(cert_file=pki / "server.pem", key_file=pki / "server.key")
    config = ServerConfig(listen="127.0.0.1:0", tls=tls, auth=AuthConfig(token_file=server_token))
    server, port = await create_server(config, [ECHO_SERVICE])
    channels = ClientChannels.load(ClientTlsConfig(ca_file=pki / "ca.pem")).with_token_file(
        client_token, "engine_token_file"
    )
    try:
        async with channels.aio_channel(f"localhost:{port}") as channel:
            assert await _call(channel, "Write") == b"hi"
            replace_file(server_token, b"new-token\n")
            replace_file(client_token, b"new-token\n")
            assert await _call(channel, "Write") == b"hi"
            assert await _call(channel, "WriteStream") == b"hihi"
            replace_file(client_token, b"stale-token\n")
            assert await _call(channel, "Write", "new-token") == b"hi"
    finally:
        await server.stop(None)


async def test_tls_and_mutual_tls(pki: Path) -> None:
    tls = TlsConfig(cert_file=pki / "server.pem", key_file=pki / "server.key")
    server, port = await create_server(ServerConfig(listen="127.0.0.1:0", tls=tls), [ECHO_SERVICE])
    root = (pki / "ca.pem").read_bytes()
    try:
        creds = grpc.ssl_channel_credentials(root_certificates=root)
        async with grpc.aio.secure_channel(f"localhost:{port}", creds) as channel:
            assert await _call(channel, "Read") == b"hi"
    finally:
        await server.stop(None)

    mtls = TlsConfig(
        cert_file=pki / "server.pem", key_file=pki / "server.key", client_ca_file=pki / "ca.pem"
    )
    server, port = await create_server(ServerConfig(listen="127.0.0.1:0", tls=mtls), [ECHO_SERVICE])
    try:
        anonymous = grpc.ssl_channel_credentials(root_certificates=root)
        async with grpc.aio.secure_channel(f"localhost:{port}", anonymous) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _call(channel, "Read")
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with_cert = grpc.ssl_channel_credentials(
            root_certificates=root,
            private_key=(pki / "client.key").read_bytes(),
            certificate_chain=(pki / "client.pem").read_bytes(),
        )
        async with grpc.aio.secure_channel(f"localhost:{port}", with_cert) as channel:
            assert await _call(channel, "Read") == b"hi"
    finally:
        await server.stop(None)


async def test_unreadable_tls_or_token_file_is_a_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "missing.pem"
    with pytest.raises(ConfigError, match=f"^tls: cannot read cert_file {missing}: No such file"):
        await create_server(
            ServerConfig(listen="127.0.0.1:0", tls=TlsConfig(cert_file=missing, key_file=missing)),
            [],
        )
    with pytest.raises(ConfigError, match="token_file"):
        await create_server(
            ServerConfig(listen="127.0.0.1:0", auth=AuthConfig(token_file=missing)), []
        )


async def test_a_token_no_client_can_send_is_a_config_error(tmp_path: Path) -> None:
    """A token file holding a line break inside, a control or a non-ASCII character: no
    client can present it (gRPC metadata is printable ASCII), so the server refuses to start,
    naming the file, not the token."""
    for content in ("two\nlines", "caf\u00e9", "tab\tin"):
        token_file = tmp_path / "token"
        token_file.write_text(content)
        with pytest.raises(ConfigError) as err:
            await create_server(
                ServerConfig(listen="127.0.0.1:0", auth=AuthConfig(token_file=token_file)), []
            )
        assert str(err.value).startswith(
            f"auth.token_file {token_file} holds a character a bearer token cannot carry"
        )
        assert content not in str(err.value)


async def test_a_key_that_is_not_the_certificates_is_a_config_error(pki: Path) -> None:
    """Checked at start, as it is at each rotation (kvplane.server_tls), rather than found
    by every client's failed handshake."""
    tls = TlsConfig(cert_file=pki / "server.pem", key_file=pki / "client.key")
    with pytest.raises(ConfigError, match=r"^tls: key_file .*client.key and cert_file "
                                          r".*server.pem do not make a pair: "):  # fmt: skip
        await create_server(ServerConfig(listen="127.0.0.1:0", tls=tls), [])


NOT_A_CERTIFICATE = (
    "-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n"
)


@pytest.mark.parametrize(
    ("field", "content", "error"),
    [
        ("cert_file", "server.key", "does not hold a certificate in PEM"),
        ("key_file", "server.pem", "does not hold a private key in PEM"),
        ("client_ca_file", "server.key", "does not hold a certificate in PEM"),
        ("client_ca_file", NOT_A_CERTIFICATE, "holds no usable certificate (OpenSSL: "),
        ("client_ca_file", None, "cannot read"),
    ],
    ids=["cert-not-pem", "key-not-pem", "client-ca-not-pem", "client-ca-corrupt", "missing"],
)
async def test_an_unusable_tls_file_is_one_line_naming_it(
    pki: Path, tmp_path: Path, field: str, content: str | None, error: str
) -> None:
    """Each `tls` file is checked at start and named when it cannot be used. (A client CA
    file that was not PEM went to gRPC, which logged lines of its C core and failed with
    "cannot listen on 127.0.0.1:0: Failed to bind to address"; a certificate or key that was
    not said "do not make a pair", naming neither.)"""
    files = {
        "cert_file": pki / "server.pem",
        "key_file": pki / "server.key",
        "client_ca_file": pki / "ca.pem",
    }
    bad = files[field] = tmp_path / "bad.pem"
    if content is not None:
        bad.write_text(content if "-" in content else (pki / content).read_text())
    tls = TlsConfig.model_validate(files)
    with pytest.raises(ConfigError, match=rf"^tls: (cannot read )?{field} {bad}:? ") as err:
        await create_server(ServerConfig(listen="127.0.0.1:0", tls=tls), [])
    assert error in str(err.value)
    assert "\n" not in str(err.value)


async def test_a_client_ca_file_rotated_to_one_that_cannot_be_used_keeps_the_one_before(
    pki: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A mutual-TLS server whose client CA file is replaced by one OpenSSL cannot load (a
    bad write, a Secret's wrong key) goes on taking the clients the CA read before signed,
    with a warning naming the file."""
    client_ca = tmp_path / "client-ca.pem"
    client_ca.write_bytes((pki / "ca.pem").read_bytes())
    tls = TlsConfig(
        cert_file=pki / "server.pem", key_file=pki / "server.key", client_ca_file=client_ca
    )
    server, port = await create_server(ServerConfig(listen="127.0.0.1:0", tls=tls), [ECHO_SERVICE])
    with_cert = grpc.ssl_channel_credentials(
        root_certificates=(pki / "ca.pem").read_bytes(),
        private_key=(pki / "client.key").read_bytes(),
        certificate_chain=(pki / "client.pem").read_bytes(),
    )
    try:
        replace_file(client_ca, NOT_A_CERTIFICATE.encode())
        with caplog.at_level(logging.WARNING, logger="kvplane.tls_files"):
            async with grpc.aio.secure_channel(f"localhost:{port}", with_cert) as channel:
                assert await _call(channel, "Read") == b"hi"
        assert f"tls: client_ca_file {client_ca} holds no usable certificate" in caplog.text
    finally:
        await server.stop(None)


def test_a_long_status_message_is_cut_in_the_middle_on_a_character_boundary() -> None:
    message = "model '" + "𝄞" * 5_000 + "' is not served here"
    cut = status_message(message)
    assert len(cut.encode()) <= MAX_STATUS_MESSAGE_BYTES
    assert cut.startswith("model '𝄞") and cut.endswith("𝄞' is not served here")
    assert " ... " in cut and "\ufffd" not in cut
    assert status_message("short") == "short"
