"""`kvplane bench handoff` runs end to end on a small checkpoint and reports every figure."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from engine.torch_runner.builtin_model import write_builtin_model
from kvplane.cli import app
from kvplane.errors import KvplaneError


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


@pytest.mark.timeout(120)
def test_bench_handoff_moves_the_prompts_blocks_and_times_each_path() -> None:
    result = CliRunner().invoke(
        app,
        ["bench", "handoff", "--model", "random-2x128", "--prompt-tokens", "40,97",
         "--rounds", "1", "-o", "json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    # 2 layers x (K, V) x 16 tokens x 1 KV head x 64 dims x 4 bytes
    assert doc["block_bytes"] == 2 * 2 * 16 * 1 * 64 * 4
    rows = {row["prompt_tokens"]: row for row in doc["rows"]}
    assert sorted(rows) == [40, 97]
    # The full blocks before the one holding the prompt's last token.
    assert rows[40]["moved_blocks"] == 2 and rows[97]["moved_blocks"] == 6
    for row in rows.values():
        assert row["moved_mib"] == row["moved_blocks"] * doc["block_bytes"] / 2**20
        for key in ("aggregated_ttft_ms", "cached_ttft_ms", "prefill_ms", "handoff_ms"):
            assert row[key] > 0, key
        assert row["disaggregated_ttft_ms"] == row["prefill_ms"] + row["handoff_ms"]


def test_bench_handoff_refuses_bad_lengths() -> None:
    result = CliRunner().invoke(app, ["bench", "handoff", "--prompt-tokens", "64,x"])
    assert result.exit_code == 2
    assert "comma-separated integers" in result.output


@pytest.mark.usefixtures("plain_click_output")
def test_bench_handoff_refuses_an_unknown_dtype_before_starting_engines() -> None:
    """A usage error like any bad option value (was exit 1), not a pydantic traceback from an
    engine."""
    result = CliRunner().invoke(app, ["bench", "handoff", "--dtype", "float64"])
    assert result.exit_code == 2
    assert result.output.splitlines()[-1] == (
        "Error: Invalid value for --dtype: dtype 'float64' is not supported; choose one of "
        "['bfloat16', 'float32']"
    )


@pytest.mark.timeout(120)
def test_bench_handoff_draws_prompts_from_the_models_own_vocabulary(tmp_path: Path) -> None:
    """A model directory with a small vocabulary (the builtin model's 385 tokens) is
    measured, not refused for token ids past its vocabulary."""
    model = write_builtin_model(tmp_path / "small-vocab")
    result = CliRunner().invoke(
        app,
        ["bench", "handoff", "--model", str(model), "--prompt-tokens", "40",
         "--rounds", "1", "-o", "json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    [row] = json.loads(result.stdout)["rows"]
    assert row["prompt_tokens"] == 40 and row["moved_blocks"] == 2


@pytest.mark.timeout(120)
def test_bench_handoff_reports_a_prompt_the_engine_refuses_in_one_line() -> None:
    """A prompt longer than the model's context is the engine's refusal as one line (exit 1),
    not a gRPC traceback."""
    result = CliRunner().invoke(
        app,
        ["bench", "handoff", "--model", "random-2x128", "--prompt-tokens", "5000",
         "--rounds", "1"],
    )  # fmt: skip
    assert result.exit_code == 1
    assert isinstance(result.exception, KvplaneError)
    assert str(result.exception) == (
        "a-5000-0: INVALID_ARGUMENT: prompt of 5000 tokens leaves no room for output in a "
        "context of 4096"
    )
