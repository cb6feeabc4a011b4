"""`kvplane engine ...` commands. torch is imported only when a torch model is served."""

from __future__ import annotations

import typer

from kvplane.cli_common import ConfigOption, ListenOption, fail_not_implemented

engine_app = typer.Typer(no_args_is_help=True)


@engine_app.command()
def serve(config: ConfigOption = None, listen: ListenOption = None) -> None:
    """Serve openengine.v1.OpenEngine and vllm.Generate over the bundled engine."""
    fail_not_implemented("kvplane engine serve")
