"""The root of kvplane's domain errors.

Adapters turn these into a gRPC status (see `kvplane.server.abort_with`) or, in the CLI, into one
line on stderr and exit code 1. Anything else escaping is a bug and is logged with a traceback.
"""

from __future__ import annotations


class KvplaneError(Exception):
    """A known, user-facing error: its message is shown as it is."""


class ConfigError(KvplaneError):
    """A configuration file or option is missing or invalid."""
