"""Clients dialling TLS servers: the admin CLIs (`--tls-ca`, `--tls-cert`/`--tls-key`,
`--tls-server-name`), and the controller's own channels (`engine_tls` for its engines and their
KV events, `index.remote_tls` for a remote indexer). Real servers on 127.0.0.1 with
openssl-made certificates (the `pki` fixture)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from typer.testing import CliRunner, Result

from controller.app import start_controller
from controller.config import ControllerConfig
from controller.remote_index import RemoteIndex
from engine.config import LoraConfig
from indexer.backends import open_backend
from indexer.config import IndexerConfig
from indexer.service import build_source
from indexer.servicer import index_services
from kvplane.channels import ClientChannels, ClientSettings, setting_hint
from kvplane.cli import app
from kvplane.config import ClientTlsConfig, ServerConfig, TlsConfig
from kvplane.errors import ConfigError, KvplaneError
from kvplane.server import create_server
from kvplane_api.v1 import admin_pb2 as apb
from openengine.v1 import openengine_pb2 as pb
from openengine.v1 import openengine_pb2_grpc as pb_grpc
from tests.controller.conftest import (
    EngineFleet,
    close_fleet,
    generate_request,
    make_fleet,
    start_sim_engine,
)
from tests.controller.test_lora_engines import outcome_lines
from tests.engine.lora_adapters import write_adapter_config
from tests.polling import eventually

pytestmark = pytest.mark.timeout(60)

PREFIX = list(range(500, 564))  # 4 blocks of 16


def server_tls(pki: Path, *, mutual: bool = False) -> TlsConfig:
    return TlsConfig(
        cert_file=pki / "server.pem",
        key_file=pki / "server.key",
        client_ca_file=pki / "ca.pem" if mutual else None,
    )


def client_tls(pki: Path) -> dict[str, Any]:
    """A client's TLS: the CA and the client certificate (mutual TLS)."""
    return {
        "ca_file": pki / "ca.pem",
        "cert_file": pki / "client.pem",
        "key_file": pki / "client.key",
    }


async def cli(*args: str | Path) -> Result:
    return await asyncio.to_thread(CliRunner().invoke, app, ["admin", *map(str, args)])


def one_line_error(result: Result) -> str:
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, KvplaneError), result.exception
    message = str(result.exception)
    assert "\n" not in message
    return message


async def test_admin_cli_dials_a_tls_engine(pki: Path) -> None:
    engine = await start_sim_engine("e0", tls=server_tls(pki))
    target = f"127.0.0.1:{engine.port}"
    try:
        ok = await cli("--tls-ca", pki / "ca.pem", "--target", target, "health", "-o", "json")
        assert ok.exit_code == 0, ok.output
        assert '"HEALTH_STATE_READY"' in ok.output
        workers = await cli("--tls-ca", pki / "ca.pem", "-t", target, "workers")
        assert workers.exit_code == 0 and "e0" in workers.output, workers.output
        # The name checked in the server's certificate: the target's host unless overridden.
        named = await cli(
            "--tls-ca", pki / "ca.pem", "--tls-server-name", "localhost", "-t", target, "load"
        )
        assert named.exit_code == 0, named.output

        plain = one_line_error(await cli("-t", target, "health"))
        assert plain.startswith(f"{target}: UNAVAILABLE: ")
        assert plain.endswith("(a TLS server? give --tls-ca)")
        wrong_ca = one_line_error(await cli("--tls-ca", pki / "other-ca.pem", "-t", target, "info"))
        assert wrong_ca.startswith(f"{target}: UNAVAILABLE: ")
        assert "CERTIFICATE_VERIFY_FAILED" in wrong_ca
        wrong_name = await cli(
            "--tls-ca", pki / "ca.pem", "--tls-server-name", "elsewhere", "-t", target, "load"
        )
        assert "UNAVAILABLE" in one_line_error(wrong_name)

        # A half client certificate is a usage error (unusable files: below).
        half = await cli("--tls-ca", pki / "ca.pem", "--tls-cert", pki / "client.pem", "health")
        assert half.exit_code == 2 and "--tls-cert and --tls-key go together" in half.output
    finally:
        await engine.close()


