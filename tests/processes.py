"""Other processes as a test sees them, from /proc: whether one still runs, waiting for a few
to be gone, and a process's descendants (a compiler's children, a fleet's members)."""

from __future__ import annotations

import time
from pathlib import Path

from kvplane.process_tree import descendants

__all__ = ["descendants", "running", "wait_gone"]


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
