"""Short seeded soaks (docs/soak.md) in CI, on real processes, a few random faults each:

- tests/controller/soak.py: redis, two controller replicas, three sim engines (one followed
  over ZMQ); after each fault the shared index exactly the engines' blocks, both replicas
  agreeing and routing;
- tests/controller/planner_soak.py: a controller and a planner keeping prefill and decode
  pools of sim engine processes, traffic in bursts and quiet spells; after each fault the
  controller's engines exactly the planner's live children, the pools within their bounds;

and in both every completed request with the tokens the engine gives, no process left
behind (the indexer fleet's: tests/indexer/test_indexer_soak.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.controller.planner_soak import PlannerSoak
from tests.controller.soak import Soak
from tests.soak_fleet import CI_AFTERMATH_S, CI_STEADY_S, SoakReport, drive

SEED = 187  # draws redis restarts around a removal, a controller restart, drain, pause, cordon
FAULTS = 7
PLANNER_SEED = 1  # draws engine kills, prefill kills at the handoff, a pause past the patience
PLANNER_FAULTS = 5


def assert_clean(report: SoakReport, faults: int) -> None:
    assert not report.failures, report.summary()
    assert sum(report.faults.values()) == faults, report.summary()
    assert report.requests["request ok"] > 0, report.summary()


@pytest.mark.timeout(240)
async def test_a_short_seeded_soak_converges_after_every_fault(tmp_path: Path) -> None:
    soak = Soak(tmp_path, SEED)
    report = await drive(
        soak, seconds=60, max_faults=FAULTS, steady_s=CI_STEADY_S, aftermath_s=CI_AFTERMATH_S
    )
    assert_clean(report, FAULTS)


@pytest.mark.timeout(240)
async def test_a_short_seeded_planner_soak_converges_after_every_fault(tmp_path: Path) -> None:
    soak = PlannerSoak(tmp_path, PLANNER_SEED)
    report = await drive(
        soak,
        seconds=40,
        max_faults=PLANNER_FAULTS,
        steady_s=CI_STEADY_S,
        aftermath_s=CI_AFTERMATH_S,
    )
    assert_clean(report, PLANNER_FAULTS)
