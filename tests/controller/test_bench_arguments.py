"""`kvplane bench route|e2e|engine|...` with bad arguments: a usage error (exit 2) before any
replay, model or fleet, whichever bench command (a trace missing or not a trace, a value out
of range, a malformed model); a run that fails is one line (KvplaneError, exit 1); never a
traceback or a hang. And
`bench route --output json` prints exactly one JSON document, of the issue's shape, on stdout
(logs on stderr). Nothing here starts a fleet or loads a model."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from controller.router import POLICY_NAMES, KvplaneWeights
from kvplane.cli import app
from kvplane.errors import KvplaneError

REPO = Path(__file__).resolve().parents[2]
ROWS = [
    {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]},
    {"timestamp": 10, "input_length": 1200, "output_length": 3, "hash_ids": [1, 2, 3]},
    {"timestamp": 20, "input_length": 600, "output_length": 4, "hash_ids": [1, 4]},
]


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return path


def bench(*args: str) -> Result:
    return CliRunner().invoke(app, ["bench", *args])


def usage_error(result: Result) -> str:
    """The one error line of a usage error (exit 2, click's "Usage:" lines first), without
    its "Error: "; with the `plain_click_output` fixture."""
    assert result.exit_code == 2, result.output
    assert result.output.startswith("Usage: "), result.output
    assert "Traceback" not in result.output
    [error] = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    return error.removeprefix("Error: ")


# Each bench command that reads a trace, with the arguments that keep it from starting
# anything else, and how its trace is written (Mooncake JSONL; the planner's Azure CSV).
TRACE_COMMANDS = {
    "route": [],
    "sim": [],
    "e2e": ["--model", "random-1x64", "--sequential"],
    "planner": [],
}


@pytest.mark.usefixtures("plain_click_output")
@pytest.mark.parametrize("command", list(TRACE_COMMANDS))
def test_a_missing_trace_is_a_usage_error_in_every_bench_command(
    tmp_path: Path, command: str
) -> None:
    """Was exit 2 in `bench planner` only (a line of its own style); exit 1 in route, sim
    and e2e."""
    absent = tmp_path / "absent.trace"
    error = usage_error(bench(command, "--trace", str(absent), *TRACE_COMMANDS[command]))
    assert error == (
        f"Invalid value for --trace: cannot read trace {absent}: No such file or directory"
    )


@pytest.mark.usefixtures("plain_click_output")
@pytest.mark.parametrize("command", list(TRACE_COMMANDS))
def test_a_file_that_is_not_a_trace_is_a_usage_error_in_every_bench_command(
    tmp_path: Path, command: str
) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("not a trace\n")
    error = usage_error(bench(command, "--trace", str(notes), *TRACE_COMMANDS[command]))
    assert error.startswith(f"Invalid value for --trace: {notes}:1: "), error


@pytest.mark.parametrize("command", ["route", "e2e"])
@pytest.mark.parametrize(
    ("policies", "says"),
    [("kvplane,bogus", "unknown 'bogus'"), ("", "no policy given"), (",", "no policy given")],
)
def test_bad_policies_are_a_usage_error(
    trace: Path, command: str, policies: str, says: str
) -> None:
    """Unknown names were exit 1 (a KvplaneError); none at all was an empty result (route,
    exit 0) or a ZeroDivisionError once the model was built (e2e)."""
    model = ["--model", "/absent"] if command == "e2e" else []  # never a fleet, old code too
    result = bench(command, "--trace", str(trace), "--policies", policies, *model)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for --policies: {says}; choose from kvplane," in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("command", ["route", "e2e"])
def test_a_policy_named_twice_is_a_usage_error(trace: Path, command: str) -> None:
    """Was run twice (route: replayed twice; e2e: two fleets, a CPU each side by side) and
    shown once, the results being keyed by name."""
    model = ["--model", "/absent"] if command == "e2e" else []
    policies = "kvplane,round_robin,kvplane"
    result = bench(command, "--trace", str(trace), "--policies", policies, *model)
    assert result.exit_code == 2, result.output
    assert "Invalid value for --policies: 'kvplane' given more than once" in result.output


@pytest.mark.parametrize(("command", "flag"), [("route", "--speedup"), ("e2e", "--rate")])
def test_an_infinite_speed_is_a_usage_error(trace: Path, command: str, flag: str) -> None:
    """`inf` passed the options' minimum: route replayed every request at once and its JSON
    said `"speedup": Infinity` (not JSON); e2e went on to build the model and fleets."""
    model = ["--model", "/absent"] if command == "e2e" else []
    result = bench(command, "--trace", str(trace), "--policies", "round_robin", flag, "inf", *model)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for {flag}: inf is not a finite number" in result.output


def test_a_capacity_no_request_fits_is_one_line(trace: Path) -> None:
    """It used to print all-zero rows and exit 0 (a warning per policy on stderr)."""
    result = bench("route", "--trace", str(trace), "--blocks-per-worker", "1", "--block-size", "8")
    assert result.exit_code == 1
    assert isinstance(result.exception, KvplaneError)
    assert str(result.exception) == (
        f"no request of {trace} fits one engine's KV cache (1 blocks of 8 tokens)"
    )


def test_an_unknown_peer_is_a_usage_error(trace: Path) -> None:
    result = bench("route", "--trace", str(trace), "--peer", "vllm")
    assert result.exit_code == 2
    assert "Invalid value for --peer: " in result.output


def test_a_missing_peer_fails_before_any_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was reported only after every policy had been replayed (minutes on a real trace): the
    peer is now checked before the trace is even read. Dynamo is hidden if installed."""
    monkeypatch.setitem(sys.modules, "dynamo", None)  # its import fails
    monkeypatch.setenv("DYN_LOG", "error")  # (set by the bench: restored after the test)
    result = bench("route", "--trace", str(tmp_path / "absent.jsonl"), "--peer", "dynamo")
    assert result.exit_code == 1
    assert isinstance(result.exception, KvplaneError)
    assert str(result.exception) == (
        "--peer dynamo needs Dynamo's mocker: pip install ai-dynamo-runtime==1.6.1"
    )


def test_e2e_side_by_side_without_a_cpu_per_policy_fails_before_the_model(
    trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was said only after the model had been written (a 56 M-parameter checkpoint by
    default); here the model directory holds no weights, which loading it would say. Two
    CPUs, as on CI, whatever this machine has."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    result = bench(
        "e2e", "--trace", str(trace), "--model", str(model), "--policies", ",".join(POLICY_NAMES)
    )
    assert result.exit_code == 1
    assert isinstance(result.exception, KvplaneError)
    assert str(result.exception) == (
        f"side by side needs a CPU per policy ({len(POLICY_NAMES)} policies, 2 CPUs); "
        "use --sequential"
    )


@pytest.mark.parametrize("concurrency", ["abc", "0", "1,-2", ""])
def test_engine_bad_concurrency_is_a_usage_error(concurrency: str) -> None:
    """Was a ValueError traceback ("abc"), and for 0 a loop that never admitted a request."""
    result = bench("engine", "--model", "/absent", "--concurrency", concurrency)
    assert result.exit_code == 2
    assert "Invalid value for --concurrency: expected comma-separated positive integers" in (
        result.output
    )


def test_engine_threads_below_one_is_a_usage_error() -> None:
    result = bench("engine", "--model", "/absent", "--threads", "0")
    assert result.exit_code == 2
    assert "Invalid value for --threads: " in result.output


@pytest.mark.usefixtures("plain_click_output")
@pytest.mark.parametrize("command", ["engine", "e2e", "handoff"])
@pytest.mark.parametrize("model", ["random-1x-64", "random-0x64", "random-8"])
def test_a_bad_random_model_shape_is_a_usage_error(trace: Path, command: str, model: str) -> None:
    """random-1x-64 was torch's RuntimeError (a negative dimension) as a traceback, then one
    line with exit 1 unlike every other bad option value (exit 2)."""
    args = ["--trace", str(trace), "--sequential"] if command == "e2e" else []
    error = usage_error(bench(command, "--model", model, *args))
    assert error == (
        f"Invalid value for --model: expected random-LAYERSxHIDDEN (positive integers), "
        f"got {model!r}"
    )


@pytest.mark.usefixtures("plain_click_output")
@pytest.mark.parametrize("command", ["engine", "e2e", "handoff"])
def test_a_model_directory_without_a_config_is_a_usage_error(
    trace: Path, tmp_path: Path, command: str
) -> None:
    """Was exit 1 (e2e), a loader's error (engine, handoff) once torch was imported."""
    args = ["--trace", str(trace), "--sequential"] if command == "e2e" else []
    error = usage_error(bench(command, "--model", str(tmp_path), *args))
    assert error == f"Invalid value for --model: {str(tmp_path)!r} is not a model directory " + (
        "(no config.json)"
    )


def test_route_json_is_one_document_of_the_issues_shape(trace: Path, tmp_path: Path) -> None:
    """The real command line: stdout is exactly the JSON document, the log (here: a request
    too long for 2-block engines, left out) on stderr."""
    result = subprocess.run(
        [
            sys.executable, "-m", "kvplane", "bench", "route", "--trace", str(trace),
            "--workers", "2", "--blocks-per-worker", "2", "--policies", "kvplane,random",
            "--output", "json",
        ],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "longer than one engine's KV cache were left out" in result.stderr
    doc = json.loads(result.stdout)
    # The oracle is over the requests replayed, as the policies' reuse is.
    assert (
        doc["num_left_out"] == 1 and doc["num_requests"] == len(trace.read_text().splitlines()) - 1
    )
    assert all(row["hit_ratio"] <= doc["oracle_hit_ratio"] for row in doc["policies"].values())
    assert {
        "trace", "workers", "blocks_per_worker", "block_size", "speedup", "oracle_hit_ratio",
        "policies",
    } <= set(doc)  # fmt: skip
    assert (doc["trace"], doc["workers"], doc["blocks_per_worker"]) == ("trace.jsonl", 2, 2)
    assert (doc["block_size"], doc["speedup"], doc["seed"]) == (512, 1.0, 0)
    assert list(doc["policies"]) == ["kvplane", "random"]
    assert "kvplane_weights" not in doc  # the defaults: no --config
    for row in doc["policies"].values():
        assert {"hit_ratio", "ttft_ms", "itl_ms", "imbalance", "throughput_rps"} <= set(row)
        assert set(row["ttft_ms"]) == {"mean", "p50", "p99"}
        assert set(row["itl_ms"]) == {"mean"}


def test_route_output_names_its_seed(trace: Path) -> None:
    """--seed changes the random policies' figures, but neither the JSON nor the table said
    which seed made them."""
    args = ["route", "--trace", str(trace), "--policies", "random", "--seed", "7"]
    doc = json.loads(bench(*args, "--output", "json").stdout)
    assert doc["seed"] == 7
    assert ", seed 7, oracle reuse" in bench(*args).stdout


def test_route_output_names_its_router_replicas(trace: Path) -> None:
    args = ["route", "--trace", str(trace), "--policies", "round_robin", "--router-replicas", "3"]
    doc = json.loads(bench(*args, "--replica-sync", "--output", "json").stdout)
    assert (doc["router_replicas"], doc["replica_sync"]) == (3, True)
    assert ", 3 router replicas, oracle reuse" in bench(*args).stdout
    assert ", 3 router replicas in sync, oracle reuse" in bench(*args, "--replica-sync").stdout
    refused = bench("route", "--trace", str(trace), "--router-replicas", "0")
    assert refused.exit_code == 2 and "--router-replicas" in refused.output


def test_route_replays_kvplane_with_a_controller_configs_router_settings(
    trace: Path, tmp_path: Path
) -> None:
    config = tmp_path / "controller.yaml"
    config.write_text("router: {patience_tokens: 60000, overlap_weight: 9}\n")
    args = ["route", "--trace", str(trace), "--policies", "kvplane,random", "--output", "json"]
    result = bench(*args, "--config", str(config))
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    weights = dataclasses.asdict(KvplaneWeights(patience_tokens=60_000.0, overlap_weight=9.0))
    assert doc["kvplane_weights"] == weights
    assert set(doc["policies"]) == {"kvplane", "random"}


@pytest.mark.usefixtures("plain_click_output")
@pytest.mark.parametrize("command", ["route", "planner"])
def test_a_config_file_that_cannot_be_read_is_a_usage_error(
    tmp_path: Path, trace: Path, command: str
) -> None:
    """Like a missing trace (was exit 1, as a bad file's values still are)."""
    absent = tmp_path / "absent.yaml"
    error = usage_error(bench(command, "--trace", str(trace), "--config", str(absent)))
    assert error == (
        f"Invalid value for --config: cannot read config {absent}: No such file or directory"
    )


def test_route_with_a_planner_config_says_so(trace: Path) -> None:
    """Was one "X: Extra inputs are not permitted" per key of the planner file."""
    planner_yaml = REPO / "configs" / "planner.yaml"
    result = bench("route", "--trace", str(trace), "--config", str(planner_yaml))
    assert result.exit_code == 1
    assert isinstance(result.exception, KvplaneError)
    assert str(result.exception) == (
        f"{planner_yaml} looks like a planner config; --config wants a controller config"
    )


def test_route_with_a_bad_controller_config_is_one_line(trace: Path, tmp_path: Path) -> None:
    config = tmp_path / "controller.yaml"
    config.write_text("router: {patience_tokens: -1}\n")
    result = bench("route", "--trace", str(trace), "--config", str(config))
    assert result.exit_code == 1
    assert isinstance(result.exception, KvplaneError)
    assert "patience_tokens" in str(result.exception)
