"""The errors a test's code logged (`caplog`), less grpc.aio's spurious one: with more than one
event loop in the process (a test's servers run their own), every loop woken by the poller's
notification socket reads it, and all but one log a BlockingIOError from
`PollerCompletionQueue._handle_events` through asyncio's exception handler. Nothing fails
(grpc/grpc#25364); it appears only on a loaded machine."""

from __future__ import annotations

import logging

import pytest


def _spurious_grpc_wakeup(record: logging.LogRecord) -> bool:
    return (
        record.name == "asyncio"
        and record.exc_info is not None
        and isinstance(record.exc_info[1], BlockingIOError)
        and "PollerCompletionQueue" in record.getMessage()
    )


def errors_logged(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The records of ERROR and above, but grpc.aio's spurious wake-up."""
    return [
        r for r in caplog.records if r.levelno >= logging.ERROR and not _spurious_grpc_wakeup(r)
    ]
