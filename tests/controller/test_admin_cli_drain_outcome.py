"""`kvplane admin drain`'s progress and exit code when requests outlive its deadline: the CLI
through CliRunner against a real controller and a sim engine running a long request."""

from __future__ import annotations

import contextlib
import json

import pytest

from tests.controller.conftest import close_fleet, generate_request, make_fleet, start_sim_engine
from tests.controller.test_admin_cli import PREFIX, cli

pytestmark = pytest.mark.timeout(60)


async def test_a_drain_past_its_deadline_fails_and_one_aborting_ends_complete() -> None:
    """A request still running at the drain's deadline: the drain fails (exit 1, "drain
    failed"), its JSON lines ending with the error; with --abort-after-deadline the request
    is aborted and the progress ends at COMPLETE (exit 0), in flight 1 before it."""
    engine = await start_sim_engine("e0", 1.0, sim={"min_decode_ms": 50.0})
    fleet = await make_fleet(engines=[engine])
    stream = fleet.gateway.Generate(generate_request("long", PREFIX, max_tokens=100_000))
    try:
        await anext(aiter(stream))  # it runs
        t = ["--target", fleet.target, "--output", "json"]
        failed = await cli("drain", "e0", "--deadline-ms", "200", *t)
        assert failed.exit_code == 1, failed.output
        assert "drain failed" in str(failed.exception)
        events = [json.loads(line) for line in failed.stdout.splitlines()]
        assert events[0]["in_flight_requests"] == 1, events
        assert "error" in events[-1] and "error" not in events[0], events

        aborted = await cli("drain", "e0", "--deadline-ms", "200", "--abort-after-deadline", *t)
        assert aborted.exit_code == 0, aborted.output
        events = [json.loads(line) for line in aborted.stdout.splitlines()]
        assert events[0]["in_flight_requests"] == 1, events
        assert events[-1]["state"] == "DRAIN_STATE_COMPLETE", events
        table = await cli("drain", "e0", "--target", fleet.target)
        assert table.exit_code == 0, table.output
        assert table.stdout.splitlines()[-1].startswith("COMPLETE"), table.stdout
    finally:
        stream.cancel()
        with contextlib.suppress(Exception):
            await close_fleet(fleet)
