"""A short seeded soak (tests/controller/soak.py, docs/soak.md) in CI: real processes (redis,
two controller replicas, three sim engines, one followed over ZMQ), a few random faults, and
after each the shared index exactly the engines' blocks, both replicas agreeing and routing,
every completed request with the tokens the engine gives, no process left behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.controller.soak import run_soak

SEED = 187  # draws redis restarts around a removal, a controller restart, drain, pause, cordon
FAULTS = 7


@pytest.mark.timeout(240)
async def test_a_short_seeded_soak_converges_after_every_fault(tmp_path: Path) -> None:
    report = await run_soak(tmp_path, SEED, seconds=60, max_faults=FAULTS)
    assert not report.failures, report.summary()
    assert sum(report.faults.values()) == FAULTS, report.summary()
    assert report.requests["ok"] > 0, report.summary()
