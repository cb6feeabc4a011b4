"""The `kvplane` command: composes each component's command group and turns known errors
into one line on stderr.

Exit codes: 0 success, 1 a known error (bad config, unreachable target, RPC error, a run that
fails, output that cannot be written), 2 usage errors: any bad command-line argument
(`cli_common.usage_error_for`), a command left out (the group's help is printed), 130
interrupted (Ctrl-C), 141 output to a closed pipe (`| head`; silent, as coreutils).
"""

from __future__ import annotations

import errno
import functools
import importlib
import inspect
import os
import re
import signal
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from kvplane import __version__
from kvplane.cli_common import (
    OutputFormat,
    OutputOption,
    command_line_errors,
    emit,
    usage_errors_named_as_ours,
)
from kvplane.errors import KvplaneError
from kvplane.logs import LogFormat, LogLevel, configured_logging
from kvplane.up.member import join_fleet

# The command groups (and the one command) each component owns: where it is, and the help
# the root lists it with. Each is imported when a command line names it, or when a help or a
# completion lists them all: `kvplane engine serve`, as every engine of a fleet starts, does
# not import the controller's, planner's and benchmarks' modules (Redis' client among them),
# which took 0.35 s of the command's 0.55 s of imports.
_COMPONENT_COMMANDS: dict[str, tuple[str, str, str | None]] = {
    "complete": ("controller.complete_cli", "complete", None),  # a command: its own help
    "engine": ("engine.cli", "engine_app", "The bundled inference engine."),
    "indexer": ("indexer.cli", "indexer_app", "The KV prefix indexer service."),
    "controller": ("controller.cli", "controller_app", "The fleet controller and gateway."),
    "planner": ("planner.cli", "planner_app", "The fleet planner (scaling, draining)."),
    "admin": ("controller.cli", "admin_app", "Admin CLI for a controller or an engine."),
    "bench": ("kvplane.bench", "bench_app", "Benchmarks with side-by-side peers."),
}


# A line that is not prose running on: indented (an example, code, a list item's next line)
# or a list item ("- ", "* ", "1. ").
_STRUCTURED_LINE = re.compile(r"\s|[-*•] |\d+[.)] ")


def _flowed(help_text: str) -> str:
    """`help_text` with each prose paragraph after the first on one line, for the terminal to
    wrap at its width: typer's rich help keeps a docstring's line breaks, so at 80 columns a
    paragraph wrapped at 88 in the source read "... ends it" / "with an error.". The first
    paragraph, the summary a group lists, is kept (a one-line rule of its own). A paragraph
    with a list, an example or code in it (`_STRUCTURED_LINE`), or one that click's "\\b"
    line opens, is kept as written."""
    summary, *rest = inspect.cleandoc(help_text).split("\n\n")
    kept = (
        paragraph
        if paragraph.startswith("\b")
        or any(_STRUCTURED_LINE.match(line) for line in paragraph.splitlines())
        else paragraph.replace("\n", " ")
        for paragraph in rest
    )
    return "\n\n".join((summary, *kept))


def _flow_help(command: Any) -> None:
    """Flow (`_flowed`) the help of `command` and of every command under it."""
    if command.help:
        command.help = _flowed(command.help)
    for sub in getattr(command, "commands", {}).values():
        _flow_help(sub)


@functools.cache
def _component_command(name: str) -> Any:
    """The click command of `_COMPONENT_COMMANDS[name]`, as `app.add_typer` (a group) or
    `app.command` (a command) would have made it, its helps flowed (`_flowed`)."""
    module, attribute, help_text = _COMPONENT_COMMANDS[name]
    member = getattr(importlib.import_module(module), attribute)
    holder = typer.Typer()
    if isinstance(member, typer.Typer):
        holder.add_typer(member, name=name, help=help_text)
    else:
        holder.command(name)(member)
    command = typer.main.get_group(holder).commands[name]
    _flow_help(command)
    return command


