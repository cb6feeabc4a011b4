"""Pieces every command group uses: output formats and the server command options."""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from kvplane.errors import NotImplementedYetError


class OutputFormat(enum.StrEnum):
    table = "table"
    json = "json"


OutputOption = Annotated[
    OutputFormat, typer.Option("--output", "-o", help="table (default) or json.")
]
ConfigOption = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="YAML config file; embedded defaults when omitted."),
]
ListenOption = Annotated[
    str | None, typer.Option("--listen", help="HOST:PORT to listen on (overrides the config).")
]
PortFileOption = Annotated[
    Path | None,
    typer.Option(
        "--port-file", help="Write the bound port here once listening (for port 0 and scripts)."
    ),
]
TargetOption = Annotated[
    str, typer.Option("--target", "-t", help="HOST:PORT of the server to talk to.")
]


def emit(data: Any, output: OutputFormat, render: Callable[[Any], str]) -> None:
    """Print `data` as JSON or through `render` as a human table/line."""
    if output is OutputFormat.json:
        typer.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        typer.echo(render(data))


def fail_not_implemented(what: str) -> NoReturn:
    raise NotImplementedYetError(f"{what}: not implemented yet")
