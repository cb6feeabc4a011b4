"""A vLLM-style KV-event publisher on real ZMQ sockets, for the source and bridge tests.

An XPUB socket (a PUB that also reports subscriptions, so a test can wait until the SUB is
connected instead of sleeping) and a ROUTER speaking vLLM 0.32's legacy replay protocol:
`[b"", start_seq]` in, `[b"", topic, seq, payload]` per buffered batch (or without the topic,
like older vLLM) out, then the end marker `[b"", b"", ff*8, b""]`. `restart` stands for a new
engine process on the same endpoints. Run as a module, it serves in a process of its own
(`main`), which a test can stop and resume.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import msgpack
import zmq
import zmq.asyncio

END_MARKER = [b"", b"", b"\xff" * 8, b""]
TWO_FRAME_PREFIX = b"\x00"  # a 2-frame message's first byte: its seq's, below 2^56


class FakeKvPublisher:
    def __init__(
        self,
        context: zmq.asyncio.Context,
        *,
        replay_with_topic: bool = True,
        buffer_steps: int | None = None,
        endpoint: str = "tcp://127.0.0.1:*",
        replay_endpoint: str = "tcp://127.0.0.1:*",
        connect: bool = False,
        pub_now: bool = True,
    ) -> None:
        """`pub_now` False: only the replay ROUTER is up until `open_pub` (the PUB then on
        `endpoint`, which must name its port)."""
        self.context = context
        self.connect = connect
        self.endpoint = endpoint
        self.pub: zmq.asyncio.Socket | None = None
        if pub_now:
            self.open_pub()
        self.router = context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        _allow_ipv6(self.router, replay_endpoint)
        self.router.bind(replay_endpoint)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        # seq -> [topic, seq, payload]: what the replay ROUTER serves.
        self.buffer: dict[int, list[bytes]] = {}
        self.replay_with_topic = replay_with_topic
        # Like vLLM's buffer_steps: only the newest batches stay replayable.
        self.buffer_steps = buffer_steps
        self.replay_requests: list[int] = []
        # seq -> how many more replays lose it (None: every one), as a ROUTER at its
        # high-water mark drops replies (`lose_in_replays`).
        self.lost_in_replays: dict[int, int | None] = {}
        self.subscriptions: set[bytes] = set()  # every topic subscribed to so far
        self._replay_task: asyncio.Task[None] | None = None

    def open_pub(self) -> None:
        self.pub = self._open_pub(self.endpoint)
        if not self.connect:
            self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)

    async def open_pub_when_free(self) -> None:
        """`open_pub` on an endpoint a socket just closed: ZMQ's I/O thread closes its
        listener soon, not at once."""
        for _ in range(100):
            try:
                self.open_pub()
                return
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE:
                    raise
                await asyncio.sleep(0.01)
        raise RuntimeError(f"{self.endpoint} still in use after the old socket closed")

    def _open_pub(self, endpoint: str) -> zmq.asyncio.Socket:
        pub = self.context.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 0)
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every subscriber, not just the first
        _allow_ipv6(pub, endpoint)
        if self.connect:  # to a SUB that binds (vLLM with an endpoint without `*`)
            pub.connect(endpoint)
        else:
            pub.bind(endpoint)
        return pub

    def _opened_pub(self) -> zmq.asyncio.Socket:
        """The PUB socket, which a publisher built with `pub_now=False` opens later."""
        assert self.pub is not None, "the PUB is not open yet (pub_now=False): open_pub() first"
        return self.pub

    def close_pub(self) -> None:
        """The engine's publisher gone: its PUB closed (the replay ROUTER still answers)."""
        self._opened_pub().close(linger=0)

    async def restart(self) -> None:
        """A new engine process: a new PUB on the same endpoint (so new connections) and an
        empty replay buffer, served on the same replay endpoint."""
        self.close_pub()
        self.buffer.clear()
        await self.open_pub_when_free()

    async def wait_subscribed(
        self, timeout_s: float = 10.0, *, topic: bytes | None = None
    ) -> bytes:
        """Wait for a SUB to subscribe; returns the topic. By default: a new subscription to
        anything but the prefix a source with a topic adds for 2-frame messages (so one a
        connection, as without that prefix). With `topic`: until some SUB has subscribed to
        it, now or before. Unsubscriptions are skipped."""
        if topic is not None and topic in self.subscriptions:
            return topic
        async with asyncio.timeout(timeout_s):
            while True:
                message = await self._opened_pub().recv()
                if message[:1] != b"\x01":
                    continue
                subscribed = bytes(message[1:])
                self.subscriptions.add(subscribed)
                if subscribed == topic or (topic is None and subscribed != TWO_FRAME_PREFIX):
                    return subscribed

    async def send(self, frames: list[bytes]) -> None:
        await self._opened_pub().send_multipart(frames)

    async def publish(
        self,
        frames: list[bytes],
        *,
        live: bool = True,
        two_frames: bool = False,
        replay_frames: list[bytes] | None = None,
    ) -> None:
        """Buffer a [topic, seq, payload] batch for replay (as `replay_frames` when given) and,
        unless `live` is False (the subscriber loses it), send it (without the topic frame
        when `two_frames`)."""
        self.buffer[int.from_bytes(frames[1], "big")] = replay_frames or frames
        if self.buffer_steps is not None:
            while len(self.buffer) > self.buffer_steps:
                del self.buffer[min(self.buffer)]
        if live:
            await self.send(frames[1:] if two_frames else frames)

    def lose_in_replays(self, seq: int, times: int | None = None) -> None:
        """The next `times` replays (None: every one) leave out `seq` and still end with the
        end marker: what vLLM's and SGLang's replay ROUTER does when its tight send loop
        outruns its high-water mark (1000 messages), which ZMQ's ROUTER handles by dropping."""
        self.lost_in_replays[seq] = times

    def _lost(self, seq: int) -> bool:
        """Whether this replay leaves `seq` out (counting it as one of its losses)."""
        if seq not in self.lost_in_replays:
            return False
        times = self.lost_in_replays[seq]
        if times is not None:
            if times == 0:
                return False
            self.lost_in_replays[seq] = times - 1
        return True

    def start_replay(self) -> None:
        self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    async def stop_replay(self) -> None:
        """The replay ROUTER stops answering (still bound: a request waits for ever, as on an
        engine whose replay thread is stuck)."""
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None

    async def _serve_replay(self) -> None:
        while True:
            identity, _empty, start = await self.router.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            self.replay_requests.append(start_seq)
            for seq in sorted(self.buffer):
                if seq >= start_seq and not self._lost(seq):
                    topic, seq_frame, payload = self.buffer[seq]
                    body = (
                        [topic, seq_frame, payload]
                        if self.replay_with_topic
                        else [
                            seq_frame,
                            payload,
                        ]
                    )
                    await self.router.send_multipart([identity, b"", *body])
            end = END_MARKER if self.replay_with_topic else [b"", b"\xff" * 8, b""]
            await self.router.send_multipart([identity, *end])

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        if self.pub is not None:
            self.pub.close(linger=0)
        self.router.close(linger=0)


