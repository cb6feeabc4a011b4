"""Controller replicas tell each other what they route, over Redis pub/sub.

With `router.replica_sync` (and an index on Redis, which the replicas share) each controller
publishes its router's accounting (`controller.router.replicas`: a request charged to an
engine, its first token, its end) on one channel of the index's Redis, and applies what the
other replicas publish to its own router, so that every replica routes knowing the whole
fleet's requests in flight, and sends a session's requests to one engine, as one controller
would.

Each replica publishes its events (batched: one message per loop turn), a beat every
`replica_heartbeat_s` while it routes nothing, a `hello` when it (re)subscribes, and a `bye`
when it stops; the messages, their numbering and what each does (gaps and first contacts
answered by snapshots) are `controller.router.replica_protocol`, pure; this module is its I/O.

A peer heard from for `replica_timeout_s` (it was killed, or cut off) has its requests released.
Nothing here can stop a replica from routing: while Redis is down each routes on its own
accounting, as without the option, and peers re-learn each other's state by snapshots when it
is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from controller.config import ControllerConfig
from controller.router import Router
from controller.router.replica_protocol import ReplicaProtocol
from controller.router.replicas import PeerRoutes, RouteEvent
from indexer.redis_client import Client, RedisOptions, connect, stop_if_cancelled
from kvplane.backoff import Backoff

log = logging.getLogger(__name__)

# How long the reader waits for a message before it looks at the peers' liveness again.
_POLL_S = 0.2
_RETRY_S = (0.5, 5.0)  # back-off of a lost subscription: first wait, longest wait
_CLOSE_S = 2.0  # the most each step of `close` waits for Redis
CHANNEL = "routes"  # the pub/sub channel of a partition's replicas (`partition_key`)


def open_replica_sync(config: ControllerConfig, router: Router, instance_id: str) -> ReplicaSync:
    """The sync of a controller whose config asks for it, on its index's Redis (its own
    connections; it starts with `start`)."""
    options = RedisOptions(**config.index.backend_options())
    client, _ = connect(config.index.backend, options)
    return ReplicaSync(
        router,
        client,
        options.partition_key(CHANNEL),
        instance_id,
        heartbeat_s=config.router.replica_heartbeat_s,
        timeout_s=config.router.replica_timeout_s,
        owns_client=True,
    )


class ReplicaSync:
    """One replica's side of the sync: publishes its router's events, applies its peers'."""

    def __init__(
        self,
        router: Router,
        client: Client,
        channel: str,
        instance_id: str,
        *,
        heartbeat_s: float = 1.0,
        timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        owns_client: bool = False,
    ) -> None:
        self.router = router
        self.client = client
        self.channel = channel
        self.instance_id = instance_id
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        self.clock = clock
        self._owns_client = owns_client
        self.protocol = ReplicaProtocol(router, instance_id, resend_after_s=heartbeat_s)
        self._wake = asyncio.Event()
        # Held from numbering messages to their publish: they reach Redis in the order of
        # their numbers (the client's pool would send concurrent ones on connections of their
        # own, a slow one overtaken, and peers take a number out of order for a gap).
        self._sending = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self.subscribed = False  # on the channel now (its hello published)

    @property
    def peers(self) -> PeerRoutes:
        return self.protocol.peers

    @property
    def num_gaps(self) -> int:
        """Messages of peers found missing (each answered by a snapshot)."""
        return self.protocol.num_gaps

    async def start(self) -> None:
        self.router.publish_to(self._queue)
        self._tasks = [
            asyncio.create_task(self._publish_loop(), name="replica sync publish"),
            asyncio.create_task(self._subscribe_loop(), name="replica sync subscribe"),
        ]

    async def close(self) -> None:
        """Says bye (peers release this replica's requests at once) and stops; bounded by
        `_CLOSE_S` per step whatever state Redis is in."""
        self.router.publish_to(None)
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=_CLOSE_S)
        self._tasks = []
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(_CLOSE_S):
                await self._send(lambda: [self.protocol.message("bye")])
        self.protocol.forget_all()
        if self._owns_client:
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                async with asyncio.timeout(_CLOSE_S):
                    await self.client.aclose()

    def _queue(self, event: RouteEvent) -> None:
        self.protocol.queue(event)
        self._wake.set()

    async def _publish(self, message: bytes) -> None:
        await self.client.publish(self.channel, message)

    def _receive(self, data: bytes) -> list[bytes]:
        """Apply a peer's message; what to publish in answer."""
        return self.protocol.receive(data, self.clock())

    async def _send(self, messages: Callable[[], list[bytes]]) -> None:
        """Number `messages()` and publish them, one sender at a time (`_sending`)."""
        async with self._sending:
            for message in messages():
                await self._publish(message)

    async def _publish_loop(self) -> None:
        """Sends the router's events as they come, and a beat when there were none for
        `heartbeat_s`. A message Redis did not take is lost (its seq with it): peers find the
        gap when the next one arrives and ask for a snapshot."""
        while True:
            stop_if_cancelled()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.heartbeat_s):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self._send(lambda: [self.protocol.turn()])
            except (RedisError, OSError) as exc:
                log.debug("replica sync: publish failed: %s", exc)
            self._forget_silent_peers()

    async def _subscribe_loop(self) -> None:
        """Follows the channel; after a lost subscription, starts again from nothing (what
        peers did meanwhile is unknown) and asks them for snapshots."""
        backoff = Backoff(*_RETRY_S)
        lost = False  # said once an outage: every retry meanwhile fails alike
        while True:
            stop_if_cancelled()
            pubsub = self.client.pubsub()
            try:
                await pubsub.subscribe(self.channel)
                await self._send(lambda: [self.protocol.message("hello")])
                self.subscribed = True
                backoff.reset()
                if lost:
                    log.info("replica sync: back on the channel %s", self.channel)
                    lost = False
                while True:
                    stop_if_cancelled()
                    message = await pubsub.get_message(
                        ignore_subscribe_messages=True, timeout=_POLL_S
                    )
                    if message is not None:
                        answer = functools.partial(self._receive, message["data"])
                        await self._send(answer)
            except (RedisError, OSError) as exc:
                self.subscribed = False
                if not lost:
                    log.warning(
                        "replica sync: lost the channel %s (%s); routing on this replica's "
                        "own accounting until it is back",
                        self.channel,
                        exc,
                    )
                    lost = True
                self.protocol.forget_all()
            finally:
                with contextlib.suppress(RedisError, OSError, TimeoutError):
                    async with asyncio.timeout(_CLOSE_S):
                        await pubsub.aclose()
            await asyncio.sleep(backoff.take())

    def _forget_silent_peers(self) -> None:
        self.protocol.forget_silent_other_versions(self.clock(), self.timeout_s)
        for origin in self.protocol.silent_peers(self.clock(), self.timeout_s):
            log.warning(
                "replica sync: no word from controller %s for %.0f s; releasing its requests",
                origin,
                self.timeout_s,
            )
            self.protocol.forget(origin)
