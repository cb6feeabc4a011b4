"""A secured fleet meeting what its operators meet: an engine whose certificate does not
verify (another CA's, expired, for another name), TLS and plaintext mixed up, a client
certificate an engine does not trust, and bearer tokens rotated on disk while everything
runs. The controller's ListWorkers (`kvplane admin workers`, `health`) says why an engine is
out in words naming the controller's own setting, not gRPC's trail of the handshake; token
files are followed as they change, on both ends. Real servers on 127.0.0.1, openssl-made
certificates (the `pki` fixture)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
from typer.testing import CliRunner

from controller.app import ControllerApp, start_controller
from controller.config import ControllerConfig
from engine.server.service import EngineApp
from kvplane.channels import ClientChannels
from kvplane.cli import app
from kvplane.config import ClientTlsConfig, TlsConfig
from kvplane_api.v1 import admin_pb2 as apb
from kvplane_api.v1 import admin_pb2_grpc as apb_grpc
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import start_sim_engine
from tests.polling import eventually
from tests.rotation import replace_file

pytestmark = pytest.mark.timeout(60)

ENGINE_CERTIFICATE_FILE = "engine_tls.cert_file and key_file"


def serving(pki: Path, certificate: str, *, client_ca: bool = False) -> TlsConfig:
    return TlsConfig(
        cert_file=pki / f"{certificate}.pem",
        key_file=pki / f"{certificate}.key",
        client_ca_file=pki / "ca.pem" if client_ca else None,
    )


async def start_plain_controller(engine: EngineApp, **config: Any) -> ControllerApp:
    """A controller serving plaintext, its one engine dialled as `config` says; fast
    retries, so that a fixed engine is seen again at once."""
    return await start_controller(
        ControllerConfig.model_validate(
            {
                "listen": "127.0.0.1:0",
                "engines": [{"address": f"127.0.0.1:{engine.port}"}],
                "health": {
                    "poll_interval_s": 0.1,
                    "load_poll_interval_s": 0.1,
                    "backoff_initial_s": 0.05,
                    "backoff_max_s": 0.2,
                },
                "shutdown_grace_s": 0.2,
                **config,
            }
        )
    )


async def worker(controller: ControllerApp) -> apb.WorkerInfo:
    """The controller's one engine as `kvplane admin workers` shows it."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{controller.port}") as channel:
        reply = await apb_grpc.AdminStub(channel).ListWorkers(apb.ListWorkersRequest())
    (only,) = reply.workers
    return only


async def wait_for_error(controller: ControllerApp, state: str, error: str) -> None:
    async def shown() -> bool:
        engine = await worker(controller)
        return (engine.state, engine.last_error) == (state, error)

    try:
        await eventually(shown, what=f"{state}: {error}")
    except AssertionError:
        engine = await worker(controller)
        raise AssertionError(f"shown: {engine.state}: {engine.last_error}") from None


@pytest.mark.parametrize(
    ("engine_serves", "engine_tls", "error"),
    [
        (
            "other-ca-server",
            {"ca_file": "ca.pem"},
            "TLS handshake failed: CERTIFICATE_VERIFY_FAILED: unable to get local issuer "
            "certificate (a server certificate not signed by the CA of engine_tls?)",
        ),
        (
            "expired",
            {"ca_file": "ca.pem"},
            "TLS handshake failed: CERTIFICATE_VERIFY_FAILED: certificate has expired (the "
            "server's certificate has expired: renew it)",
        ),
        (
            "elsewhere",
            {"ca_file": "ca.pem"},
            "TLS handshake failed: the server certificate's names do not include the host "
            "dialled (a server certificate for another name? give the server one for the host "
            "dialled, or set engine_tls.server_name)",
        ),
        (
            None,  # a plaintext engine
            {"ca_file": "ca.pem"},
            "TLS handshake failed: WRONG_VERSION_NUMBER (a plaintext server? leave out engine_tls)",
        ),
        (
            "server",
            None,  # dialled in plaintext
            "the server closed the connection (Socket closed) (a TLS server? give engine_tls)",
        ),
        (
            "server+client_ca",
            {"ca_file": "ca.pem"},  # no client certificate
            "the server closed the connection (Socket closed) (a server requiring a client "
            f"certificate? give {ENGINE_CERTIFICATE_FILE})",
        ),
        (
            "server+client_ca",
            {
                "ca_file": "ca.pem",
                "cert_file": "other-ca-client.pem",
                "key_file": "other-ca-client.key",
            },
            "the server closed the connection (Socket closed) (a client certificate the "
            f"server does not trust? check {ENGINE_CERTIFICATE_FILE})",
        ),
    ],
    ids=[
        "other-ca",
        "expired",
        "other-name",
        "plaintext-engine",
        "plaintext-dial",
        "no-client-certificate",
        "untrusted-client-certificate",
    ],
)
async def test_an_engine_the_controller_cannot_dial_securely_is_shown_with_the_reason(
    pki: Path, engine_serves: str | None, engine_tls: dict[str, str] | None, error: str
) -> None:
    """An engine whose TLS does not match the controller's `engine_tls` is UNREACHABLE, and
    `workers`/`health` say why in one line naming the setting to check (it was gRPC's
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:...: Tls handshake
    failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:
    OPENSSL_internal:...", or a bare "Socket closed" for a TLS engine dialled in
    plaintext)."""
    tls = None
    if engine_serves is not None:
        certificate, _, client_ca = engine_serves.partition("+")
        tls = serving(pki, certificate, client_ca=bool(client_ca))
    engine = await start_sim_engine("e0", tls=tls)
    files = {key: pki / name for key, name in (engine_tls or {}).items()}
    controller = await start_plain_controller(engine, engine_tls=files or None)
    try:
        await wait_for_error(controller, "unreachable", f"UNAVAILABLE: {error}")
    finally:
        await controller.close(0.2)
        await engine.close()


