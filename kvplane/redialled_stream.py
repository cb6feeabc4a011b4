"""A subscription that never ends (the planner's runtime events) moved to its server's new
channel when a long-running client dials it again (`channels.Redialling`: renewed TLS
files), make-before-break: the same call is opened on the new channel while the old stream
goes on, and the old one is ended once both carried the same message, so that nothing is
lost in between and nothing is passed on twice.

Messages are told apart by an id (`message_id`: a runtime event's `event_id`; an empty one
is none). Where the server gives a message the same id on every subscription, fanning each
one out to all of them (kvplane's engine does), the first id one stream carries that the
other already passed on is where they overlap; from there the new one carries all that
follows. Until then both are read and each message is passed on once, whichever brings it
first; a message without an id (a terminal error) is passed on as it comes. OpenEngine does
not promise such ids (an engine may make one per subscription, or none), so a move also
ends once one stream brought `MAX_UNMATCHED` messages (with or without an id) and no
overlap: on with the new one if it brought any (the old one ended; a warning, as the
messages both carried meanwhile may have been passed on twice), else the new one is ended
and the old goes on (a warning; the next renewal tries again). A server that sends nothing
meanwhile (an idle engine) keeps both open until it does; a renewal meanwhile is followed
once that move is done (never more than two streams); a new subscription that fails leaves
the old one running.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any, Generic, TypeVar

import grpc

from kvplane.channels import Redialling

log = logging.getLogger(__name__)

# How many messages one stream may bring in a move, with or without an id, while the other
# matched none of them. Streams whose ids line up overlap within the messages in flight as
# the new one opens (a few, for a client that keeps up), well under it; others never do, and
# meanwhile their messages are passed on twice: it bounds those (a few seconds of a busy
# engine's passes, once per renewal), a stalled new stream, and the ids kept (as many per
# stream). An old stream more than this behind the new one loses the messages in between.
MAX_UNMATCHED = 256

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


async def _watch(
    dialled: Redialling[Any], redialled: asyncio.Event, queue: asyncio.Queue[_Item]
) -> None:
    """Tell the stream each time `dialled` is dialled again (`redialled`: the first time)."""
    while True:
        await redialled.wait()
        redialled = dialled.dialled_again()
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
    stub = dialled.stub
    # (Taken with the stub: a renewal seen before the watcher runs is not missed.)
    redialled = dialled.dialled_again()
    current: _Subscription[_Message] = _Subscription(subscribe(stub), queue)
    moving: _Subscription[_Message] | None = None
    # Dialled again while a move was under way: another move follows it.
    again = False
    # The ids passed on since a move began, from each stream: the first one a stream brings
    # that the other passed on is where they overlap.
    from_current: set[str] = set()
    from_moving: set[str] = set()
    # The messages each stream brought since a move began, with or without an id.
    brought_current = brought_moving = 0
    # The ids the current stream still brings that were passed on from the one it replaced.
    skip: set[str] = set()
    watcher = asyncio.create_task(_watch(dialled, redialled, queue), name=f"watch {dialled.target}")
    try:
        while True:
            if again and moving is None:
                again, item = False, _Redialled()
            else:
                source, item = await queue.get()
            if isinstance(item, _Redialled):
                if moving is not None:
                    again = True
                else:
                    moving = _Subscription(subscribe(dialled.stub), queue)
                    from_current, from_moving = set(), set()
                    brought_current = brought_moving = 0
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
                elif moving is not None:  # the old one ended first: on with the new one
                    current, moving, skip = moving, None, from_current
                elif item.error is not None:
                    raise item.error
                else:
                    return
                continue
            key = message_id(item) or None  # an empty id is none
            if source is moving:
                brought_moving += 1
            elif moving is not None:
                brought_current += 1
            if key is None:
                yield item
            elif source is current and key in skip:
                skip.discard(key)
            elif source is current:
                skip.clear()
                if moving is None:
                    yield item
                elif key in from_moving:  # the new one is ahead: it carries all that follows
                    current.end()
                    current, moving = moving, None
                else:
                    from_current.add(key)
                    yield item
            elif key in from_current:  # the old one is ahead: the new one carries the rest
                current.end()
                current, moving, skip = moving, None, from_current - {key}
            else:
                from_moving.add(key)
                yield item
            if moving is None or max(brought_current, brought_moving) < MAX_UNMATCHED:
                continue
            if brought_moving:
                log.warning(
                    "%s: the subscriptions on the old and new channel carried no message id "
                    "in common in %d messages (their ids do not line up): on with the new one "
                    "(the messages both carried meanwhile may have been passed on twice)",
                    dialled.target,
                    max(brought_current, brought_moving),
                )
                current.end()
                current, moving, skip = moving, None, set()
            else:
                log.warning(
                    "%s: the subscription on the new channel brought nothing while the old "
                    "one brought %d messages: ended, the old one goes on (the next renewal "
                    "tries again)",
                    dialled.target,
                    brought_current,
                )
                moving.end()
                moving = None
    finally:
        watcher.cancel()
        current.end()
        if moving is not None:
            moving.end()
