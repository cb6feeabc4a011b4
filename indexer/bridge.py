"""The bridge: a vLLM / SGLang ZMQ KV-event stream -> `ApplyExternalKvBatch` calls against any
`kv_indexer.v1.KVIndexer` (kvplane's or SGLang's), like SGLang's own bridge.

It is a `ZmqSource` (seq tracking, replay, rebuild on restart) whose sink is a KVIndexer
client (an insecure channel, or TLS per `channels`). Translation (`indexer.translate`)
coalesces adjacent REPORTs / REVOKEs to one tier, splits at 256 actions / 16,384 hashes with
the same seq, turns AllBlocksCleared into one CLEAR per configured tier in place, and by
default skips nil and EXTERNAL media (configurable).
Copies are counted here, since the KVIndexer API has no notion of them.

An apply that fails with a transient status (UNAVAILABLE, DEADLINE_EXCEEDED) is retried with
backoff, blocking the stream (ZMQ buffers meanwhile; an
overflow shows up as a gap and is replayed); UNAUTHENTICATED and PERMISSION_DENIED stop the
bridge (a ConfigError: every later batch would be refused alike, so running on would only drop
them); any other status drops that batch and is logged.
An apply that gets through after UNAVAILABLE, once something was delivered before, asks the
source to resync the worker (`on_target_back`): the target was unreachable and may have
restarted empty (kvplane's memory indexer does), losing every block indexed before.
A batch is validated with the seed's rules before it is converted and sent: one that breaks
them (a value out of its wire field's range) raises `IndexRequestError`, which the source
counts as a bad message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import zmq.asyncio

from indexer.batch import Batch, CacheSpec, Tier
from indexer.kv_wire import batch_to_proto
from indexer.sources.zmq import ZmqSource, ZmqSourceSettings
from indexer.translate import (
    ALL_TIERS,
    BRIDGE_MEDIUM_MAP,
    HashMode,
    MediumMap,
    TranslateOptions,
    WorkerTranslator,
)
from indexer.validation import validate_batch
from kv_indexer.v1 import kv_indexer_pb2_grpc as kv_grpc
from kvplane.channels import INSECURE, ClientChannels
from kvplane.errors import ConfigError
from kvplane.server import bearer_token_metadata

log = logging.getLogger(__name__)

# RESOURCE_EXHAUSTED is not among them: applies are never shed, so on an apply it means the
# batch broke a size limit and would fail again.
_TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# The target refuses the bridge itself, not one batch.
_REFUSED = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})


class KvIndexerSink:
    """Sends batches with ApplyExternalKvBatch; retries transient failures.

    `on_target_back` is called when an apply succeeds after UNAVAILABLE while an earlier batch
    had been delivered: those earlier batches may be gone (the target restarted empty)."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        channels: ClientChannels = INSECURE,
        timeout_s: float = 5.0,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 5.0,
    ) -> None:
        self._channel = channels.aio_channel(target)
        self._stub = kv_grpc.KVIndexerStub(self._channel)
        self._metadata = bearer_token_metadata(token)
        self._timeout_s = timeout_s
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self.target = target
        self.num_sent = 0
        self.num_retries = 0
        self.num_rejected = 0
        self.on_target_back: Callable[[], None] | None = None

    async def apply(self, batch: Batch) -> None:
        validate_batch(batch)  # the receiver's rules; batch_to_proto needs in-range values
        request = batch_to_proto(batch)
        backoff = self._backoff_initial_s
        unreachable = False
        while True:
            try:
                await self._stub.ApplyExternalKvBatch(
                    request, timeout=self._timeout_s, metadata=self._metadata
                )
            except grpc.aio.AioRpcError as exc:
                unreachable |= exc.code() == grpc.StatusCode.UNAVAILABLE
                if exc.code() in _REFUSED:
                    raise ConfigError(
                        f"{self.target} refuses the bridge: {exc.code().name}: "
                        f"{exc.details()} (check --token-file)"
                    ) from None
                if exc.code() not in _TRANSIENT:
                    self.num_rejected += 1
                    log.error(
                        "%s rejected batch seq %d of worker %s: %s: %s",
                        self.target,
                        batch.seq,
                        batch.worker_id,
                        exc.code().name,
                        exc.details(),
                    )
                    return
                self.num_retries += 1
                log.warning(
                    "apply to %s failed (%s: %s); retrying",
                    self.target,
                    exc.code().name,
                    exc.details(),
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._backoff_max_s)
            else:
                if unreachable and self.num_sent and self.on_target_back is not None:
                    log.warning("%s is back after being unreachable: resyncing", self.target)
                    self.on_target_back()
                self.num_sent += 1
                return

    async def close(self) -> None:
        await self._channel.close()


@dataclass(frozen=True, slots=True)
class BridgeSettings:
    endpoint: str
    target: str
    worker_id: str
    worker_address: str = ""
    replay_endpoint: str | None = None
    topic: str = ""
    bind: bool = False
    hash_mode: HashMode = HashMode.ENGINE
    media: MediumMap = BRIDGE_MEDIUM_MAP
    clear_tiers: tuple[Tier, ...] = ALL_TIERS
    block_size: int | None = None
    cache_spec: CacheSpec | None = None
    token: str | None = field(default=None, repr=False)
    channels: ClientChannels = INSECURE


def build_bridge(
    settings: BridgeSettings, *, context: zmq.asyncio.Context | None = None
) -> tuple[ZmqSource, KvIndexerSink]:
    sink = KvIndexerSink(settings.target, token=settings.token, channels=settings.channels)
    translator = WorkerTranslator(
        TranslateOptions(
            worker_id=settings.worker_id,
            worker_address=settings.worker_address,
            hash_mode=settings.hash_mode,
            media=settings.media,
            clear_tiers=settings.clear_tiers,
            default_block_size=settings.block_size,
            cache_spec=settings.cache_spec,
        )
    )
    source = ZmqSource(
        ZmqSourceSettings(
            endpoint=settings.endpoint,
            replay_endpoint=settings.replay_endpoint,
            topic=settings.topic,
            bind=settings.bind,
        ),
        translator,
        sink,
        context=context,
    )
    sink.on_target_back = source.request_resync
    return source, sink


async def run_bridge(settings: BridgeSettings) -> None:
    """Bridge until cancelled (Ctrl-C)."""
    source, sink = build_bridge(settings)
    log.info(
        "bridging %s -> %s as worker %s", settings.endpoint, settings.target, settings.worker_id
    )
    try:
        await source.run()
    finally:
        await sink.close()