@pytest.mark.parametrize("group", [["admin"], ["admin", "index"]])
@pytest.mark.parametrize(
    ("options", "error"),
    [
        (
            ["--tls-ca", "nope.pem"],
            "--tls-ca: cannot read TLS CA file {pki}/nope.pem: No such file or directory",
        ),
        (["--tls-ca", "ca.key"], "--tls-ca: TLS CA file {pki}/ca.key does not hold a certificate"),
        (
            ["--tls-cert", "nope.pem", "--tls-key", "client.key"],
            "--tls-cert: cannot read TLS certificate file {pki}/nope.pem: No such file",
        ),
        (
            ["--tls-cert", "client.pem", "--tls-key", "client.pem"],
            "--tls-key: TLS key file {pki}/client.pem does not hold a private key in PEM",
        ),
        (
            ["--tls-cert", "client.pem", "--tls-key", "server.key"],
            "--tls-key: TLS key file {pki}/server.key cannot be used with certificate "
            "{pki}/client.pem: not its key",
        ),
    ],
)
def test_a_tls_file_that_cannot_be_used_is_a_usage_error_naming_its_option(
    pki: Path, group: list[str], options: list[str], error: str
) -> None:
    """A file an option gives that is missing or not what it must hold: a usage error naming
    the option, before any call (it was exit 1, one line naming the file only)."""
    files = [option if option.startswith("--") else str(pki / option) for option in options]
    command = [*group, *files, "-t", "127.0.0.1:1", "health" if len(group) == 1 else "stats"]
    result = subprocess.run(
        [sys.executable, "-m", "kvplane", *command],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).parents[2],
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("Usage: ") and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"Error: Invalid value for {error.format(pki=pki)}"), last


async def test_tls_to_a_plaintext_server_says_the_server_is_plaintext(pki: Path) -> None:
    engine = await start_sim_engine("e0")
    target = f"127.0.0.1:{engine.port}"
    try:
        tls = one_line_error(await cli("--tls-ca", pki / "ca.pem", "-t", target, "health"))
        assert tls.startswith(f"{target}: UNAVAILABLE: ")
        assert tls.endswith("(a plaintext server? leave out --tls-ca)")
    finally:
        await engine.close()


