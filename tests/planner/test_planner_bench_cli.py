"""`kvplane bench planner` through typer's CliRunner: bad input is one line and exit 2, a
small run prints one row per policy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvplane.cli import app

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def write_trace(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(HEADER + body)
    return path


def small_trace(tmp_path: Path) -> Path:
    rows = [
        f"2023-11-16 18:00:{s // 2:02d}.{s % 2 * 5}000000,{300 + 10 * s},{20 + s}"
        for s in range(40)
    ]
    return write_trace(tmp_path, "\n".join(rows) + "\n")


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["bench", "planner", *args])
    return result.exit_code, result.output


def assert_one_line_error(code: int, output: str, needle: str) -> None:
    assert code == 2, output
    lines = output.strip().splitlines()
    assert len(lines) == 1, output
    assert lines[0].startswith("kvplane: error:") and needle in lines[0]
    assert "Traceback" not in output


def test_missing_trace(tmp_path: Path) -> None:
    assert_one_line_error(*invoke("--trace", str(tmp_path / "nope.csv")), "cannot read trace")


def test_the_kvplane_command_exits_2_on_bad_input(tmp_path: Path) -> None:
    # The real entry point, not CliRunner: `kvplane.cli.main` runs click outside standalone
    # mode, where a `typer.Exit(2)` is returned rather than raised.
    trace = str(tmp_path / "nope.csv")
    done = subprocess.run(
        [sys.executable, "-m", "kvplane", "bench", "planner", "--trace", trace],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert_one_line_error(done.returncode, done.stderr, "cannot read trace")


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("2023-11-16 18:00:00,12\n", "expected 3 columns"),
        ("yesterday,12,3\n", "TIMESTAMP 'yesterday'"),
        ("2023-11-16 18:00:00,twelve,3\n", "ContextTokens 'twelve'"),
        ("2023-11-16 18:00:00,12,0\n", "GeneratedTokens 0 is not positive"),
    ],
)
def test_malformed_rows_name_file_and_line(tmp_path: Path, body: str, needle: str) -> None:
    path = write_trace(tmp_path, "2023-11-16 17:59:59,5,5\n" + body)
    assert_one_line_error(*invoke("--trace", str(path)), f"{path}:3: {needle}")


def test_wrong_header(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("time,prompt,output\n1,2,3\n")
    assert_one_line_error(*invoke("--trace", str(path)), "expected the header")


def test_header_only(tmp_path: Path) -> None:
    path = write_trace(tmp_path, "")
    assert_one_line_error(*invoke("--trace", str(path)), "has no requests")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--speedup", "0"], "--speedup must be a positive number"),
        (["--ttft-ms", "-5"], "--ttft-ms must be a positive number"),
        (["--itl-ms", "nan"], "--itl-ms must be a positive number"),
        (["--startup-s", "-1"], "--startup-s must be a non-negative number"),
        (["--goal", "1.5"], "--goal must be in (0, 1]"),
        (["--min-engines", "4", "--max-engines", "2"], "--max-engines 2 is below"),
        (["--policies", "kvplane,hpa"], "unknown 'hpa'"),
        (["--policies", ","], "no policy given"),
        (["--policies", "static,static"], "'static' given more than once"),
    ],
)
def test_bad_numbers_and_names(tmp_path: Path, args: list[str], needle: str) -> None:
    assert_one_line_error(*invoke("--trace", str(small_trace(tmp_path)), *args), needle)


def test_small_run_as_json(tmp_path: Path) -> None:
    code, output = invoke(
        "--trace",
        str(small_trace(tmp_path)),
        "--policies",
        "static,kvplane,threshold",
        "--startup-s",
        "5",
        "--output",
        "json",
    )
    assert code == 0, output
    doc = json.loads(output)
    assert set(doc["policies"]) == {"static", "kvplane", "threshold"}
    assert doc["num_requests"] == 40
    for row in doc["policies"].values():
        assert row["num_failed"] == 0
        assert 0 <= row["sla_attainment"] <= 1
    assert doc["policies"]["static"]["sizes_tried"][0] >= 1


def test_small_run_as_table(tmp_path: Path) -> None:
    code, output = invoke("--trace", str(small_trace(tmp_path)), "--policies", "kvplane")
    assert code == 0, output
    assert output.splitlines()[2].startswith("kvplane")
