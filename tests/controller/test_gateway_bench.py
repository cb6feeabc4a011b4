"""`kvplane bench gateway` at a small size: real engine, controller and bare relay processes,
every round measured, the CPU read. No timing is asserted (that is the benchmark's job)."""

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
    for side in ("direct", "gateway", "relay"):
        for measure in ("first_response_ms", "request_ms"):
            summary = doc[side][measure]
            assert 0 < summary["p50"] <= summary["p99"]
    for added in ("added_ms", "relay_added_ms"):
        assert set(doc[added]) == {"p50", "p99", "paired_median"}
        assert isinstance(doc[added]["paired_median"], float)
    # A hundred relayed streams take the controller (and the bare relay) well over one clock
    # tick of CPU.
    assert doc["controller_cpu_ms_per_request"] > 0
    assert doc["relay_cpu_ms_per_request"] > 0


@pytest.mark.timeout(120)
def test_bench_gateway_without_the_relay_floor() -> None:
    result = CliRunner().invoke(
        app,
        ["bench", "gateway", "--engines", "1", "--requests", "10", "--prompt-tokens", "4",
         "--no-relay-floor", "-o", "json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert "relay" not in doc and "relay_added_ms" not in doc
    assert "relay_cpu_ms_per_request" not in doc
    assert doc["gateway"]["first_response_ms"]["p50"] > 0
