"""Runtime events for planners: FORWARD_PASS, BATCH and QUEUE, fanned out to subscribers.

Each engine step yields one FORWARD_PASS (batch size, scheduled/prefill/cached tokens,
duration) and one BATCH (the step's prefill/decode composition); QUEUE is emitted whenever
the running/waiting counts change. Values are strings in `attributes` (the proto's map).
Subscribers get bounded queues: one that falls `max_queue` events behind is ended with
SubscriberOverrunError (its stream's terminal EngineError), never allowed to grow memory.
An event has one id on every subscription, never given again, even by a later process of
the same `instance_id`: `<instance_id>-<token drawn at start>-<n>`.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass

from engine.core.api import ForwardPassStats, LoadSnapshot
from engine.server.kv_event_log import SubscriberOverrunError
from openengine.v1 import openengine_pb2 as pb

_ALL_TYPES = frozenset(
    {pb.RUNTIME_EVENT_TYPE_FORWARD_PASS, pb.RUNTIME_EVENT_TYPE_BATCH, pb.RUNTIME_EVENT_TYPE_QUEUE}
)


@dataclass(eq=False)
class _Subscriber:
    types: frozenset[int]
    queue: asyncio.Queue[pb.RuntimeEvent | None]
    overrun: bool = False


class RuntimeEventHub:
    def __init__(
        self, instance_id: str, max_queue: int = 4096, clock_ns: Callable[[], int] = time.time_ns
    ) -> None:
        # `<instance_id>-<this process's token>-<n>`: an engine restarted with the same
        # `instance_id` counts from 1 again under another token, so an id names one event.
        self._id_prefix = f"{instance_id}-{secrets.token_hex(4)}-"
        self._max_queue = max_queue
        self._clock_ns = clock_ns
        self._ids = itertools.count(1)
        self._subscribers: list[_Subscriber] = []
        self._last_queue: tuple[int, int] | None = None
        self._closed = False

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def _event(self, kind: pb.RuntimeEventType.ValueType, attrs: dict[str, str]) -> pb.RuntimeEvent:
        return pb.RuntimeEvent(
            event_id=f"{self._id_prefix}{next(self._ids)}",
            timestamp_unix_nanos=self._clock_ns(),
            type=kind,
            attributes=attrs,
        )

    def publish_step(self, stats: ForwardPassStats | None, load: LoadSnapshot) -> None:
        """Events for one engine report (a step, or a command such as an abort)."""
        if stats is not None and self._subscribers:
            self._publish(
                self._event(
                    pb.RUNTIME_EVENT_TYPE_FORWARD_PASS,
                    {
                        "batch_size": str(stats.batch_size),
                        "num_scheduled_tokens": str(stats.num_scheduled_tokens),
                        "num_prefill_tokens": str(stats.num_prefill_tokens),
                        "num_decode_sequences": str(stats.num_decode_sequences),
                        "num_cached_tokens": str(stats.num_cached_tokens),
                        "num_preempted": str(stats.num_preempted),
                        "duration_ms": f"{stats.duration_s * 1e3:.3f}",
                    },
                )
            )
            self._publish(
                self._event(
                    pb.RUNTIME_EVENT_TYPE_BATCH,
                    {
                        "batch_size": str(stats.batch_size),
                        "prefill_sequences": str(stats.batch_size - stats.num_decode_sequences),
                        "decode_sequences": str(stats.num_decode_sequences),
                        "prefill_tokens": str(stats.num_prefill_tokens),
                        "decode_tokens": str(stats.num_scheduled_tokens - stats.num_prefill_tokens),
                    },
                )
            )
        queue_state = (load.num_running, load.num_waiting)
        if queue_state != self._last_queue:
            self._last_queue = queue_state
            if self._subscribers:
                self._publish(
                    self._event(
                        pb.RUNTIME_EVENT_TYPE_QUEUE,
                        {
                            "running_requests": str(load.num_running),
                            "queued_requests": str(load.num_waiting),
                            "running_tokens": str(load.running_tokens),
                            "waiting_tokens": str(load.waiting_tokens),
                            "used_kv_blocks": str(load.num_used_blocks),
                            "total_kv_blocks": str(load.num_total_blocks),
                        },
                    )
                )

    def _publish(self, event: pb.RuntimeEvent) -> None:
        for sub in self._subscribers:
            if sub.overrun or event.type not in sub.types:
                continue
            if sub.queue.qsize() >= self._max_queue:
                sub.overrun = True
                sub.queue.put_nowait(None)
            else:
                sub.queue.put_nowait(event)

    def close(self) -> None:
        """End every subscription, and any made from now on (the engine is shutting down)."""
        self._closed = True
        for sub in self._subscribers:
            sub.queue.put_nowait(None)

    def subscribe(
        self, types: Collection[pb.RuntimeEventType.ValueType]
    ) -> AsyncIterator[pb.RuntimeEvent]:
        """Events of `types` (empty: all) from this call on, until close or overrun. Iterate
        the result to the end (or close it): that is what unregisters the subscriber."""
        wanted = frozenset(int(t) for t in types) or _ALL_TYPES
        sub = _Subscriber(wanted, asyncio.Queue())
        self._subscribers.append(sub)
        if self._closed:  # no event will ever come: end it at once, as close() would have
            sub.queue.put_nowait(None)
        return self._stream(sub)

    async def _stream(self, sub: _Subscriber) -> AsyncIterator[pb.RuntimeEvent]:
        try:
            while True:
                event = await sub.queue.get()
                if event is None:
                    if sub.overrun:
                        raise SubscriberOverrunError(
                            f"runtime event subscriber fell {self._max_queue} events behind"
                        )
                    return
                yield event
        finally:
            self._subscribers.remove(sub)
