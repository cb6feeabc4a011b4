"""Reading a server stream in a test one reply at a time: `read()` answers a reply or EOF,
which grpc's stubs type as `object`, so each reply is typed here as the stream's."""

from __future__ import annotations

from typing import Any, TypeVar, cast

import grpc

Reply = TypeVar("Reply")


async def next_reply(call: grpc.aio.UnaryStreamCall[Any, Reply]) -> Reply:
    """The stream's next reply; the test knows one is coming (the stream has not ended)."""
    reply = await call.read()
    assert reply is not grpc.aio.EOF, "the stream ended"
    return cast(Reply, reply)  # not EOF: a reply of the stream


async def remaining_replies(call: grpc.aio.UnaryStreamCall[Any, Reply]) -> list[Reply]:
    """The replies the stream has left, up to its end (a test may have read some)."""
    replies: list[Reply] = []
    while (reply := await call.read()) is not grpc.aio.EOF:
        replies.append(cast(Reply, reply))  # not EOF: a reply of the stream
    return replies