async def test_an_engine_given_a_certificate_the_ca_signed_is_routed_again(pki: Path) -> None:
    """Restarted with a good certificate (the operator's fix, or a rotation to a new one the
    same CA signed), the engine is routed again by the same controller, no restart of it."""
    bad = await start_sim_engine("e0", tls=serving(pki, "expired"))
    address = f"127.0.0.1:{bad.port}"
    controller = await start_plain_controller(bad, engine_tls={"ca_file": pki / "ca.pem"})
    fixed: EngineApp | None = None
    try:
        await eventually(lambda: "has expired" in controller.controller.fleet.registry.get(
            address).last_error)  # fmt: skip
        await bad.close()
        fixed = await start_sim_engine("e1", port=bad.port, tls=serving(pki, "server"))
        await wait_for_error(controller, "ready", "")
    finally:
        await controller.close(0.2)
        for engine in (bad, fixed):
            if engine is not None:
                await engine.close()


async def test_a_certificate_renewed_on_disk_is_served_without_a_restart(
    pki: Path, tmp_path: Path
) -> None:
    """The engine's certificate files replaced while it runs (an expired certificate renewed,
    as cert-manager does): the next connection is served the new one, and the controller
    routes to the engine again, neither restarted. A half-done rotation (a certificate whose
    key is not yet written) keeps the pair served before. (The files were read once, at
    start: a renewal took a restart of every server.)"""
    cert, key = tmp_path / "engine.pem", tmp_path / "engine.key"
    cert.write_bytes((pki / "expired.pem").read_bytes())
    key.write_bytes((pki / "expired.key").read_bytes())
    engine = await start_sim_engine("e0", tls=TlsConfig(cert_file=cert, key_file=key))
    controller = await start_plain_controller(engine, engine_tls={"ca_file": pki / "ca.pem"})
    try:
        expired = "certificate has expired (the server's certificate has expired: renew it)"
        await wait_for_error(
            controller, "unreachable", f"UNAVAILABLE: TLS handshake failed: "
            f"CERTIFICATE_VERIFY_FAILED: {expired}"
        )  # fmt: skip
        replace_file(cert, (pki / "server.pem").read_bytes())  # its key not yet replaced
        # A new connection (each reads the files again) is still served the expired pair.
        channels = ClientChannels.load(ClientTlsConfig(ca_file=pki / "ca.pem"))
        async with channels.aio_channel(f"127.0.0.1:{engine.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError, match="certificate has expired"):
                await pb_grpc.OpenEngineStub(channel).Health(pb.HealthRequest(), timeout=10)
        replace_file(key, (pki / "server.key").read_bytes())
        await wait_for_error(controller, "ready", "")
    finally:
        await controller.close(0.2)
        await engine.close()


async def test_client_tls_files_renewed_on_disk_are_dialled_without_a_restart(
    pki: Path, tmp_path: Path
) -> None:
    """The controller's `engine_tls` files replaced while it runs (a client certificate the
    engine does not trust renewed with one it does, as cert-manager renews an expired one;
    its CA bundle likewise): the controller dials the engine again with them and routes to
    it, neither restarted. (They were read once, at start: the engine stayed unreachable
    until the controller was restarted.)"""
    ca, cert, key = tmp_path / "ca.pem", tmp_path / "client.pem", tmp_path / "client.key"
    ca.write_bytes((pki / "other-ca.pem").read_bytes())
    cert.write_bytes((pki / "other-ca-client.pem").read_bytes())
    key.write_bytes((pki / "other-ca-client.key").read_bytes())
    engine = await start_sim_engine("e0", tls=serving(pki, "server", client_ca=True))
    engine_tls = {"ca_file": ca, "cert_file": cert, "key_file": key}
    controller = await start_plain_controller(engine, engine_tls=engine_tls)
    try:
        await wait_for_error(
            controller, "unreachable", "UNAVAILABLE: TLS handshake failed: "
            "CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate (a server "
            "certificate not signed by the CA of engine_tls?)"
        )  # fmt: skip
        replace_file(ca, (pki / "ca.pem").read_bytes())
        await wait_for_error(
            controller, "unreachable", "UNAVAILABLE: the server closed the connection (Socket "
            f"closed) (a client certificate the server does not trust? check "
            f"{ENGINE_CERTIFICATE_FILE})"
        )  # fmt: skip
        replace_file(cert, (pki / "client.pem").read_bytes())
        replace_file(key, (pki / "client.key").read_bytes())
        await wait_for_error(controller, "ready", "")
    finally:
        await controller.close(0.2)
        await engine.close()


def rotate(path: Path, token: str) -> None:
    replace_file(path, f"{token}\n".encode())


async def admin_cli(controller: ControllerApp, token_file: Path, *args: str) -> tuple[int, str]:
    result = await asyncio.to_thread(
        CliRunner().invoke,
        app,
        ["admin", "-t", f"127.0.0.1:{controller.port}", "--token-file", str(token_file), *args],
    )
    return result.exit_code, str(result.exception) if result.exit_code else result.output


async def test_tokens_rotated_on_disk_take_effect_without_restarts(tmp_path: Path) -> None:
    """An engine with `auth` (protect_reads: its polls too) and the controller, itself with
    `auth`, each follow their token files as they change: the engine's new token refuses the
    controller's old one, which the workers table puts down to `engine_token_file`; that
    file rotated in turn, the engine is routed again. The controller's own token rotated, an
    admin client's old one is refused and the new one accepted. (Each file was read once, at
    start: a rotation needed every process restarted, in the right order.)"""
    engine_token, controller_engine_token = tmp_path / "engine", tmp_path / "controller-engine"
    admin_token, old_admin_token = tmp_path / "admin", tmp_path / "old-admin"
    for path, token in [
        (engine_token, "engine-1"),
        (controller_engine_token, "engine-1"),
        (admin_token, "admin-1"),
        (old_admin_token, "admin-1"),
    ]:
        path.write_text(f"{token}\n")
    engine = await start_sim_engine("e0", auth={"token_file": engine_token, "protect_reads": True})
    address = f"127.0.0.1:{engine.port}"
    controller = await start_plain_controller(
        engine, engine_token_file=controller_engine_token, auth={"token_file": admin_token}
    )
    try:
        await wait_for_error(controller, "ready", "")

        rotate(engine_token, "engine-2")
        refused = (
            "UNAUTHENTICATED: missing or invalid bearer token (metadata 'authorization: "
            "Bearer <token>') (not the server's token? check engine_token_file)"
        )
        await wait_for_error(controller, "failing", refused)
        # An admin call the controller relays to the engine says whose token was refused.
        code, drained = await admin_cli(controller, admin_token, "drain", address)
        assert code == 1
        assert drained.endswith(f"engine {address} failed the Drain: {refused}"), drained

        rotate(controller_engine_token, "engine-2")
        await wait_for_error(controller, "ready", "")

        rotate(admin_token, "admin-2")
        code, refused_admin = await admin_cli(controller, old_admin_token, "cordon", address)
        assert (code, refused_admin) == (
            1,
            f"127.0.0.1:{controller.port}: UNAUTHENTICATED: missing or invalid bearer token "
            "(metadata 'authorization: Bearer <token>') (not the server's token? check "
            "--token-file or $KVPLANE_TOKEN)",
        )
        assert not controller.controller.fleet.registry.get(address).cordoned
        code, cordoned = await admin_cli(controller, admin_token, "cordon", address)
        assert code == 0 and "cordoned" in cordoned, cordoned
    finally:
        await controller.close(0.2)
        await engine.close()
