"""Pieces every command group uses: output formats and the server command options."""

from __future__ import annotations

import enum
import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Protocol

import grpc
import typer
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvplane.channels import (
    INSECURE,
    METHOD_NOT_FOUND,
    ClientChannels,
    ClientSettings,
    Metadata,
    failure_details,
)
from kvplane.client_tls import TlsFileError, TlsFileField
from kvplane.config import (
    ClientTlsConfig,
    ConfigT,
    bearer_token_problem,
    load_config,
    parse_dial_target,
    read_token_file,
)
from kvplane.errors import CommandLineError, ConfigError, KvplaneError
from kvplane.server import bearer_token_metadata


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


def _port_file_in_a_folder(value: Path | None) -> Path | None:
    """Refused before the server starts, not once it serves (the port is written then)."""
    if value is not None and not value.parent.is_dir():
        raise typer.BadParameter(f"folder {value.parent} does not exist")
    if value is not None and value.is_dir():
        raise typer.BadParameter(f"{value} is a folder: give the path of a file to write")
    return value


PortFileOption = Annotated[
    Path | None,
    typer.Option(
        "--port-file",
        help="Write the bound port here once listening (for port 0 and scripts).",
        callback=_port_file_in_a_folder,
    ),
]


def policy_list(text: str, choices: Sequence[str]) -> list[str]:
    """A `--policies` value: comma-separated names, at least one, each one of `choices`, none
    twice (results are keyed by name: a repeated one would run twice and show once). Raises
    ValueError saying what is wrong (each command reports it in its own way)."""
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in choices]
    if unknown or not names:
        what = f"unknown {', '.join(map(repr, unknown))}" if unknown else "no policy given"
        raise ValueError(f"{what}; choose from {', '.join(choices)}")
    repeated = sorted({p for p in names if names.count(p) > 1}, key=names.index)
    if repeated:
        raise ValueError(f"{', '.join(map(repr, repeated))} given more than once")
    return names


@contextmanager
def usage_error_for(param_hint: str) -> Iterator[None]:
    """Reading or checking the value of `param_hint` (an option, "--trace"): a KvplaneError or
    ValueError raised inside (a file missing, unreadable or in the wrong format, a value out
    of range, a malformed name) becomes a usage error, reported as click reports its own
    checks: the "Usage:" lines, `Error: Invalid value for --trace: ...`, exit 2. Everything
    a command refuses in its arguments goes through here (README: exit codes), so only a
    failure of the run itself (an engine refusing, a replay error) is exit 1."""
    try:
        yield
    except (KvplaneError, ValueError) as exc:
        raise typer.BadParameter(str(exc), param_hint=param_hint) from None


@contextmanager
def command_line_errors(param_hint: str | None = None) -> Iterator[None]:
    """Loading a config a command was given: a CommandLineError raised inside (a flag's value
    that cannot be used, or the config file that cannot be read) is a usage error naming the
    flag, or `param_hint` (the argument that gave the file), as `usage_error_for` makes it;
    a bad value in the file stays a ConfigError naming the file (exit 1)."""
    try:
        yield
    except CommandLineError as exc:
        raise typer.BadParameter(exc.problem, param_hint=param_hint or exc.param_hint) from None


def load_command_config(
    model: type[ConfigT], path: Path | None, flags: dict[str, object] | None = None
) -> ConfigT:
    """`load_config` of a command's `--config` and the flags that override it, with
    `command_line_errors`."""
    with command_line_errors():
        return load_config(model, path, flags)


