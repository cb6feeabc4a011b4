"""`kvplane controller ...` and `kvplane admin ...` commands."""

from __future__ import annotations

from typing import Annotated

import typer

from controller.admin_cli import DEFAULT_TARGET
from indexer.admin_cli import DEFAULT_TARGET as INDEX_DEFAULT_TARGET
from indexer.admin_cli import index_app
from kvplane.cli_common import (
    ConfigOption,
    GroupTokenFileOption,
    ListenOption,
    PortFileOption,
    TlsCaOption,
    TlsCertOption,
    TlsKeyOption,
    TlsServerNameOption,
    client_channels,
    load_command_config,
    remember_group_client,
    target_option,
)

controller_app = typer.Typer(no_args_is_help=True)
admin_app = typer.Typer(no_args_is_help=True)
admin_app.add_typer(index_app, name="index")

AdminTargetOption = Annotated[
    str | None,
    target_option(
        "HOST:PORT of the server to talk to.",
        f"{DEFAULT_TARGET}, {INDEX_DEFAULT_TARGET} for `admin index`",
    ),
]


@admin_app.callback()
def _admin_group(
    ctx: typer.Context,
    *,
    target: AdminTargetOption = None,
    tls_ca: TlsCaOption = None,
    tls_cert: TlsCertOption = None,
    tls_key: TlsKeyOption = None,
    tls_server_name: TlsServerNameOption = None,
    token_file: GroupTokenFileOption = None,
) -> None:
    """Admin CLI for a controller, an engine or an indexer (`--target HOST:PORT`; `--tls-ca`
    for a TLS server, with `--tls-cert`/`--tls-key` when it requires a client certificate;
    `--token-file` or $KVPLANE_TOKEN for one with `auth`)."""
    channels = client_channels(tls_ca, tls_cert, tls_key, tls_server_name)
    remember_group_client(ctx, target, channels, token_file)


@controller_app.command()
def serve(
    config: ConfigOption = None, listen: ListenOption = None, port_file: PortFileOption = None
) -> None:
    """Serve the fleet gateway (openengine.v1.OpenEngine) and the admin API."""
    from controller.app import serve_controller
    from controller.config import ControllerConfig

    cfg = load_command_config(ControllerConfig, config, {"listen": listen})
    serve_controller(cfg, port_file=port_file)


def _register_admin_commands() -> None:
    from controller.admin_cli import register

    register(admin_app)


_register_admin_commands()
