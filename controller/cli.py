"""`kvplane controller ...` and `kvplane admin ...` commands."""

from __future__ import annotations

import typer

from indexer.admin_cli import index_app
from kvplane.cli_common import ConfigOption, ListenOption, TargetOption, fail_not_implemented

controller_app = typer.Typer(no_args_is_help=True)
admin_app = typer.Typer(no_args_is_help=True)
admin_app.add_typer(index_app, name="index")


@controller_app.command()
def serve(config: ConfigOption = None, listen: ListenOption = None) -> None:
    """Serve the fleet gateway (openengine.v1.OpenEngine) and the admin API."""
    fail_not_implemented("kvplane controller serve")


@admin_app.command()
def workers(target: TargetOption = "127.0.0.1:50050") -> None:
    """List the fleet's engines."""
    fail_not_implemented("kvplane admin workers")
