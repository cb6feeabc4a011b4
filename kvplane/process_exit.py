"""How a child process ended, in words: its exit status and the last lines of its log, so
that one failed start or crash is said in one line an operator can act on (`kvplane up`'s
members, the planner's local engines)."""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path


def log_tail(path: Path, lines: int = 3) -> str:
    """The last lines of a process's log that are not blank, on one line."""
    with contextlib.suppress(OSError):
        text = path.read_text(errors="replace")
        return " | ".join([line for line in text.splitlines() if line.strip()][-lines:])
    return ""


def exit_how(code: int) -> str:
    """An exit status in words: "code 1", "code -9 (SIGKILL)"."""
    how = f"code {code}"
    if code < 0:  # killed by a signal
        with contextlib.suppress(ValueError):
            how += f" ({signal.Signals(-code).name})"
    return how
