"""The queue between a ZMQ source's SUB socket and its index, bounded by messages and bytes.

A publisher faster than the index (a slow Redis, a burst) gets no back-pressure from it. ZMQ's
own receive queue is bounded by its count of messages only: 100,000 batches of a 32k-token
prompt's blocks (some 100 KB each) would hold some 10 GB. So the source moves each message
from its SUB into this queue as it arrives (the SUB's own queue kept short), and the queue
holds at most `max_messages` messages and `max_bytes` bytes of frames (one message larger than
that alone). A message that does not fit evicts the oldest queued ones (the source counts
them, `queue_drops`): the source sees the gap at the next message it reads and heals it from
the replay. The newest message is always kept, so the last batch of a burst is never the one
lost (with nothing after it to show the gap, the index would miss it, and the removals it
carries, until the engine's next batch).
"""

from __future__ import annotations

import asyncio
from collections import deque

# A source's bound in bytes unless configured (`receive_queue_bytes`): some 2,500 batches of a
# 32k-token prompt's blocks, or hundreds of thousands of a decode step's.
DEFAULT_RECEIVE_QUEUE_BYTES = 256 * 1024 * 1024


class ReceiveQueue:
    """A FIFO of received messages (their frames), for one consumer."""

    def __init__(self, max_messages: int, max_bytes: int) -> None:
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self._messages: deque[tuple[list[bytes], int]] = deque()
        self.bytes = 0  # the queued messages' frames, in bytes
        self.peak_bytes = 0  # the most `bytes` has been
        # The consumer's wait for a message while the queue was empty (`next`).
        self._waiter: asyncio.Future[list[bytes]] | None = None

    def __len__(self) -> int:
        return len(self._messages)

    def put(self, frames: list[bytes]) -> int:
        """Queue a message, evicting the oldest until it fits; returns how many it evicted."""
        size = sum(len(frame) for frame in frames)
        evicted = 0
        while self._messages and (
            len(self._messages) >= self.max_messages or self.bytes + size > self.max_bytes
        ):
            self.bytes -= self._messages.popleft()[1]
            evicted += 1
        self._messages.append((frames, size))
        self.bytes += size
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(self._pop())
        self._waiter = None
        return evicted

    def next(self) -> asyncio.Future[list[bytes]]:
        """The oldest message: done already when one is queued (no task, no turn of the event
        loop per message), else once one comes. (Cancelling it leaves the message queued.)"""
        future: asyncio.Future[list[bytes]] = asyncio.get_running_loop().create_future()
        if self._messages:
            future.set_result(self._pop())
        else:
            self._waiter = future
        return future

    def _pop(self) -> list[bytes]:
        frames, size = self._messages.popleft()
        self.bytes -= size
        return frames

    def clear(self) -> None:
        self._messages.clear()
        self.bytes = 0
