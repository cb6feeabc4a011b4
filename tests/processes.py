"""Other processes as a test sees them, from /proc: whether one still runs, waiting for a few
to be gone, and a process's descendants (a compiler's children, a fleet's members)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from kvplane.process_tree import descendants

__all__ = ["DEFAULT_SIGNALS", "descendants", "running", "wait_gone"]


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan waits for init to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still running after up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if running(pid)]


# A command prefix that runs the rest of the command with SIGINT and SIGHUP at their default
# actions, whatever ran the tests: a shell's background job (`.ci/run &`) starts with SIGINT
# ignored, and `nohup` with SIGHUP ignored, and a process keeps what it inherits as ignored
# (Python then installs no KeyboardInterrupt handler), so a test's Ctrl-C or hangup would
# reach nothing.
DEFAULT_SIGNALS = (
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "signal.signal(signal.SIGHUP, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])",
)
