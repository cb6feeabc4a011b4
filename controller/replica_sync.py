"""Controller replicas tell each other what they route, over Redis pub/sub.

With `router.replica_sync` (and an index on Redis, which the replicas share) each controller
publishes its router's accounting (`controller.router.replicas`: a request charged to an
engine, its first token, its end) on one channel of the index's Redis, and applies what the
other replicas publish to its own router, so that every replica routes knowing the whole
fleet's requests in flight, as one controller would.

Messages are msgpack arrays `[1, origin, seq, kind, body]`; `origin` is the replica's instance
id, `seq` counts its messages from 1. Kinds:

- `events`: the router's events since the last message (batched: one message per loop turn);
- `beat`: every `replica_heartbeat_s`, so that peers know it is alive while it routes nothing;
- `hello`: a replica joined (or lost its subscription and came back): every other replica
  answers with a `snapshot` of its own requests in flight, which replaces what was known of it;
- `resend`: a peer saw a gap in this origin's `seq` (pub/sub delivers at most once: a message
  published while a subscriber was reconnecting is lost for it): the origin answers with a
  snapshot;
- `bye`: the replica stops; peers release its requests at once.

A peer heard from for `replica_timeout_s` (it was killed, or cut off) has its requests released.
Nothing here can stop a replica from routing: while Redis is down each routes on its own
accounting, as without the option, and peers re-learn each other's state by snapshots when it
is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import msgpack
from redis.exceptions import RedisError

from controller.config import ControllerConfig
from controller.router import Router
from controller.router.replicas import Finished, FirstToken, PeerRoutes, Routed, RouteEvent
from indexer.redis_client import Client, RedisOptions, connect

log = logging.getLogger(__name__)

VERSION = 1
_ROUTED, _FIRST_TOKEN, _FINISHED = 0, 1, 2
# How long the reader waits for a message before it looks at the peers' liveness again.
_POLL_S = 0.2
_RETRY_S = (0.5, 5.0)  # back-off of a lost subscription: first wait, longest wait
_CLOSE_S = 2.0  # the most each step of `close` waits for Redis


def channel_name(key_prefix: str, model: str) -> str:
    """The pub/sub channel of a partition's replicas (the index's key prefix and model)."""
    return f"{key_prefix}:{{{model}:0}}:routes"


def encode_event(event: RouteEvent) -> list[Any]:
    if isinstance(event, Routed):
        return [
            _ROUTED,
            event.request_id,
            event.engine_id,
            event.prefill_tokens,
            event.cached_tokens,
            list(event.block_keys),
            event.claims_prefix,
        ]
    return [_FIRST_TOKEN if isinstance(event, FirstToken) else _FINISHED, event.request_id]


def decode_event(item: Any) -> RouteEvent:
    kind = item[0]
    if kind == _ROUTED:
        _, request_id, engine_id, prefill, cached, keys, claims = item
        return Routed(
            str(request_id), str(engine_id), int(prefill), int(cached), tuple(keys), bool(claims)
        )
    if kind == _FIRST_TOKEN:
        return FirstToken(str(item[1]))
    if kind == _FINISHED:
        return Finished(str(item[1]))
    raise ValueError(f"unknown route event kind {kind!r}")


def open_replica_sync(config: ControllerConfig, router: Router, instance_id: str) -> ReplicaSync:
    """The sync of a controller whose config asks for it, on its index's Redis (its own
    connections; it starts with `start`)."""
    options = RedisOptions(**config.index.backend_options())
    client, _ = connect(config.index.backend, options)
    return ReplicaSync(
        router,
        client,
        channel_name(options.key_prefix, options.model),
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
        self.peers = PeerRoutes(router)
        self.num_gaps = 0  # messages of peers found missing (each answered by a snapshot)
        self._seq = 0
        self._outbox: list[list[Any]] = []
        self._wake = asyncio.Event()
        self._heard: dict[str, float] = {}  # origin -> when last heard from
        self._last_seq: dict[str, int] = {}
        self._tasks: list[asyncio.Task[None]] = []

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
                await self._publish("bye", None)
        self._forget_all_peers()
        if self._owns_client:
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                async with asyncio.timeout(_CLOSE_S):
                    await self.client.aclose()

    def _queue(self, event: RouteEvent) -> None:
        self._outbox.append(encode_event(event))
        self._wake.set()

    async def _publish(self, kind: str, body: Any) -> None:
        self._seq += 1
        message = msgpack.packb([VERSION, self.instance_id, self._seq, kind, body])
        await self.client.publish(self.channel, message)

    async def _publish_loop(self) -> None:
        """Sends the router's events as they come, and a beat when there were none for
        `heartbeat_s`. A message Redis did not take is lost (its seq with it): peers find the
        gap when the next one arrives and ask for a snapshot."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.heartbeat_s):
                    await self._wake.wait()
            self._wake.clear()
            events, self._outbox = self._outbox, []
            try:
                if events:
                    await self._publish("events", events)
                else:
                    await self._publish("beat", None)
            except (RedisError, OSError) as exc:
                log.debug("replica sync: publish failed: %s", exc)
            self._forget_silent_peers()

    async def _subscribe_loop(self) -> None:
        """Follows the channel; after a lost subscription, starts again from nothing (what
        peers did meanwhile is unknown) and asks them for snapshots."""
        wait_s = _RETRY_S[0]
        while True:
            pubsub = self.client.pubsub()
            try:
                await pubsub.subscribe(self.channel)
                await self._publish("hello", None)
                wait_s = _RETRY_S[0]
                while True:
                    message = await pubsub.get_message(
                        ignore_subscribe_messages=True, timeout=_POLL_S
                    )
                    if message is not None:
                        await self._receive(message["data"])
            except (RedisError, OSError) as exc:
                log.warning(
                    "replica sync: lost the channel %s (%s); routing on this replica's own "
                    "accounting until it is back",
                    self.channel,
                    exc,
                )
                self._forget_all_peers()
            finally:
                with contextlib.suppress(RedisError, OSError, TimeoutError):
                    async with asyncio.timeout(_CLOSE_S):
                        await pubsub.aclose()
            await asyncio.sleep(wait_s)
            wait_s = min(wait_s * 2, _RETRY_S[1])

    async def _receive(self, data: bytes) -> None:
        try:
            version, origin, seq, kind, body = msgpack.unpackb(data)
            if version != VERSION:
                raise ValueError(f"version {version}")
            origin, seq = str(origin), int(seq)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            log.warning("replica sync: dropping a message that is not one (%s)", exc)
            return
        if origin == self.instance_id:
            return
        now = self.clock()
        if kind == "bye":
            self._forget(origin)
            return
        self._heard[origin] = now
        last = self._last_seq.get(origin)
        self._last_seq[origin] = seq
        if kind == "hello" or (kind == "resend" and body == self.instance_id):
            await self._publish("snapshot", [encode_event(e) for e in self.router.own_routes()])
            return
        try:
            if kind == "snapshot":
                self.peers.replace(origin, [decode_event(item) for item in body], now)
                return
            if last is not None and seq != last + 1:
                self.num_gaps += 1
                await self._publish("resend", origin)
            if kind == "events":
                for item in body:
                    self.peers.apply(origin, decode_event(item), now)
        except (ValueError, TypeError, IndexError) as exc:
            log.warning("replica sync: dropping a bad message from %s (%s)", origin, exc)

    def _forget_silent_peers(self) -> None:
        deadline = self.clock() - self.timeout_s
        for origin in [o for o, heard in self._heard.items() if heard < deadline]:
            log.warning(
                "replica sync: no word from controller %s for %.0f s; releasing its requests",
                origin,
                self.timeout_s,
            )
            self._forget(origin)

    def _forget(self, origin: str) -> None:
        self._heard.pop(origin, None)
        self._last_seq.pop(origin, None)
        self.peers.forget(origin)

    def _forget_all_peers(self) -> None:
        for origin in list(self._heard):
            self._forget(origin)
        for origin in self.peers.origins:
            self.peers.forget(origin)
