"""A client's TLS files followed as they change (`kvplane.client_tls`): each channel is
dialled with the files as they are then, so a client certificate or CA bundle renewed on disk
is used without a restart, and a rotation caught halfway keeps the files read before. A real
mutual-TLS server on 127.0.0.1, openssl-made certificates (the `pki` fixture)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvplane.channels import ClientChannels, Redialling
from kvplane.config import ClientTlsConfig, ServerConfig, TlsConfig
from kvplane.errors import ConfigError
from kvplane.server import create_server
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


async def test_a_long_running_channel_is_dialled_again_once_its_files_are_renewed(
    pki: Path, tmp_path: Path, mutual_tls_port: int
) -> None:
    """gRPC keeps a channel's credentials at every reconnection: a long-running client's
    channel (`Redialling`, the controller's to an engine, the planner's, a decode engine's to
    a prefill peer) presenting a certificate the server refuses is dialled again once the
    files are renewed and a call failed, and not before (nothing changed)."""
    cert, key = tmp_path / "client.pem", tmp_path / "client.key"
    cert.write_bytes((pki / "other-ca-client.pem").read_bytes())
    key.write_bytes((pki / "other-ca-client.key").read_bytes())
    tls = ClientTlsConfig(ca_file=pki / "ca.pem", cert_file=cert, key_file=key)
    dialled: Redialling[health_pb2_grpc.HealthStub] = Redialling(
        ClientChannels.load(tls), f"127.0.0.1:{mutual_tls_port}", health_pb2_grpc.HealthStub
    )

    async def check() -> grpc.StatusCode:
        try:
            await dialled.stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        except grpc.aio.AioRpcError as exc:
            await dialled.after_failure()
            return exc.code()
        return grpc.StatusCode.OK

    try:
        first = dialled.channel
        assert await check() is grpc.StatusCode.UNAVAILABLE
        assert dialled.channel is first  # the files did not change: the same channel
        replace_file(cert, (pki / "client.pem").read_bytes())
        replace_file(key, (pki / "client.key").read_bytes())
        assert await check() is grpc.StatusCode.UNAVAILABLE  # dialled with the old files
        assert dialled.channel is not first
        assert await check() is grpc.StatusCode.OK
    finally:
        await dialled.close()