def _allow_ipv6(sock: zmq.asyncio.Socket, endpoint: str) -> None:
    """libzmq reaches an IPv6 address (in brackets) only with its IPv6 option on."""
    if "[" in endpoint:
        sock.setsockopt(zmq.IPV6, 1)


@contextlib.asynccontextmanager
async def running(task_coro: Coroutine[Any, Any, None]) -> AsyncIterator[asyncio.Task[None]]:
    """Run a coroutine as a task for the duration of the block, then cancel it."""
    task = asyncio.ensure_future(task_coro)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _serve_in_this_process(first_block: int, count: int) -> None:
    """`main`: a publisher with replay, its endpoints printed on one line; once a SUB has
    subscribed, batches seq 0..count-1 storing blocks first_block, first_block + 1, ...;
    then it serves replays until killed."""
    context = zmq.asyncio.Context()
    publisher = FakeKvPublisher(context)
    publisher.start_replay()
    print(publisher.endpoint, publisher.replay_endpoint, flush=True)
    await publisher.wait_subscribed(timeout_s=60.0)
    for seq in range(count):
        event = {"type": "BlockStored", "block_hashes": [first_block + seq], "medium": "GPU"}
        payload = msgpack.packb([float(seq), [event], None])
        await publisher.publish([b"kv@test", seq.to_bytes(8, "big"), payload])
    await asyncio.Event().wait()


def main() -> None:
    """A publisher in a process of its own, that a test can stop (SIGSTOP) and resume:
    `python -m tests.indexer.fake_kv_publisher FIRST_BLOCK COUNT`."""
    asyncio.run(_serve_in_this_process(int(sys.argv[1]), int(sys.argv[2])))


if __name__ == "__main__":
    main()
