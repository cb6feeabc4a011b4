"""Structured logging, configured by the `kvplane` command for as long as it runs.

Records are one line each: `ts level logger message key=value...` for people, or one JSON
object per line (`--log-format json`) for log pipelines. Extra fields passed with
`log.info("...", extra={"fields": {...}})` are appended as key=value pairs / JSON keys.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import sys
from collections.abc import Iterator


class LogLevel(enum.StrEnum):
    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


class LogFormat(enum.StrEnum):
    TEXT = "text"
    JSON = "json"


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = (
            f"{self.formatTime(record, '%Y-%m-%dT%H:%M:%S')} {record.levelname:<7} "
            f"{record.name}: {record.getMessage()}"
        )
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line += "".join(f" {k}={v}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, object] = {
            "ts": record.created,
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            payload.update(fields)
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


# The loggers whose level `configured_logging` sets: the root, and the libraries it quietens.
_QUIETENED = ("asyncio", "grpc")


@contextlib.contextmanager
def configured_logging(
    level: LogLevel = LogLevel.INFO, fmt: LogFormat = LogFormat.TEXT
) -> Iterator[None]:
    """The process's logging written to stderr at `level` in `fmt` while the block runs;
    afterwards the root logger's handlers and the levels set here are as they were. A command
    run in a process that goes on (a test's CliRunner, beside servers of its own) leaves that
    process's logging as it found it: its servers' later warnings are not written to the
    command's stderr, captured or closed by then."""
    root = logging.getLogger()
    names = ("", *_QUIETENED)
    levels = {name: logging.getLogger(name).level for name in names}
    handlers = root.handlers[:]
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt is LogFormat.JSON else _TextFormatter())
    root.handlers[:] = [handler]
    root.setLevel(level.value)
    # grpc's and asyncio's own chatter stays at WARNING unless asked for.
    for noisy in _QUIETENED:
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    try:
        yield
    finally:
        handler.flush()
        root.handlers[:] = handlers
        for name, previous in levels.items():
            logging.getLogger(name).setLevel(previous)
