"""`kvplane bench engine` runs end to end on a small workload and reports every figure."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import pytest
import torch
from typer.testing import CliRunner

from kvplane.cli import app


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


@pytest.mark.timeout(300)
def test_bench_engine_reports_throughput_and_ttft_on_a_random_checkpoint() -> None:
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "engine",
            "--model",
            "random-2x128",
            "--concurrency",
            "1,3",
            "--threads",
            "1",
            "--ttft-prompt-tokens",
            "96",
            "--no-compare-hf",
            "-o",
            "json",
        ],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["torch_threads"] == 1
    for key in ("c1", "c3"):
        assert doc["kvplane"][key]["output_tokens_per_s"] > 0
        assert doc["kvplane"][key]["output_tokens_per_cpu_s"] > 0
        assert doc["kvplane"][key]["cpu_seconds"] > 0
    ttft = doc["kvplane"]["ttft"]
    assert ttft["prompt_tokens"] == 96
    assert math.isfinite(ttft["cold_ms"]) and math.isfinite(ttft["cached_ms"])
    # Not "not installed": HF's side was left out on purpose, installed or not.
    assert doc["hf_transformers"] == "skipped (--no-compare-hf)"


def test_a_ttft_prompt_the_model_cannot_take_is_refused_before_the_throughput_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine.torch_runner import bench

    def not_yet(*args: object) -> None:
        raise AssertionError("throughput measured before the TTFT prompt was checked")

    monkeypatch.setattr(bench, "_kvplane_throughput", not_yet)
    result = CliRunner().invoke(
        app,
        ["bench", "engine", "--model", "random-2x64", "--ttft-prompt-tokens", "100000",
         "--no-compare-hf"],
    )  # fmt: skip
    assert result.exit_code == 1
    assert "prompt of 100000 tokens leaves no room for output" in str(result.exception)


@pytest.mark.usefixtures("plain_click_output")
@pytest.mark.parametrize(
    ("device", "said"),
    [
        ("foo", "bad device 'foo'"),
        ("mps", "device type 'mps' is not supported (cpu or cuda)"),
    ],
)
def test_a_device_the_engine_cannot_use_is_a_usage_error(device: str, said: str) -> None:
    """Said before any model is built (it used to fail only once the engine was)."""
    result = CliRunner().invoke(
        app, ["bench", "engine", "--model", "random-2x64", "--device", device]
    )
    assert result.exit_code == 2
    assert result.output.splitlines()[-1].startswith(f"Error: Invalid value for --device: {said}")


@pytest.mark.usefixtures("plain_click_output")
def test_a_gpu_past_the_last_is_a_usage_error() -> None:
    """`cuda:0` on a machine without one (CI); on a GPU machine, the index after its last."""
    num_gpus = torch.cuda.device_count()
    result = CliRunner().invoke(
        app, ["bench", "engine", "--model", "random-2x64", "--device", f"cuda:{num_gpus}"]
    )
    assert result.exit_code == 2
    said = "requested but CUDA is not available" if num_gpus == 0 else "does not exist"
    assert result.output.splitlines()[-1].startswith(
        f"Error: Invalid value for --device: device 'cuda:{num_gpus}' {said}"
    )
