"""Azure LLM inference traces (`../shared/data/traces/azure-llm-2023/{code,conv}.csv`):
`TIMESTAMP,ContextTokens,GeneratedTokens`, one request a row, about an hour of Azure OpenAI
traffic. The planner benchmark's arrivals and lengths: ContextTokens is the prompt length,
GeneratedTokens the output length; the trace has no prefix information.

A file that cannot be replayed is a `TraceError` naming the file and the line (a missing
column, a timestamp that is not ISO 8601, a length that is not a positive integer, no rows).
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from kvplane.errors import KvplaneError

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TraceError(KvplaneError):
    """The trace file is missing, unreadable or malformed."""


@dataclass(frozen=True, slots=True)
class TraceRow:
    arrival_s: float  # since the trace's first request
    prompt_tokens: int
    output_tokens: int


def load_azure_trace(path: Path, limit: int | None = None) -> list[TraceRow]:
    """The first `limit` rows (all when None), sorted by arrival, times relative to the
    earliest."""
    try:
        with path.open(encoding="utf-8-sig", newline="") as lines:
            stamped = _read_rows(path, csv.reader(lines), limit)
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from exc
    except UnicodeDecodeError:
        raise TraceError(f"cannot read trace {path}: not UTF-8 text") from None
    except csv.Error as exc:
        raise TraceError(f"{path}: not CSV ({exc})") from None
    if not stamped:
        raise TraceError(f"trace {path} has no requests")
    stamped.sort(key=lambda r: r[0])
    start = stamped[0][0]
    return [TraceRow((t - start).total_seconds(), p, o) for t, p, o in stamped]


def _read_rows(
    path: Path, reader: Iterator[list[str]], limit: int | None
) -> list[tuple[datetime, int, int]]:
    header = next(reader, None)
    if header is None or tuple(h.strip() for h in header) != COLUMNS:
        raise TraceError(f"{path}:1: expected the header {','.join(COLUMNS)}")
    stamped: list[tuple[datetime, int, int]] = []
    for number, row in enumerate(reader, 2):
        if limit is not None and len(stamped) >= limit:
            break
        if any(cell.strip() for cell in row):
            try:
                stamped.append(_parse_row(row))
            except ValueError as exc:
                raise TraceError(f"{path}:{number}: {exc}") from None
    return stamped


def _parse_row(row: list[str]) -> tuple[datetime, int, int]:
    if len(row) != len(COLUMNS):
        raise ValueError(f"expected {len(COLUMNS)} columns, got {len(row)}")
    try:
        stamp = datetime.fromisoformat(row[0].strip())
    except ValueError:
        raise ValueError(f"TIMESTAMP {row[0]!r} is not an ISO 8601 time") from None
    if stamp.tzinfo is not None:  # compare with naive stamps as UTC
        stamp = stamp.astimezone(UTC).replace(tzinfo=None)
    return stamp, _positive(row[1], COLUMNS[1]), _positive(row[2], COLUMNS[2])


def _positive(cell: str, name: str) -> int:
    try:
        value = int(cell.strip())
    except ValueError:
        raise ValueError(f"{name} {cell!r} is not an integer") from None
    if value < 1:
        raise ValueError(f"{name} {value} is not positive")
    return value
