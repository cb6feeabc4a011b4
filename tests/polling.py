"""Waiting in a test for a state that has no event to await: another task's counters, another
process's answers, a server's view after a poll. The predicate is checked every `every_s`
until it holds; past `timeout_s` the wait fails, naming what it waited for. (Never a sleep
that hopes enough happened meanwhile: on a loaded machine it does not.)"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable


async def eventually(
    predicate: Callable[[], Awaitable[object] | object],
    timeout_s: float = 30.0,
    what: str = "",
    *,
    every_s: float = 0.02,
) -> None:
    """Until `predicate()` (plain or async) is truthy; AssertionError after `timeout_s`."""
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                result = predicate()
                if await result if inspect.isawaitable(result) else result:
                    return
                await asyncio.sleep(every_s)
    except TimeoutError:
        waited_for = what or getattr(predicate, "__name__", "the condition")
        raise AssertionError(f"timed out after {timeout_s:g} s waiting for {waited_for}") from None