class _KvplaneCommand(TyperGroup):
    """The root command group: a usage error of any command under it names its parameter as
    the project's own checks do (`usage_errors_named_as_ours`). A command's options are parsed
    inside its group's `invoke`, the root's own in its `make_context`. The components'
    commands are imported as they are asked for (`_COMPONENT_COMMANDS`). Every help, its own
    and its commands', flows to the terminal's width (`_flowed`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _flow_help(self)  # the root's help and its own commands'; the components' as loaded

    # The contexts are click's (typer's own copy of it, which it does not export): Any.
    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        with usage_errors_named_as_ours():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: Any) -> Any:
        with usage_errors_named_as_ours():
            return super().invoke(ctx)

    def list_commands(self, ctx: Any) -> list[str]:
        own = super().list_commands(ctx)
        return [*own, *(name for name in _COMPONENT_COMMANDS if name not in own)]

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        if args and args[0] not in self.commands and args[0] not in _COMPONENT_COMMANDS:
            # No such command: typer suggests the closest of those loaded, so load them all.
            for name in _COMPONENT_COMMANDS:
                self.get_command(ctx, name)
        return super().resolve_command(ctx, args)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name in _COMPONENT_COMMANDS and cmd_name not in self.commands:
            self.add_command(_component_command(cmd_name), cmd_name)
        return super().get_command(ctx, cmd_name)


app = typer.Typer(
    name="kvplane",
    cls=_KvplaneCommand,
    help="KV-aware routing and indexing control plane for LLM inference fleets.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def _root(
    ctx: typer.Context,
    log_level: Annotated[
        LogLevel, typer.Option(case_sensitive=False, help="Log level.")
    ] = LogLevel.INFO,
    log_format: Annotated[
        LogFormat, typer.Option(case_sensitive=False, help="Log format.")
    ] = LogFormat.TEXT,
) -> None:
    # For as long as the command runs: the context closes as it returns, or fails.
    ctx.with_resource(configured_logging(log_level, log_format))


@app.command()
def version(output: OutputOption = OutputFormat.table) -> None:
    """Print kvplane's version."""
    emit({"version": __version__}, output, lambda d: f"kvplane {d['version']}")


@app.command()
def up(
    config: Annotated[
        Path | None,
        typer.Argument(
            metavar="FLEET.yaml",
            help="Fleet YAML: its members (configs/local*.yaml, docs/up.md). Omitted: the "
            "embedded default fleet, as configs/local.yaml: three engines serving the builtin "
            "model and a controller on 127.0.0.1:8100.",
        ),
    ] = None,
    live: Annotated[bool, typer.Option(help="Show a live status table on a terminal.")] = True,
    check: Annotated[
        bool,
        typer.Option(
            "--check",
            help="Start the fleet, send requests with shared prefixes through the controller, "
            "verify answers and prefix routing, stop, and exit 0 (passed) or 1.",
        ),
    ] = False,
) -> None:
    """Start a local fleet of engines, indexers, a controller and planners until Ctrl-C."""
    import asyncio

    from kvplane.up.command import run_fleet
    from kvplane.up.config import load_fleet

    with command_line_errors(param_hint="FLEET.yaml"):  # a file that cannot be read: exit 2
        fleet = load_fleet(config)
    if not asyncio.run(run_fleet(fleet, live, check)):
        what = "kvplane up --check failed" if check else "kvplane up stopped: a member exited"
        raise KvplaneError(f"{what} (see the log above)")


# The exit status of a command whose reader went away (`kvplane admin workers | head -1`): a
# process killed by SIGPIPE, as a shell reports one (coreutils' `yes | head -1`: 141).
CLOSED_PIPE_EXIT = 128 + signal.SIGPIPE


def _after_closed_pipe(exc: BaseException) -> bool:
    """Whether `exc` is click's exit after a write to a closed pipe: it catches EPIPE around
    a command and exits 1, with the BrokenPipeError as the exit's context."""
    return isinstance(exc.__context__, BrokenPipeError)


def _leave_quietly_after_closed_pipe() -> None:
    """Exit CLOSED_PIPE_EXIT with nothing on stderr: stdout now writes to /dev/null, so the
    interpreter's last flush of what is still buffered does not fail and print a warning
    (Python's documented way: docs.python.org/3/library/signal.html, "Note on SIGPIPE")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    sys.exit(CLOSED_PIPE_EXIT)


# What writing the output fails with when its file cannot take it (`> /dev/full`, a full or
# over-quota disk, an I/O error): one line, exit 1, as `cat` says "write error".
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


def main() -> None:
    join_fleet()  # a member of a `kvplane up` fleet: die with it, keep to its CPUs
    try:
        # Outside standalone mode click returns a `typer.Exit`'s code instead of exiting.
        code = app(standalone_mode=False)
        sys.stdout.flush()  # a failure to write the last of the output is reported too
    except BrokenPipeError:
        _leave_quietly_after_closed_pipe()
    except OSError as exc:
        if exc.errno not in _WRITE_ERRNOS or exc.filename is not None:
            raise  # not a failed write (a file that cannot be opened names itself)
        typer.echo(f"kvplane: error: write error: {exc.strerror}", err=True)
        sys.exit(1)
    except KvplaneError as exc:
        typer.echo(f"kvplane: error: {exc}", err=True)
        sys.exit(1)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    except (typer.Exit, SystemExit) as exc:
        if _after_closed_pipe(exc):
            _leave_quietly_after_closed_pipe()
        code = getattr(exc, "exit_code", None)
        if code is None:
            code = getattr(exc, "code", 0)
        sys.exit(code or 0)
    except typer.TyperException as exc:
        # Usage errors (bad option, missing argument) surface here in non-standalone mode.
        show = getattr(exc, "show", None)
        if show is not None:
            show()
        sys.exit(int(getattr(exc, "exit_code", 2)))
    if isinstance(code, int) and code:
        sys.exit(code)
