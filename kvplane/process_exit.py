"""How a child process ended, in words: its exit status and the last lines of its log, so
that one failed start or crash is said in one line an operator can act on (`kvplane up`'s
members, the planner's local engines)."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

# How much of a log's end is read for its last lines: an engine's log after days of serving
# can be gigabytes, which read whole would stall the event loop (and fill memory) that says it.
_TAIL_BYTES = 64 * 1024


def log_tail(path: Path, lines: int = 3) -> str:
    """The last lines of a process's log that are not blank (within its last `_TAIL_BYTES`),
    on one line; "" for a log that cannot be read."""
    with contextlib.suppress(OSError), path.open("rb") as file:
        start = max(0, file.seek(0, os.SEEK_END) - _TAIL_BYTES)
        file.seek(start)
        text = file.read().decode(errors="replace").splitlines()
        if start > 0:
            text = text[1:]  # read from within a line: not the whole of it
        return " | ".join([line for line in text if line.strip()][-lines:])
    return ""


def exit_how(code: int) -> str:
    """An exit status in words: "code 1", "code -9 (SIGKILL)"."""
    how = f"code {code}"
    if code < 0:  # killed by a signal
        with contextlib.suppress(ValueError):
            how += f" ({signal.Signals(-code).name})"
    return how
