"""`kvplane bench planner` through typer's CliRunner: a bad argument is a usage error (exit 2,
click's "Usage:" lines and one `Error: Invalid value for OPTION: ...` line), as in every bench
command; a small run prints one row per policy."""

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


@pytest.fixture(autouse=True)
def _plain(plain_click_output: None) -> None:
    """Every test here reads usage errors as `kvplane` prints them."""


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["bench", "planner", *args])
    return result.exit_code, result.output


def assert_usage_error(code: int, output: str, option: str, needle: str) -> None:
    """Was `kvplane: error: ...` alone (no "Usage:" lines), unlike the other commands."""
    assert code == 2, output
    assert output.startswith("Usage: ") and "bench planner [OPTIONS]" in output.splitlines()[0]
    [error] = [line for line in output.splitlines() if line.startswith("Error: ")]
    assert error.startswith(f"Error: Invalid value for {option}: ") and needle in error, output
    assert "Traceback" not in output


def test_missing_trace(tmp_path: Path) -> None:
    assert_usage_error(*invoke("--trace", str(tmp_path / "nope.csv")), "--trace", "cannot read")


def test_the_kvplane_command_exits_2_on_bad_input(tmp_path: Path) -> None:
    # The real entry point, not CliRunner: `kvplane.cli.main` runs click outside standalone
    # mode, where a usage error is raised rather than printed.
    trace = str(tmp_path / "nope.csv")
    done = subprocess.run(
        [sys.executable, "-m", "kvplane", "bench", "planner", "--trace", trace],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert_usage_error(done.returncode, done.stderr, "--trace", "cannot read trace")


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
    assert_usage_error(*invoke("--trace", str(path)), "--trace", f"{path}:3: {needle}")


def test_wrong_header(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("time,prompt,output\n1,2,3\n")
    assert_usage_error(*invoke("--trace", str(path)), "--trace", "expected the header")


def test_header_only(tmp_path: Path) -> None:
    path = write_trace(tmp_path, "")
    assert_usage_error(*invoke("--trace", str(path)), "--trace", "has no requests")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--speedup", "0"], "must be a positive number"),
        (["--ttft-ms", "-5"], "must be a positive number"),
        (["--itl-ms", "nan"], "must be a positive number"),
        (["--startup-s", "-1"], "must be a non-negative number"),
        (["--limit", "0"], "must be a positive number, got 0"),
        (["--goal", "1.5"], "must be in (0, 1]"),
        (["--min-engines", "4", "--max-engines", "2"], "2 is below --min-engines 4"),
        (["--policies", "kvplane,hpa"], "unknown 'hpa'"),
        (["--policies", ","], "no policy given"),
        (["--policies", "static,static"], "'static' given more than once"),
    ],
)
def test_bad_numbers_and_names(tmp_path: Path, args: list[str], needle: str) -> None:
    option = args[-2]
    code, output = invoke("--trace", str(small_trace(tmp_path)), *args)
    assert_usage_error(code, output, option, needle)


def test_a_trace_no_request_of_fits_is_a_failed_run(tmp_path: Path) -> None:
    """Not a usage error: each argument is fine, the replay has nothing to run (exit 1, as in
    `bench route` and `bench sim`)."""
    result = CliRunner().invoke(
        app, ["bench", "planner", "--trace", str(small_trace(tmp_path)), "--blocks-per-engine", "1"]
    )
    assert result.exit_code == 1
    assert str(result.exception) == "no request of trace.csv fits one engine's KV cache"


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


def test_the_default_trace_is_found_from_any_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default is the shared folder beside the checkout (as `bench sim`'s and `bench
    e2e`'s), not `../shared` from wherever the command runs: was a usage error outside the
    repository's root."""
    monkeypatch.chdir(tmp_path)
    code, output = invoke("--limit", "20", "--policies", "kvplane", "--output", "json")
    assert code == 0, output
    assert json.loads(output)["trace"] == "conv.csv"
