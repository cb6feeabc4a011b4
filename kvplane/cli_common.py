"""Pieces every command group uses: output formats and the server command options."""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import grpc
import typer

from kvplane.errors import KvplaneError, NotImplementedYetError


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


class RpcCallError(KvplaneError):
    """A CLI's RPC failed (unreachable target, rejected call): shown as one line."""


# What a gRPC server (grpcio, as every kvplane server) answers for a method it does not have.
METHOD_NOT_FOUND = "Method not found!"


@contextmanager
def rpc_channel(target: str, expects: str | None = None) -> Iterator[grpc.Channel]:
    """An insecure channel to `target` whose gRPC errors become one-line RpcCallErrors.
    `expects`: what the target should be ("a kvplane indexer"); a server without the method
    called (another kind of server) is then said to be something else, rather than gRPC's
    "UNIMPLEMENTED: Method not found!"."""
    with grpc.insecure_channel(target) as channel:
        try:
            yield channel
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            if expects and code == grpc.StatusCode.UNIMPLEMENTED and details == METHOD_NOT_FOUND:
                raise RpcCallError(
                    f"{target} is not {expects}: it does not serve this call"
                ) from None
            name = code.name if code is not None else "ERROR"
            raise RpcCallError(f"{target}: {name}: {details}") from None


def emit(data: Any, output: OutputFormat, render: Callable[[Any], str]) -> None:
    """Print `data` as JSON or through `render` as a human table/line."""
    if output is OutputFormat.json:
        typer.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        typer.echo(render(data))


def fail_not_implemented(what: str) -> NoReturn:
    raise NotImplementedYetError(f"{what}: not implemented yet")
