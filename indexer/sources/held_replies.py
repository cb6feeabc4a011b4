"""A ZMQ source's replay replies, held by seq until applied, bounded by bytes.

A replay brings the publisher's whole buffer from the seq asked for (vLLM keeps 10,000
batches by default): thousands of a long prompt's batches (some 100 KB each) would hold
gigabytes. So the replies are held at most `max_bytes` of payloads (a single larger reply
alone, as the receive queue holds live messages, `indexer.sources.receive_queue`): past
that the oldest are dropped as they come (`dropped`), and a seq no higher than one dropped
is not taken again. What a replay cannot hold thus leaves a hole before the newest replies,
which the source treats as a hole in the replay no request filled: what comes before it is
dropped, blocks missing, never stale (`ZmqSource._replay`).
"""

from __future__ import annotations

import heapq
import itertools

from indexer.zmq_decode import ZmqMessage

# A source's bound unless configured (`replay_bytes`): vLLM's default buffer (10,000
# batches) of batches some 100 KB each, and four times the receive queue's default bound
# (`receive_queue_bytes`): the replay that heals an overflow of that queue brings both what
# the queue dropped and what it still holds.
DEFAULT_REPLAY_BYTES = 1024 * 1024 * 1024


class HeldReplies:
    """One replay's replies by seq (all its rounds'), at most `max_bytes` of payloads."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.by_seq: dict[int, ZmqMessage] = {}
        self.bytes = 0  # the held replies' payloads
        self.dropped = 0
        self._oldest_first: list[int] = []  # a heap of the held seqs
        self._dropped_up_to = -1

    def add(self, reply: ZmqMessage) -> None:
        """Hold `reply` (unless held already or below a dropped one), dropping the oldest
        until the bound holds."""
        if reply.seq <= self._dropped_up_to or reply.seq in self.by_seq:
            return
        self.by_seq[reply.seq] = reply
        heapq.heappush(self._oldest_first, reply.seq)
        self.bytes += len(reply.payload)
        while self.bytes > self.max_bytes and len(self.by_seq) > 1:
            oldest = heapq.heappop(self._oldest_first)
            self.bytes -= len(self.by_seq.pop(oldest).payload)
            self._dropped_up_to = oldest
            self.dropped += 1

    def in_seq_order(self) -> list[ZmqMessage]:
        return [self.by_seq[seq] for seq in sorted(self.by_seq)]

    def first_missing_seq(self) -> int | None:
        """The first seq missing between the lowest and the highest held (a hole), if any."""
        held = self.by_seq
        if not held or len(held) == max(held) - min(held) + 1:
            return None
        return next(seq for seq in itertools.count(min(held)) if seq not in held)
