"""`kvplane bench gateway` at a small size: real engine and controller processes, every pair
measured, the controller's CPU read. No timing is asserted (that is the benchmark's job)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvplane.cli import app


@pytest.mark.timeout(120)
def test_bench_gateway_measures_pairs_through_a_real_controller() -> None:
    result = CliRunner().invoke(
        app,
        ["bench", "gateway", "--engines", "2", "--requests", "100", "--prompt-tokens", "8",
         "-o", "json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert (doc["engines"], doc["requests"], doc["prompt_tokens"]) == (2, 100, 8)
    for side in ("direct", "gateway"):
        for measure in ("first_response_ms", "request_ms"):
            summary = doc[side][measure]
            assert 0 < summary["p50"] <= summary["p99"]
    assert set(doc["added_ms"]) == {"p50", "p99", "paired_median"}
    assert isinstance(doc["added_ms"]["paired_median"], float)
    # A hundred relayed streams take the controller well over one clock tick of CPU.
    assert doc["controller_cpu_ms_per_request"] > 0
