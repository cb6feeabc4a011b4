"""A `kvplane` command run as a real process and interrupted as Ctrl-C interrupts it."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from kvplane.child_signals import signal_child
from tests.processes import DEFAULT_SIGNALS


@dataclass(frozen=True, slots=True)
class Interrupted:
    returncode: int
    stdout: str
    stderr: str


async def interrupted(
    args: Sequence[str], ready: Callable[[asyncio.subprocess.Process], Awaitable[object]]
) -> Interrupted:
    """Run `python -m kvplane ARGS`, wait for `ready(process)` (it is doing what is to be
    interrupted: `ready` may read its stdout), send it SIGINT and wait for it to exit. It is
    killed if `ready` fails, so that no process outlives the test."""
    process = await asyncio.create_subprocess_exec(
        *DEFAULT_SIGNALS,
        sys.executable,
        "-m",
        "kvplane",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await ready(process)
        signal_child(process, signal.SIGINT)
        stdout, stderr = await process.communicate()
    finally:
        if process.returncode is None:
            signal_child(process, signal.SIGKILL)
            await process.wait()
    assert process.returncode is not None
    return Interrupted(process.returncode, stdout.decode(), stderr.decode())