def finite_number(value: float | None) -> float | None:
    """A callback for float options: click's FloatRange lets `inf` through a `min=` (and the
    JSON output would then carry `Infinity`, which is not JSON)."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


# The options of a benchmark that replays a Mooncake trace (`bench route`, `bench sim`).
TraceBlockSizeOption = Annotated[
    int, typer.Option(min=1, help="Tokens per KV block and per trace hash id.")
]
TraceSpeedupOption = Annotated[
    float,
    typer.Option(min=0.001, callback=finite_number, help="Arrivals at trace time / speedup."),
]


class NamedParameter(Protocol):
    """What names a click parameter (a `typer.CallbackParam`, the one a BadParameter holds)."""

    @property
    def param_type_name(self) -> str: ...
    @property
    def name(self) -> str | None: ...
    @property
    def opts(self) -> list[str]: ...


def param_hint_of(param: NamedParameter) -> str:
    """How a usage error names `param`, as README's exit codes show it: `--target` (an
    option's first long name), `ENGINE` (an argument), rather than click's own quoted list of
    every name of the option (`'--target' / '-t'`)."""
    if param.param_type_name == "argument":
        return (param.name or "").upper()
    long_names = [name for name in param.opts if name.startswith("--")]
    return (long_names or param.opts)[0]


@contextmanager
def usage_errors_named_as_ours() -> Iterator[None]:
    """Inside: a usage error of a parameter (click's own checks: a value out of range, not an
    integer, not a choice; a callback's BadParameter without a hint) names its parameter by
    `param_hint_of`, as every check of this project's does (`usage_error_for`). A missing
    one keeps click's wording (`Missing option '--config' / '-c'.`)."""
    try:
        yield
    except typer.BadParameter as exc:
        # Not its subclass MissingParameter, whose message is worded around click's hint.
        if type(exc) is typer.BadParameter and exc.param is not None and exc.param_hint is None:
            exc.param_hint = param_hint_of(exc.param)
        raise


def not_blank(what: str) -> Callable[[typer.CallbackParam, str | None], str | None]:
    """A callback for an argument or option that must hold text (`what`: what to give
    instead, "a name"): an empty or blank value (an unset shell variable) is a usage error
    here, named as the help names it, rather than a request the server refuses (exit 1) or
    one that asks about nothing. None: not given."""

    def check(param: typer.CallbackParam, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise typer.BadParameter(f"is empty: give {what}", param_hint=param_hint_of(param))
        return value

    return check


# An ENGINE, a REQUEST_ID, `--engine`: one thing on the server, which "" does not name.
a_name = not_blank("a name")


def _dial_target(value: str | None) -> str | None:
    """A --target must name one server: an empty one is a mistake (an unset shell variable),
    not "the default", and a port left out or out of range is refused here rather than
    handed to gRPC (which dials :443 for a missing port and wraps 73636 round to 8100, a
    different server, maybe the one a drain was not meant for)."""
    if value is None:
        return None
    if not value.strip():
        raise typer.BadParameter("is empty: give HOST:PORT")
    try:
        parse_dial_target(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return value


def target_option(help_text: str, default: str | None = None) -> Any:
    """The --target/-t option of a client command or group (None: not given). `default`:
    the server dialled when no --target is given (`ClientTarget.of`), shown by --help; its
    value stays None, so that a group's --target is not hidden behind a command's default."""
    return typer.Option(
        "--target", "-t", help=help_text, callback=_dial_target, show_default=default or False
    )


TlsCaOption = Annotated[
    Path | None,
    typer.Option(
        "--tls-ca",
        help="Dial with TLS, verifying the server with this CA (PEM).",
        show_default=False,
    ),
]
TlsCertOption = Annotated[
    Path | None,
    typer.Option("--tls-cert", help="Client certificate (PEM) for mutual TLS; with --tls-key."),
]
TlsKeyOption = Annotated[
    Path | None, typer.Option("--tls-key", help="Private key (PEM) of --tls-cert.")
]
TlsServerNameOption = Annotated[
    str | None,
    typer.Option(
        "--tls-server-name", help="Name to check in the server's certificate (default: its host)."
    ),
]


TokenFileOption = Annotated[
    Path | None,
    typer.Option(
        "--token-file", help="Bearer token file (else the group's --token-file, $KVPLANE_TOKEN)."
    ),
]

GroupTokenFileOption = Annotated[
    Path | None,
    typer.Option("--token-file", help="Bearer token file for every call (else $KVPLANE_TOKEN)."),
]


def token_of(token_file: Path | None) -> str | None:
    """The bearer token a `--token-file` holds (None without one). A file missing,
    unreadable or empty is a usage error naming the option, as any file an option gives."""
    if token_file is None:
        return None
    with usage_error_for("--token-file"):
        return read_token_file(token_file, "token file")


def bearer_metadata(token_file: Path | None) -> Metadata:
    """gRPC metadata carrying the bearer token of a `--token-file`; empty without one."""
    return bearer_token_metadata(token_of(token_file))


def default_token_metadata(given: Metadata | None) -> Metadata:
    """The token every call of a client command carries: the one `given` (its own
    --token-file's, else its group's, read by `remember_group_client`), else $KVPLANE_TOKEN
    (a server without auth ignores it; one with `protect_reads` needs it on reads too)."""
    if given is not None:
        return given
    token = os.environ.get("KVPLANE_TOKEN")
    problem = None if token is None else bearer_token_problem(token)
    if problem is not None:
        raise ConfigError(f"$KVPLANE_TOKEN {problem}")
    return bearer_token_metadata(token)


# The flag that gives each file of a ClientTlsConfig.
_TLS_FILE_FLAGS: dict[TlsFileField, str] = {
    "ca_file": "--tls-ca",
    "cert_file": "--tls-cert",
    "key_file": "--tls-key",
}


def client_channels(
    ca: Path | None, cert: Path | None, key: Path | None, server_name: str | None
) -> ClientChannels | None:
    """The --tls-* options as ClientChannels; None when none is given (the caller's default).
    Any of them turns TLS on (without --tls-ca the system's trusted roots verify the server).
    A file missing, unreadable or not PEM (or a key not the certificate's) is a usage error
    naming its option."""
    if ca is None and cert is None and key is None and server_name is None:
        return None
    if (cert is None) != (key is None):
        raise typer.BadParameter("--tls-cert and --tls-key go together")
    if server_name == "":
        raise typer.BadParameter("--tls-server-name is empty")
    tls = ClientTlsConfig(ca_file=ca, cert_file=cert, key_file=key, server_name=server_name)
    try:
        return ClientChannels.load(tls)
    except TlsFileError as exc:  # a file an option gives: a usage error naming the option
        raise typer.BadParameter(str(exc), param_hint=_TLS_FILE_FLAGS[exc.field]) from None


# `kvplane admin [--target T] [--tls-* ...] [index [--target T] ...] COMMAND`: what the groups
# were given for this invocation, kept in the context's `meta`, one dict shared by all the
# nested contexts of an invocation. An inner group's callback runs after the outer one's, so
# the nearest group wins; a command's own --target wins over every group's.
_GROUP_TARGET = "kvplane.client.target"
_GROUP_CHANNELS = "kvplane.client.channels"
_GROUP_TOKEN = "kvplane.client.token"


def remember_group_client(
    ctx: typer.Context,
    target: str | None,
    channels: ClientChannels | None,
    token_file: Path | None = None,
) -> None:
    """Called by a command group's callback with its --target, --tls-* and --token-file
    options. The token file is read here, as the --tls-* files are (`client_channels`): a
    bad one is a usage error of the group that took it, not of the command run under it."""
    if target:
        ctx.meta[_GROUP_TARGET] = target
    if channels is not None:
        ctx.meta[_GROUP_CHANNELS] = channels
    if token_file is not None:
        ctx.meta[_GROUP_TOKEN] = bearer_metadata(token_file)


@dataclass(frozen=True, slots=True)
class ClientTarget:
    """The server a client command talks to, and how (plaintext or the groups' TLS)."""

    address: str
    channels: ClientChannels
    # The command's --token-file's token, else its groups'; None: neither given.
    token: Metadata | None = None

    @classmethod
    def given(
        cls, address: str, channels: ClientChannels | None, token_file: Path | None
    ) -> ClientTarget:
        """A command of no group (`kvplane complete`) with its own --target, --tls-*
        (`client_channels`: None, plaintext) and --token-file (None: $KVPLANE_TOKEN)."""
        return cls(address, channels or INSECURE, bearer_metadata(token_file) or None)

    @classmethod
    def of(
        cls, ctx: typer.Context, target: str | None, default: str, token_file: Path | None = None
    ) -> ClientTarget:
        """The command's --target, else its groups', else `default`; every call carrying the
        token of the command's own --token-file (`token_file`), else the groups'. (Carried by
        the channel, not given call by call, so that a refused token's hint knows one was
        sent: "not the server's token?", not "give --token-file".)"""
        address = target or ctx.meta.get(_GROUP_TARGET) or default
        token = bearer_metadata(token_file) or ctx.meta.get(_GROUP_TOKEN)
        return cls(address, ctx.meta.get(_GROUP_CHANNELS, INSECURE), token)

    def channel(self, expects: str | None = None) -> AbstractContextManager[grpc.Channel]:
        """`rpc_channel` to this server, every call carrying the default token and taking
        replies of any size: a command prints what it asked for, and some answers grow with
        the request (a long prompt's block keys passed gRPC's 4 MiB default)."""
        metadata = default_token_metadata(self.token)
        channels = self.channels.receiving_any_size().with_metadata(metadata)
        return rpc_channel(self.address, expects, channels)


# The deadline of each unary call of a client command: a target that lets it pass (hung,
# stopped, overloaded) is reported as not answering (rpc_channel) rather than waited for.
RPC_TIMEOUT_S = 10.0


class RpcCallError(KvplaneError):
    """A CLI's RPC failed (unreachable target, rejected call): shown as one line."""


# What grpcio reports when a call's own deadline passes (a server relaying another's
# DEADLINE_EXCEEDED, or refusing a deadline already passed, says something of its own).
CLIENT_DEADLINE_PASSED = "Deadline Exceeded"
# The CLIs' TLS, token and target options, as `rpc_channel`'s errors name them.
_CLIENT_FLAGS = ClientSettings(
    "--tls-ca",
    "--tls-cert and --tls-key",
    "--token-file or $KVPLANE_TOKEN",
    "--tls-server-name",
    "--target HOST:PORT",
)


# The service by which each kind of kvplane server is known, as each registers it
# (controller.app, indexer.servicer, engine.server): a controller serves OpenEngine too (its
# gateway), so the admin API is asked about first.
_KIND_BY_SERVICE = (
    ("kvplane.v1.Admin", "a kvplane controller"),
    ("kvplane.v1.KvIndex", "a kvplane indexer"),
    ("openengine.v1.OpenEngine", "a kvplane engine"),
)


def server_kind(channel: grpc.Channel) -> str | None:
    """What kind of kvplane server answers on `channel` ("a kvplane indexer"), for an error
    about a target of the wrong kind. Every kvplane server's health service knows each service
    it serves (`kvplane.server.create_server`; no token needed) and answers NOT_FOUND for the
    others. None: none of them answered (not a kvplane server)."""
    health = health_pb2_grpc.HealthStub(channel)
    for service, kind in _KIND_BY_SERVICE:
        try:
            health.Check(health_pb2.HealthCheckRequest(service=service), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError:
            continue
        return kind
    return None


# Said of a kvplane server of the kind a command needs that answers its call "Method not
# found!": a release older than the CLI's.
OLDER_RELEASE = "without this call (a kvplane release older than this CLI's? upgrade it)"


def is_kind(kind: str | None, expects: str) -> bool:
    """Whether `kind` (`server_kind`'s "a kvplane controller") is one that `expects` names
    ("a controller or an engine", "a kvplane indexer")."""
    return kind is not None and kind.rsplit(" ", 1)[-1] in expects.split()


@contextmanager
def rpc_channel(
    target: str, expects: str | None = None, channels: ClientChannels = INSECURE
) -> Iterator[grpc.Channel]:
    """A channel to `target` (insecure, or TLS per `channels`) whose gRPC errors become
    one-line RpcCallErrors. `expects`: what the target should be ("a kvplane indexer"); a
    server without the method called (another kind of server) is then said to be something
    else (what it is, when it is a kvplane server: `server_kind`; one of the kind expected is
    said to be older than the CLI), rather than gRPC's "UNIMPLEMENTED: Method not found!". A
    server that hangs up on
    the connection most likely wants TLS or a client certificate: the error says so. One that
    lets a call's deadline (RPC_TIMEOUT_S) pass is said not to have answered, rather than
    gRPC's "DEADLINE_EXCEEDED: Deadline Exceeded"."""
    with channels.channel(target) as channel:
        try:
            yield channel
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            if expects and code == grpc.StatusCode.UNIMPLEMENTED and details == METHOD_NOT_FOUND:
                kind = server_kind(channel)
                if is_kind(kind, expects):
                    raise RpcCallError(f"{target} is {kind} {OLDER_RELEASE}") from None
                what = f"it is {kind}" if kind else "it does not serve this call"
                raise RpcCallError(f"{target} is not {expects}: {what}") from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED and details == CLIENT_DEADLINE_PASSED:
                raise RpcCallError(
                    f"{target} did not answer within {RPC_TIMEOUT_S:g} s (is its process "
                    "hung, stopped or overloaded? check it and its log)"
                ) from None
            name = code.name if code is not None else "ERROR"
            raise RpcCallError(
                f"{target}: {name}: {failure_details(channels, code, details, _CLIENT_FLAGS)}"
            ) from None


# The widest models cell of a table (`admin workers`): the models past it are counted.
MODELS_CELL_WIDTH = 40


def models_cell(models: Sequence[str]) -> str:
    """An engine's models in one table cell: names joined by commas, as many as fit in
    `MODELS_CELL_WIDTH` (the first, its default model, always), the rest counted (`a,b,+3`).
    The whole list is in the JSON output."""
    shown: list[str] = []
    for i, model in enumerate(models):
        left = len(models) - i - 1
        cell = ",".join([*shown, model]) + (f",+{left}" if left else "")
        if shown and len(cell) > MODELS_CELL_WIDTH:
            break
        shown.append(model)
    left = len(models) - len(shown)
    return ",".join(shown) + (f",+{left}" if left else "")


def emit(data: Any, output: OutputFormat, render: Callable[[Any], str]) -> None:
    """Print `data` as JSON or through `render` as a human table/line."""
    if output is OutputFormat.json:
        typer.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        typer.echo(render(data))
