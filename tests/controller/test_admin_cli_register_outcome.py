"""`kvplane admin register` waits for the controller's first answer from the engine, and
fails (exit 1) on an engine it rejects or that answers its polls only with errors: the CLI
through CliRunner against a real controller in this process."""

from __future__ import annotations

import grpc
import pytest

from tests.controller.conftest import Fleet
from tests.controller.fronted_engine import start_fronted_engine
from tests.controller.test_admin_cli import cli
from tests.controller.test_failing_engines import FailsPolls

pytestmark = pytest.mark.timeout(60)


async def test_register_of_an_engine_the_controller_rejects_fails(fleet: Fleet) -> None:
    """The controller's own address: it answers as an engine would, and is rejected as
    incompatible; register says so and how to remove it, not that the engine was added."""
    registered = await cli("register", fleet.target, "--kv-events", "none", "-t", fleet.target)
    assert registered.exit_code == 1, registered.output
    message = str(registered.exception)
    assert message.startswith(
        f"engine {fleet.target} registered, but the controller rejects it: "
    ), message
    assert message.endswith(f"(remove it: kvplane admin remove {fleet.target})"), message


async def test_register_of_an_engine_answering_polls_with_errors_fails(fleet: Fleet) -> None:
    """An engine whose every poll fails (INTERNAL: it answers, with errors) is `failing`, not
    reached: register waits `--wait-s` for it to answer, then fails naming its error."""

    def failing(inner: object) -> FailsPolls:
        servicer = FailsPolls(inner)  # type: ignore[arg-type]
        servicer.code = grpc.StatusCode.INTERNAL
        return servicer

    engine = await start_fronted_engine("broken", failing)
    try:
        address = f"127.0.0.1:{engine.port}"
        registered = await cli("register", address, "--wait-s", "3", "-t", fleet.target)
        assert registered.exit_code == 1, registered.output
        message = str(registered.exception)
        assert message.startswith(
            f"engine {address} registered, but it still answers the controller's polls with "
            "errors after 3s"
        ), message
    finally:
        await engine.close()
