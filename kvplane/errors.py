"""The root of kvplane's domain errors.

Adapters turn these into a gRPC status (see `kvplane.server.abort_with`) or, in the CLI, into one
line on stderr and exit code 1; a command reports a `CommandLineError` as a usage error (exit 2).
Anything else escaping is a bug and is logged with a traceback.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class KvplaneError(Exception):
    """A known, user-facing error: its message is shown as it is."""


class ConfigError(KvplaneError):
    """A configuration file or option is missing or invalid."""


class CommandLineError(ConfigError):
    """A value given on the command line cannot be used: a flag's (`--listen nonsense`), or
    the file `--config` names when it cannot be read. A command reports it as click reports a
    bad argument, `Invalid value for {param_hint}: {problem}` (`cli_common.load_command_config`);
    its message names the flag for any other caller."""

    def __init__(self, message: str, *, param_hint: str, problem: str) -> None:
        super().__init__(message)
        self.param_hint = param_hint
        self.problem = problem


@contextmanager
def config_in(where: str) -> Iterator[None]:
    """A ConfigError raised in the block, said of `where` (a file): `invalid config in WHERE:
    ...`."""
    try:
        yield
    except ConfigError as exc:
        raise ConfigError(f"invalid config in {where}: {exc}") from None
