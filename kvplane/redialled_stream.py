"""A subscription that never ends (the planner's runtime events) moved to its server's new
channel when a long-running client dials it again (`channels.Redialling`: renewed TLS
files), make-before-break: the same call is opened on the new channel while the old stream
goes on, and the old one is ended once both carried the same message, so that nothing is
lost in between and nothing is passed on twice.

Messages are told apart by an id (`message_id`: a runtime event's `event_id`), unique in
the stream and in the same order on every subscription, as the server fans each one out to
all of them: the first id one stream carries that the other already passed on is where they
overlap; from there the new one carries all that follows. Until then both are read and each
message is passed on once, whichever brings it first. A server that sends nothing meanwhile
(an idle engine) keeps both open until it does; a new subscription that fails leaves the old
one running (the next renewal tries again). Messages without an id (a terminal error) are
passed on as they come.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any, Generic, TypeVar

import grpc

from kvplane.channels import Redialling

log = logging.getLogger(__name__)

_Stub = TypeVar("_Stub")
_Message = TypeVar("_Message")


class _Ended:
    """A subscription's stream ended: `error` (None: the server ended it)."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class _Redialled:
    """The server was dialled again."""


_Item = tuple["_Subscription[Any] | None", Any]


class _Subscription(Generic[_Message]):
    """One call's stream, read into `queue` (each message with this subscription)."""

    def __init__(self, call: Any, queue: asyncio.Queue[_Item]) -> None:
        self._call = call
        self._task = asyncio.create_task(self._read(queue), name="read a subscription")

    async def _read(self, queue: asyncio.Queue[_Item]) -> None:
        try:
            async for message in self._call:
                await queue.put((self, message))
        except (Exception, asyncio.CancelledError) as exc:  # its channel closed: cancelled
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            await queue.put((self, _Ended(exc)))
        else:
            await queue.put((self, _Ended(None)))

    def end(self) -> None:
        self._call.cancel()
        self._task.cancel()


def _why(error: BaseException | None) -> str:
    """How a subscription ended, in a few words."""
    if error is None:
        return "by the server"
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return type(error).__name__


async def _watch(dialled: Redialling[Any], queue: asyncio.Queue[_Item]) -> None:
    while True:
        await dialled.dialled_again()
        await queue.put((None, _Redialled()))


async def redialled_stream(
    dialled: Redialling[_Stub],
    subscribe: Callable[[_Stub], Any],
    message_id: Callable[[_Message], str | None],
) -> AsyncGenerator[_Message, None]:
    """The messages of the stream `subscribe` opens on `dialled.stub` (a unary-stream call),
    moved to each new channel `dialled` dials. It ends as the stream does (an error raised as
    the call raised it). Close it (`contextlib.aclosing`) to end the calls."""
    queue: asyncio.Queue[_Item] = asyncio.Queue(maxsize=1)
    current: _Subscription[_Message] = _Subscription(subscribe(dialled.stub), queue)
    moving: _Subscription[_Message] | None = None
    # The ids passed on since a move began, from either stream (a later copy is skipped).
    passed: set[str] = set()
    watcher = asyncio.create_task(_watch(dialled, queue), name=f"watch {dialled.target}")
    try:
        while True:
            source, item = await queue.get()
            if isinstance(item, _Redialled):
                if moving is not None:
                    moving.end()
                moving = _Subscription(subscribe(dialled.stub), queue)
                passed.clear()
                continue
            if source is not current and source is not moving:
                continue  # a subscription ended since
            if isinstance(item, _Ended):
                if source is moving:
                    log.warning(
                        "%s: a subscription on the new channel ended (%s): the old one goes on",
                        dialled.target,
                        _why(item.error),
                    )
                    moving = None
                    passed.clear()
                    continue
                if moving is not None:  # the old one ended first: on with the new one
                    current, moving = moving, None
                    continue
                if item.error is not None:
                    raise item.error
                return
            key = message_id(item)
            if key is not None and key in passed:  # passed on from the other stream
                if moving is not None:  # they overlap: the new one carries all that follows
                    current.end()
                    current, moving = moving, None
                passed.discard(key)
                continue
            if key is not None and moving is not None:
                passed.add(key)
            elif moving is None:
                passed.clear()
            yield item
    finally:
        watcher.cancel()
        current.end()
        if moving is not None:
            moving.end()
