"""`errors_logged` passes over grpc.aio's spurious wake-up error and nothing else."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.logged_errors import errors_logged


def _log_from_callback(exc: BaseException, callback: str) -> None:
    """As asyncio's default exception handler logs an exception raised by a callback."""
    loop = asyncio.new_event_loop()
    try:
        loop.default_exception_handler(
            {"message": f"Exception in callback {callback}()", "exception": exc}
        )
    finally:
        loop.close()


def test_only_grpcs_spurious_wakeup_is_passed_over(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    _log_from_callback(
        BlockingIOError(11, "Resource temporarily unavailable"),
        "PollerCompletionQueue._handle_events",
    )
    _log_from_callback(BlockingIOError(11, "again"), "Server._serve")
    _log_from_callback(RuntimeError("boom"), "PollerCompletionQueue._handle_events")
    logging.getLogger("controller.fleet").error("a real one")
    assert len(caplog.records) == 4
    kept = [r.getMessage() for r in errors_logged(caplog)]
    assert kept == [
        "Exception in callback Server._serve()",
        "Exception in callback PollerCompletionQueue._handle_events()",
        "a real one",
    ]
