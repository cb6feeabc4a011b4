"""Mooncake-format traces (`../shared/data/traces/mooncake-fast25/*.jsonl`): one JSON object a
line, `timestamp` (ms), `input_length`, `output_length` and `hash_ids` (chained 512-token block
ids). The one parser of the benchmarks that replay them (`kvplane bench route`, `sim`, `e2e`):
a row that cannot be replayed is a KvplaneError naming the file and line, never a traceback
mid-run nor a NaN in a result."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvplane.errors import KvplaneError

# Token id of the filler for prompt tokens a row has no hash id for (one per request, never
# shared); hash ids stay below it, so a filler never equals a trace block.
FILLER_TOKEN_BASE = 1 << 31


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """The first `limit` rows of the trace (all when None; blank lines skipped), sorted by
    arrival. Raises KvplaneError for an unreadable file, a malformed row or no rows at all."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise KvplaneError(f"cannot read trace {path}: {exc.strerror}") from exc
    except UnicodeDecodeError:
        raise KvplaneError(f"cannot read trace {path}: not UTF-8 text") from None
    numbered = ((n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip())
    requests = []
    for number, line in itertools.islice(numbered, limit):
        try:
            requests.append(_parse_row(json.loads(line)))
        except (ValueError, KeyError, TypeError, OverflowError) as exc:
            raise KvplaneError(f"{path}:{number}: not a Mooncake trace row ({exc})") from None
    if not requests:
        raise KvplaneError(f"trace {path} has no requests")
    requests.sort(key=lambda r: r.arrival_ms)
    return requests


def _parse_row(row: Any) -> TraceRequest:
    if not isinstance(row, dict):
        raise TypeError(f"expected a JSON object, got {type(row).__name__}")
    arrival_ms = float(row["timestamp"])
    if not math.isfinite(arrival_ms):
        raise ValueError(f"timestamp {row['timestamp']} is not a finite number")
    input_length = _integer(row["input_length"], "input_length")
    if input_length < 1:
        raise ValueError(f"input_length {input_length} is not positive")
    hash_ids = tuple(_integer(h, "hash id") for h in row["hash_ids"])
    bad = next((h for h in hash_ids if not 0 <= h < FILLER_TOKEN_BASE), None)
    if bad is not None:
        raise ValueError(f"hash id {bad} is outside 0 to {FILLER_TOKEN_BASE - 1}")
    output_length = _integer(row["output_length"], "output_length")
    if output_length < 0:
        raise ValueError(f"output_length {output_length} is negative")
    # 0 (a row that only prefilled) still makes its first token: the replay times TTFT.
    return TraceRequest(arrival_ms, input_length, max(output_length, 1), hash_ids)


def _integer(value: Any, what: str) -> int:
    """A JSON integer (an integral float such as 512.0 too): not a bool, a string or 1.5,
    which `int()` would quietly turn into one."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} {json.dumps(value)} is not an integer")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{what} {value} is not an integer")
    return int(value)
