"""The errors a test's code logged (`caplog`), less grpc.aio's spurious ones. With more than
one event loop in the process (a test's servers run their own, and each test has its own),
grpc.aio's poller serves them all from one notification socket:
- every loop woken by it reads the socket, and all but one log a BlockingIOError from
  `PollerCompletionQueue._handle_events` through asyncio's exception handler (nothing fails:
  grpc/grpc#25364; it appears only on a loaded machine);
- an event of a call made on a loop since closed (an earlier test's) is handed to that loop by
  whichever loop reads it, which logs "Event loop is closed" from the same handler (it depends
  on which tests ran before in the process, not on the test's code).
A product process runs one event loop, where neither can happen."""

from __future__ import annotations

import logging

import pytest


def _spurious_grpc_wakeup(record: logging.LogRecord) -> bool:
    if record.name != "asyncio" or record.exc_info is None:
        return False
    error = record.exc_info[1]
    return "PollerCompletionQueue" in record.getMessage() and (
        isinstance(error, BlockingIOError)
        or (isinstance(error, RuntimeError) and str(error) == "Event loop is closed")
    )


def errors_logged(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The records of ERROR and above, but grpc.aio's spurious ones."""
    return [
        r for r in caplog.records if r.levelno >= logging.ERROR and not _spurious_grpc_wakeup(r)
    ]
