"""Signalling a child process that asyncio waits for, without taking its exit status from
asyncio.

`asyncio.subprocess.Process.send_signal` (and its `terminate`, `kill`) goes through
`subprocess.Popen.send_signal`, which first polls the child (`waitpid` with `WNOHANG`) so as
not to signal a pid that may have been reused. A child that has just ended (a member killed
by a second Ctrl-C) is then reaped by that poll, and asyncio's child watcher, waiting for the
same child in its own thread, finds nothing to collect: it logs "Unknown child process pid N,
will report returncode 255" and the process's `returncode` is 255, not how it ended
(CPython gh-87744; asyncio signals the pid directly since python/cpython#121126, 2024).
"""

from __future__ import annotations

import asyncio
import contextlib
import os


def signal_child(process: asyncio.subprocess.Process, sig: int) -> None:
    """Send `sig` to `process` if it still runs. Whether it ended is asked without collecting
    its exit status (`WNOWAIT`): asyncio's child watcher collects it and sets `returncode`."""
    if process.returncode is not None:
        return
    try:
        ended = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # the watcher has reaped it; `returncode` is set soon
        return
    if ended is None:  # not ended, so not reaped: its pid is still its own
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, sig)