async def test_a_refused_tls_handshake_is_one_line_from_the_kvplane_process(pki: Path) -> None:
    """The `kvplane` process itself (not CliRunner, whose process imported gRPC long before):
    a server certificate the CA does not verify is the CLI's one error line on stderr, without
    gRPC core's own INFO line about the handshake."""
    engine = await start_sim_engine("e0", tls=server_tls(pki))
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    target = f"127.0.0.1:{engine.port}"
    command = [sys.executable, "-m", "kvplane", "admin", "--tls-ca", str(pki / "other-ca.pem")]
    try:
        result = await asyncio.to_thread(
            subprocess.run,
            [*command, "-t", target, "info"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
    finally:
        await engine.close()
    assert result.returncode == 1
    assert result.stderr.startswith(f"kvplane: error: {target}: UNAVAILABLE: ")
    assert "CERTIFICATE_VERIFY_FAILED" in result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr


async def test_admin_cli_mutual_tls(pki: Path) -> None:
    engine = await start_sim_engine("e0", tls=server_tls(pki, mutual=True))
    target = f"127.0.0.1:{engine.port}"
    ca = ("--tls-ca", pki / "ca.pem")
    try:
        anonymous = one_line_error(await cli(*ca, "-t", target, "health"))
        assert anonymous.startswith(f"{target}: UNAVAILABLE: ")
        assert anonymous.endswith("(a server requiring a client certificate? give --tls-cert "
                                  "and --tls-key)")  # fmt: skip
        with_cert = await cli(
            *ca, "--tls-cert", pki / "client.pem", "--tls-key", pki / "client.key",
            "-t", target, "health",
        )  # fmt: skip
        assert with_cert.exit_code == 0 and "HEALTH_STATE_READY" in with_cert.output
    finally:
        await engine.close()


async def test_admin_index_dials_a_mutual_tls_indexer(pki: Path) -> None:
    services, _, _ = index_services(
        await open_backend("memory"), default_block_size=16, max_concurrent_prefix_queries=8
    )
    config = ServerConfig(listen="127.0.0.1:0", tls=server_tls(pki, mutual=True))
    server, port = await create_server(config, services)
    target = f"127.0.0.1:{port}"
    tls: list[str | Path] = ["--tls-ca", pki / "ca.pem", "--tls-cert", pki / "client.pem"]
    tls += ["--tls-key", pki / "client.key"]
    try:
        # On the `admin` group (as --target) or on `admin index` itself.
        for args in ([*tls, "index", "-t", target], ["index", *tls, "-t", target]):
            stats = await cli(*args, "stats", "-o", "json")
            assert stats.exit_code == 0 and '"num_blocks": 0' in stats.output, stats.output
        plain = one_line_error(await cli("index", "-t", target, "stats"))
        assert plain.endswith("(a TLS server? give --tls-ca)")
    finally:
        await server.stop(None)


async def test_controller_routes_to_mutual_tls_engines_and_follows_their_kv_events(
    pki: Path,
) -> None:
    """Engines that require a client certificate; the controller, itself serving TLS, dials
    them with `engine_tls`: health and load polls, the relayed Generate and the
    SubscribeKvEvents that feeds the index all go through TLS."""
    engines = [await start_sim_engine(f"e{i}", tls=server_tls(pki, mutual=True)) for i in (0, 1)]
    config = ControllerConfig.model_validate(
        {
            "listen": "127.0.0.1:0",
            "tls": server_tls(pki).model_dump(),
            "engines": [{"address": f"127.0.0.1:{e.port}"} for e in engines],
            "engine_tls": client_tls(pki),
            "router": {"seed": 0},
            "health": {"poll_interval_s": 0.2, "backoff_initial_s": 0.1, "backoff_max_s": 1.0},
            "shutdown_grace_s": 0.5,
        }
    )
    controller = await start_controller(config)
    channels = ClientChannels.load(ClientTlsConfig(ca_file=pki / "ca.pem"))
    fleet = EngineFleet(engines, controller, channels.aio_channel(f"localhost:{controller.port}"))
    try:
        await fleet.wait_routable(2)
        responses = [r async for r in fleet.gateway.Generate(generate_request("a", [*PREFIX, 1]))]
        assert responses[-1].WhichOneof("event") == "finished", responses[-1]

        holder: list[str] = []

        async def indexed() -> bool:
            reply = await fleet.admin.Match(apb.PromptQuery(token_ids=pb.TokenIds(ids=PREFIX)))
            holder[:] = [m.engine for m in reply.matches if m.device_blocks >= 4]
            return bool(holder)

        await eventually(indexed)
        route = await fleet.admin.Route(apb.PromptQuery(token_ids=pb.TokenIds(ids=[*PREFIX, 2])))
        assert (route.engine, route.reason) == (holder[0], "cache")

        workers = await cli("--tls-ca", pki / "ca.pem", "-t", fleet.target, "workers")
        assert workers.exit_code == 0 and "e0" in workers.output and "e1" in workers.output
    finally:
        await close_fleet(fleet)


async def test_remote_index_over_tls(pki: Path) -> None:
    services, _, _ = index_services(
        await open_backend("memory"), default_block_size=16, max_concurrent_prefix_queries=8
    )
    config = ServerConfig(listen="127.0.0.1:0", tls=server_tls(pki, mutual=True))
    server, port = await create_server(config, services)
    secure = RemoteIndex(
        f"127.0.0.1:{port}",
        5.0,
        channels=ClientChannels.load(ClientTlsConfig.model_validate(client_tls(pki))),
    )
    plain = RemoteIndex(f"127.0.0.1:{port}", 5.0)
    try:
        assert (await secure.stats()).num_blocks == 0
        with pytest.raises(KvplaneError) as refused:
            await plain.stats()
        assert str(refused.value) == (
            "remote index: UNAVAILABLE: the server closed the connection (Socket closed) (a "
            "TLS server? give index.remote_tls)"
        )
    finally:
        await secure.close()
        await plain.close()
        await server.stop(None)


async def test_unusable_client_tls_files_are_config_errors(pki: Path, tmp_path: Path) -> None:
    missing = tmp_path / "missing.pem"
    with pytest.raises(ConfigError) as err:
        await start_controller(ControllerConfig(engine_tls=ClientTlsConfig(ca_file=missing)))
    assert str(err.value) == (
        f"engine_tls: cannot read TLS CA file {missing}: No such file or directory"
    )
    remote = {"remote": "127.0.0.1:1", "remote_tls": {"ca_file": pki / "client.key"}}
    with pytest.raises(ConfigError, match=r"^index.remote_tls: TLS CA file .* a certificate"):
        await start_controller(ControllerConfig.model_validate({"index": remote}))
    with pytest.raises(ValueError, match="cert_file and key_file go together"):
        ControllerConfig.model_validate({"engine_tls": {"cert_file": pki / "client.pem"}})
    indexer = IndexerConfig.model_validate(
        {"sources": [{"kind": "openengine", "target": "127.0.0.1:1", "tls": {"ca_file": missing}}]}
    )
    with pytest.raises(ConfigError, match=r"^source 127.0.0.1:1: tls: cannot read TLS CA file"):
        build_source(indexer.sources[0], await open_backend("memory"), 16)


def test_a_hang_up_the_controller_reports_of_its_engine_gets_no_tls_hint() -> None:
    """A controller's status naming one of its engines ("engine ADDRESS failed the Drain:
    UNAVAILABLE: Stream removed (Socket closed)": that engine's process died) says nothing of
    the connection to the controller, so no TLS setting is suggested for it; gRPC's own
    hang-up on that connection still gets the hint."""
    flags = ClientSettings(tls="--tls-ca", client_certificate="--tls-cert")
    engine_died = (
        "engine 127.0.0.1:9001 failed the Drain: UNAVAILABLE: Stream removed (Socket closed)"
    )
    assert setting_hint(ClientChannels(), grpc.StatusCode.UNAVAILABLE, engine_died, flags) == ""
    hung_up = "Stream removed (Socket closed)"
    hint = setting_hint(ClientChannels(), grpc.StatusCode.UNAVAILABLE, hung_up, flags)
    assert hint == " (a TLS server? give --tls-ca)"


@pytest.mark.parametrize(
    ("serves", "client", "error"),
    [
        (
            "other-ca-server",
            [],
            "TLS handshake failed: CERTIFICATE_VERIFY_FAILED: unable to get local issuer "
            "certificate (a server certificate not signed by the CA of --tls-ca?)",
        ),
        (
            "expired",
            [],
            "TLS handshake failed: CERTIFICATE_VERIFY_FAILED: certificate has expired (the "
            "server's certificate has expired: renew it)",
        ),
        (
            "elsewhere",
            [],
            "TLS handshake failed: the server certificate's names do not include the host "
            "dialled (a server certificate for another name? give the server one for the host "
            "dialled, or set --tls-server-name)",
        ),
        (
            "server+client_ca",
            ["--tls-cert", "other-ca-client.pem", "--tls-key", "other-ca-client.key"],
            "the server closed the connection (Socket closed) (a client certificate the server "
            "does not trust? check --tls-cert and --tls-key)",
        ),
    ],
    ids=["other-ca", "expired", "other-name", "untrusted-client-certificate"],
)
async def test_a_server_certificate_that_does_not_verify_is_said_so_in_one_line(
    pki: Path, serves: str, client: list[str], error: str
) -> None:
    """Why the handshake failed, in words, and what to check: not gRPC's trail ("failed to
    connect to all addresses; last error: UNKNOWN: ipv4:...: Tls handshake failed
    (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:..."), nor a bare
    "Socket closed" for a client certificate the server refused."""
    certificate, _, mutual = serves.partition("+")
    tls = TlsConfig(
        cert_file=pki / f"{certificate}.pem",
        key_file=pki / f"{certificate}.key",
        client_ca_file=pki / "ca.pem" if mutual else None,
    )
    engine = await start_sim_engine("e0", tls=tls)
    target = f"127.0.0.1:{engine.port}"
    files = [pki / option if option.endswith((".pem", ".key")) else option for option in client]
    try:
        message = one_line_error(
            await cli("--tls-ca", pki / "ca.pem", *files, "-t", target, "health")
        )
    finally:
        await engine.close()
    assert message == f"{target}: UNAVAILABLE: {error}"


async def test_a_refused_token_names_the_clis_token_options(pki: Path, tmp_path: Path) -> None:
    """A server with `auth` refusing a mutating call says which option gives the token: none
    given, or not the server's, whether the group's --token-file gave it or the command's
    own (which was told to give one). Read-only calls still answer without one."""
    token, wrong = tmp_path / "token", tmp_path / "wrong"
    token.write_text("right\n")
    wrong.write_text("wrong\n")
    services, _, _ = index_services(
        await open_backend("memory"), default_block_size=16, max_concurrent_prefix_queries=8
    )
    indexer, indexer_port = await create_server(
        ServerConfig.model_validate({"listen": "127.0.0.1:0", "auth": {"token_file": token}}),
        services,
    )
    engine = await start_sim_engine("e0", auth={"token_file": token})
    target, index_target = f"127.0.0.1:{engine.port}", f"127.0.0.1:{indexer_port}"
    try:
        anonymous = one_line_error(await cli("-t", target, "drain", "--self"))
        refused = [
            one_line_error(await cli("--token-file", wrong, "-t", target, "drain", "--self")),
            one_line_error(await cli("-t", target, "drain", "--self", "--token-file", wrong)),
            one_line_error(await cli("-t", target, "abort", "--all", "--token-file", wrong)),
            one_line_error(
                await cli("index", "-t", index_target, "resync", "e0", "--token-file", wrong)
            ),
        ]
        read = await cli("-t", target, "health")
    finally:
        await engine.close()
        await indexer.stop(None)
    unauthenticated = (
        "UNAUTHENTICATED: missing or invalid bearer token (metadata 'authorization: "
        "Bearer <token>')"
    )
    options = "--token-file or $KVPLANE_TOKEN"
    assert anonymous == f"{target}: {unauthenticated} (a server requiring a token? give {options})"
    not_its_token = f"{unauthenticated} (not the server's token? check {options})"
    assert refused == [
        *[f"{target}: {not_its_token}"] * 3,
        f"{index_target}: {not_its_token}",
    ]
    assert read.exit_code == 0 and "HEALTH_STATE_READY" in read.output, read.output


async def test_a_commands_token_file_is_sent_on_every_call_the_command_makes(
    tmp_path: Path,
) -> None:
    """A controller with `auth.protect_reads` asks for its token on ListWorkers too, which
    `register --wait` polls and `lora load/unload --engine` call to check the fleet before the
    load: the command's own --token-file is sent on those calls as on the one that changes
    the fleet (they carried no token, and the command failed UNAUTHENTICATED after the engine
    was registered, or before the adapter was loaded)."""
    token = tmp_path / "token"
    token.write_text("the-controller-token\n")
    fleet = await make_fleet(
        engines=[await start_sim_engine("e0", lora=LoraConfig(enabled=True))],
        auth={"token_file": token, "protect_reads": True},
    )
    extra = await start_sim_engine("e1")
    t: list[str | Path] = ["--target", fleet.target, "--token-file", token]
    try:
        registered = await cli("register", fleet.address(extra), "--wait-s", "30", *t, "-o", "json")
        adapter = write_adapter_config(tmp_path / "x")
        loaded = await cli("lora", "load", "x", adapter, "--id", "1", "--engine", "e0", *t)
        unloaded = await cli("lora", "unload", "x", "--engine", "e0", *t)
    finally:
        await close_fleet(fleet)
        await extra.close()
    assert registered.exit_code == 0, registered.output
    assert json.loads(registered.stdout)["instance_id"] == "e1"
    assert loaded.exit_code == 0, loaded.output
    assert outcome_lines(loaded.stdout) == {"e0": "ok"}
    assert unloaded.exit_code == 0, unloaded.output
    assert outcome_lines(unloaded.stdout) == {"e0": "ok"}


async def test_a_kv_event_source_says_why_its_engine_cannot_be_dialled(
    pki: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An openengine source (the indexer's, the controller's per engine) whose engine serves
    a certificate that does not verify: its warning gives OpenSSL's reason, not gRPC's trail
    of addresses and library error numbers, and (the indexer's) what to do."""
    engine = await start_sim_engine(
        "e0", tls=TlsConfig(cert_file=pki / "expired.pem", key_file=pki / "expired.key")
    )
    target = f"127.0.0.1:{engine.port}"
    config = IndexerConfig.model_validate(
        {"sources": [{"kind": "openengine", "target": target, "tls": {"ca_file": pki / "ca.pem"}}]}
    )
    source = build_source(config.sources[0], await open_backend("memory"), 16)
    warning = (
        f"openengine source {target}: UNAVAILABLE: TLS handshake failed: "
        "CERTIFICATE_VERIFY_FAILED: certificate has expired (the server's certificate has "
        "expired: renew it)"
    )
    task = asyncio.ensure_future(source.run())
    try:
        await eventually(lambda: warning in [r.getMessage() for r in caplog.records])
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await engine.close()


async def test_an_indexer_source_presents_its_token_file_to_an_engine_protecting_reads(
    pki: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine run with mutual TLS and `auth.protect_reads` asks for its token on
    SubscribeKvEvents too: an indexer's openengine source with `tls` and `token_file` follows
    it (the prompt a client sent is indexed), one with another token is refused and says
    which setting to check, the token itself in no log line."""
    token, wrong = tmp_path / "token", tmp_path / "wrong"
    token.write_text("the-engine-token\n")
    wrong.write_text("another-token\n")
    engine = await start_sim_engine(
        "e0",
        tls=server_tls(pki, mutual=True),
        auth={"token_file": token, "protect_reads": True},
    )
    target = f"127.0.0.1:{engine.port}"

    def source_of(token_file: Path) -> Any:
        config = IndexerConfig.model_validate(
            {
                "sources": [
                    {
                        "kind": "openengine",
                        "target": target,
                        "hash": "canonical",
                        "tls": client_tls(pki),
                        "token_file": token_file,
                    }
                ]
            }
        )
        return config.sources[0]

    backend = await open_backend("memory")
    following = build_source(source_of(token), backend, 16)
    refused = build_source(source_of(wrong), await open_backend("memory"), 16)
    tasks = [asyncio.ensure_future(s.run()) for s in (following, refused)]
    client = ClientChannels.load(ClientTlsConfig(**client_tls(pki))).with_token_file(token, "token")
    warning = (
        f"openengine source {target}: UNAUTHENTICATED: missing or invalid bearer token "
        "(metadata 'authorization: Bearer <token>') (not the server's token? check the "
        "source's token_file)"
    )
    try:
        async with client.aio_channel(f"localhost:{engine.port}") as channel:
            stub = pb_grpc.OpenEngineStub(channel)
            async for _ in stub.Generate(generate_request("a", [*PREFIX, 1])):
                pass

        async def indexed() -> bool:
            return (await backend.stats()).num_blocks >= 4

        await eventually(indexed)
        await eventually(lambda: warning in [r.getMessage() for r in caplog.records])
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await engine.close()
    assert not [r for r in caplog.records if "the-engine-token" in r.getMessage()]
