"""`kvplane admin abort --all` on a fleet too large for every engine's outcome to fit the
call's trailing metadata (controller/outcomes.py caps them, failures first): the CLI through
CliRunner against a real controller and real sim engines in this process."""

from __future__ import annotations

import json

import pytest

from controller.outcomes import MAX_OUTCOME_BYTES
from tests.controller.conftest import close_fleet, make_fleet, start_sim_engine
from tests.controller.test_admin_cli import cli

pytestmark = pytest.mark.timeout(120)

# Instance ids long enough that the fleet's outcomes overflow MAX_OUTCOME_BYTES.
NAME = "engine-of-a-large-fleet-named-at-length-so-that-its-outcomes-take-room-" * 2
NUM_ENGINES = MAX_OUTCOME_BYTES // len(NAME) + 4


async def test_abort_all_of_a_fleet_whose_engines_all_aborted_exits_0() -> None:
    """Every engine aborted its requests (outcome ok), more than the metadata lists: the
    ones left out come after the listed ok ones, so they are ok too; `abort --all` succeeds,
    not "N more engines did not abort theirs"."""
    engines = [await start_sim_engine(f"{NAME}{i}") for i in range(NUM_ENGINES)]
    fleet = await make_fleet(engines=engines)
    try:
        aborted = await cli("abort", "--all", "--target", fleet.target, "--output", "json")
        assert aborted.exit_code == 0, aborted.output
        outcomes = json.loads(aborted.stdout)["engines"]
        assert outcomes[-1]["truncated"] > 0
        assert all(e["outcome"] == "ok" for e in outcomes[:-1])
    finally:
        await close_fleet(fleet)
