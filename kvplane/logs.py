"""Structured logging, configured once by the CLI's `main()`.

Records are one line each: `ts level logger message key=value...` for people, or one JSON
object per line (`--log-format json`) for log pipelines. Extra fields passed with
`log.info("...", extra={"fields": {...}})` are appended as key=value pairs / JSON keys.
"""

from __future__ import annotations

import enum
import json
import logging
import sys


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


def configure_logging(level: LogLevel = LogLevel.INFO, fmt: LogFormat = LogFormat.TEXT) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt is LogFormat.JSON else _TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.value)
    # grpc's and asyncio's own chatter stays at WARNING unless asked for.
    for noisy in ("asyncio", "grpc"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
