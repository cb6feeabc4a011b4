"""The Mooncake trace parser every replaying benchmark shares: a row that cannot be replayed is
one KvplaneError naming the file and line (never a traceback, nor a NaN in a result), and
`kvplane bench sim` says so as `bench route` does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engine.core.mooncake_trace import TraceRequest, load_trace
from kvplane.cli import app
from kvplane.errors import KvplaneError

GOOD = {"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}


def _trace(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_rows_are_parsed_sorted_and_limited(tmp_path: Path) -> None:
    path = _trace(
        tmp_path,
        json.dumps({**GOOD, "timestamp": 20, "output_length": 0}),
        "",
        json.dumps({**GOOD, "timestamp": 10}),
        "not read: past the limit",
    )
    assert load_trace(path, limit=2) == [
        TraceRequest(10.0, 600, 3, (1, 2)),
        TraceRequest(20.0, 600, 1, (1, 2)),  # at least one output token
    ]


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ('{"timestamp": NaN, "input_length": 600, "output_length": 3, "hash_ids": [1]}',
         "timestamp nan is not a finite number"),
        ('{"timestamp": 0, "input_length": 1e400, "output_length": 3, "hash_ids": [1]}',
         "input_length inf is not an integer"),
        (json.dumps({**GOOD, "hash_ids": [1, True]}), "hash id true is not an integer"),
        (json.dumps({**GOOD, "input_length": "600"}), 'input_length "600" is not an integer'),
        (json.dumps({**GOOD, "output_length": 2.5}), "output_length 2.5 is not an integer"),
        (json.dumps({**GOOD, "input_length": 0}), "input_length 0 is not positive"),
        (json.dumps({**GOOD, "output_length": -5}), "output_length -5 is negative"),
        (json.dumps({**GOOD, "hash_ids": [1, -1]}), "hash id -1 is outside 0 to 2147483647"),
        (json.dumps({**GOOD, "hash_ids": [2**31]}),
         "hash id 2147483648 is outside 0 to 2147483647"),
        ("[0, 600, 3, [1]]", "expected a JSON object, got list"),
        (json.dumps({"timestamp": 0, "input_length": 600, "output_length": 3}), "'hash_ids'"),
    ],
)  # fmt: skip
def test_a_row_that_cannot_be_replayed_names_its_line(
    tmp_path: Path, row: str, reason: str
) -> None:
    path = _trace(tmp_path, json.dumps(GOOD), row)
    with pytest.raises(KvplaneError) as caught:
        load_trace(path)
    assert str(caught.value) == f"{path}:2: not a Mooncake trace row ({reason})"


def test_an_empty_or_binary_trace_is_one_error(tmp_path: Path) -> None:
    empty = _trace(tmp_path, "", "  ")
    with pytest.raises(KvplaneError, match=f"^trace {empty} has no requests$"):
        load_trace(empty)
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00\n")
    with pytest.raises(KvplaneError, match=f"^cannot read trace {binary}: not UTF-8 text$"):
        load_trace(binary)


@pytest.mark.parametrize(
    "row",
    [
        '{"timestamp": 0, "input_length": 1e400, "output_length": 3, "hash_ids": [1]}',
        '{"timestamp": NaN, "input_length": 600, "output_length": 3, "hash_ids": [1]}',
    ],
)
@pytest.mark.usefixtures("plain_click_output")
def test_bench_sim_says_which_row_is_bad(tmp_path: Path, row: str) -> None:
    """Was an OverflowError traceback, and a JSON document with NaN TTFTs (not JSON)."""
    path = _trace(tmp_path, row)
    result = CliRunner().invoke(
        app, ["bench", "sim", "--trace", str(path), "--engines", "1", "-o", "json"]
    )
    assert result.exit_code == 2  # a usage error, as in every bench command
    assert result.output.splitlines()[-1].startswith(
        f"Error: Invalid value for --trace: {path}:1: not a Mooncake trace row"
    )
