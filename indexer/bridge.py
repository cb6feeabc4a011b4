"""The bridge: a vLLM / SGLang ZMQ KV-event stream -> `ApplyExternalKvBatch` calls against any
`kv_indexer.v1.KVIndexer` (kvplane's or SGLang's), like SGLang's own bridge.

It is a `ZmqSource` (seq tracking, replay, rebuild on restart) whose sink is a KVIndexer
client (an insecure channel, or TLS per `channels`, with the bearer token they carry: a
`--token-file` followed as it changes). Translation (`indexer.translate`)
coalesces adjacent REPORTs / REVOKEs to one tier, splits at 256 actions / 16,384 hashes with
the same seq, turns AllBlocksCleared into one CLEAR per configured tier in place, and by
default skips nil and EXTERNAL media (configurable). Positional events' fields from index 7 on
(a hybrid model's group_idx and spec kind among them) are read only with `array_tail="vllm"`
(`indexer.zmq_decode`); by default every group reads as group 0.
Copies are counted here, since the KVIndexer API has no notion of them.

An apply that fails with a transient status (UNAVAILABLE, DEADLINE_EXCEEDED) is retried with
backoff, blocking the stream (the source's receive queue buffers meanwhile, up to its bounds;
an overflow shows up as a gap and is replayed); UNAUTHENTICATED and PERMISSION_DENIED stop the
bridge (a ConfigError: every later batch would be refused alike, so running on would only drop
them); any other status drops that batch: it raises `IndexRequestError`, which the source
takes as a batch the index refused (a bad message; a clear that did not land, so the source's
next clear is sent again rather than skipped).
The target may lose the worker's blocks (kvplane's memory indexer restarts empty, a Redis
behind it is flushed or evicts keys) without the bridge seeing a failed apply: the seed's
applies are unconditional and answer nothing. Two signs make the sink
ask the source to resync the worker (`on_worker_lost`: clear it on the target, rebuild it from
the publisher's replay from seq 0):
- an apply gets through after UNAVAILABLE, once something was delivered before;
- the probe (`follow` runs it beside the source): the sink keeps the blocks it delivered and
  has not revoked (`indexer.delivered_blocks`: their keys exactly as sent, engine or
  canonical, per tier), and every `probe_interval_s` asks the target, in one MatchExternalKv
  (count_as_hit false; the seed's API only, so any KVIndexer and any backend will do), for the
  canary (one held block, replaced at once by another held from before when revoked), the
  blocks the last probe found missing, and the next `PROBE_SAMPLE_BLOCKS` held blocks in turn. A
  block missing from two answers in a row means the target lost the worker's state, whole or
  in part (one miss could be a read lagging an acknowledged apply). The probe holds the apply
  lock, so it never reads a state an apply is changing; a probe that fails (UNAVAILABLE,
  DEADLINE_EXCEEDED, ...) tells nothing and is only logged (the apply path handles an
  unreachable target); a confirmed loss forgets every held block, so one loss is reported
  once, and with nothing held nothing is probed.
  Without a replay endpoint the resync only clears the worker: the next message rebuilds it
  from then on (blocks from before stay missing, never stale).
A batch is validated with the seed's rules before it is converted and sent: one that breaks
them (a value out of its wire field's range) raises `IndexRequestError`, which the source
counts as a bad message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import zmq.asyncio

from indexer.batch import Batch, CacheSpec, Tier
from indexer.delivered_blocks import DeliveredBlocks, Placement
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
from indexer.validation import IndexRequestError, ValidationKind, validate_batch
from indexer.zmq_decode import ArrayTail
from kv_indexer.v1 import kv_indexer_pb2 as kv
from kv_indexer.v1 import kv_indexer_pb2_grpc as kv_grpc
from kvplane.backoff import Backoff
from kvplane.channels import INSECURE, ClientChannels, Redialling
from kvplane.errors import ConfigError, KvplaneError
from kvplane.zmq_heartbeat import DEFAULT_HEARTBEAT, Heartbeat

log = logging.getLogger(__name__)

# RESOURCE_EXHAUSTED is not among them: applies are never shed, so on an apply it means the
# batch broke a size limit and would fail again.
_TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# The target refuses the bridge itself, not one batch.
_REFUSED = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})
# Held blocks asked about at each probe besides the canary and the suspects: a lost one is
# asked about within ceil(held / 16) probes (docs/indexer.md, "The bridge").
PROBE_SAMPLE_BLOCKS = 16
_TIERS = frozenset(int(t) for t in Tier)


def _rejection(target: str, exc: grpc.aio.AioRpcError) -> IndexRequestError:
    """A batch the target refused with a status that would come again, as the source takes
    a batch the index refuses (`ZmqSource._index`, `ZmqSource._reset_worker`): dropped and
    its message counted as bad, or a clear that did not land."""
    code = exc.code()
    kind = (
        ValidationKind.RESOURCE_EXHAUSTED
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED
        else ValidationKind.INVALID_ARGUMENT
    )
    return IndexRequestError(kind, f"{target} rejected it: {code.name}: {exc.details()}")


class KvIndexerSink:
    """Sends batches with ApplyExternalKvBatch; retries transient failures; probes the blocks
    it delivered.

    `on_worker_lost` is called when the target may have lost the blocks delivered so far: an
    apply succeeds after UNAVAILABLE while an earlier batch had been delivered (the target
    restarted, maybe empty), or two probes in a row find a delivered block missing."""

    def __init__(
        self,
        target: str,
        worker_id: str,
        *,
        channels: ClientChannels = INSECURE,
        timeout_s: float = 5.0,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 5.0,
    ) -> None:
        self._dialled: Redialling[kv_grpc.KVIndexerAsyncStub] = Redialling(
            channels, target, kv_grpc.KVIndexerStub
        )
        self._timeout_s = timeout_s
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self.target = target
        self.worker_id = worker_id  # the one worker it feeds (the probe asks for its blocks)
        self.num_sent = 0
        self.num_retries = 0
        self.num_rejected = 0
        self.num_probes = 0
        self.num_losses_found = 0  # by the probe: the target lost the worker's state
        self.on_worker_lost: Callable[[], None] | None = None
        # What the target holds as far as the bridge knows, and what to probe of it.
        self.delivered = DeliveredBlocks()
        # Held by each apply (with its retries) and each probe: a probe never reads a state an
        # apply is changing, and `delivered` always describes what the target last applied.
        self._lock = asyncio.Lock()
        # The status of the last probe's failure (None: it answered), so a target refusing
        # probes is logged once, not every interval.
        self._probe_failure: grpc.StatusCode | None = None

    async def apply(self, batch: Batch) -> None:
        validate_batch(batch)  # the receiver's rules; batch_to_proto needs in-range values
        request = batch_to_proto(batch)
        async with self._lock:
            await self._send(batch, request)

    async def _send(self, batch: Batch, request: kv.ApplyExternalKvBatchRequest) -> None:
        backoff = Backoff(self._backoff_initial_s, self._backoff_max_s)
        unreachable = False
        while True:
            try:
                await self._dialled.stub.ApplyExternalKvBatch(request, timeout=self._timeout_s)
            except grpc.aio.AioRpcError as exc:
                await self._dialled.after_failure()
                unreachable |= exc.code() == grpc.StatusCode.UNAVAILABLE
                if exc.code() in _REFUSED:
                    raise ConfigError(
                        f"{self.target} refuses the bridge: {exc.code().name}: "
                        f"{exc.details()} (check --token-file)"
                    ) from None
                if exc.code() not in _TRANSIENT:
                    self.num_rejected += 1
                    raise _rejection(self.target, exc) from None
                self.num_retries += 1
                log.warning(
                    "apply to %s failed (%s: %s); retrying",
                    self.target,
                    exc.code().name,
                    exc.details(),
                )
                await asyncio.sleep(backoff.take())
            else:
                if unreachable and self.num_sent and self.on_worker_lost is not None:
                    log.warning("%s is back after being unreachable: resyncing", self.target)
                    self.on_worker_lost()
                self.num_sent += 1
                self.delivered.applied(batch)
                return

    async def probe_every(self, interval_s: float) -> None:
        """Probe every `interval_s` until cancelled; once the target lost delivered blocks,
        `on_worker_lost`."""
        while True:
            await asyncio.sleep(interval_s)
            if await self.lost_blocks() and self.on_worker_lost is not None:
                self.on_worker_lost()

    async def lost_blocks(self) -> bool:
        """One probe: whether the target lost delivered blocks (a block missing from this
        answer and the one before; then every delivered block is forgotten). False with
        nothing delivered, or when the probe failed (neither confirms nor clears a miss)."""
        async with self._lock:
            asked = self.delivered.to_ask(PROBE_SAMPLE_BLOCKS)
            if not asked:
                return False
            found = await self._held(asked)
            if found is None:
                return False
            lost = self.delivered.answered(asked, found)
            if not lost:
                return False
            self.delivered.forget()
            self.num_losses_found += 1
            (tier, key), *others = lost
            log.warning(
                "%s no longer holds block %d of worker %s at %s%s: it lost the worker's state; "
                "resyncing",
                self.target,
                key,
                self.worker_id,
                tier.name,
                f" (and {len(others)} more)" if others else "",
            )
            return True

    async def _held(self, asked: list[Placement]) -> set[Placement] | None:
        """Which of `asked` the target places on the worker; None when the probe failed
        (logged once per run of failures with one status)."""
        self.num_probes += 1
        hashes = list(dict.fromkeys(key for _tier, key in asked))
        request = kv.MatchExternalKvRequest(hashes=hashes, count_as_hit=False)
        try:
            response = await self._dialled.stub.MatchExternalKv(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            await self._dialled.after_failure()
            if exc.code() != self._probe_failure:
                log.warning(
                    "probe of %s failed (%s: %s); trying again in a while",
                    self.target,
                    exc.code().name,
                    exc.details(),
                )
            self._probe_failure = exc.code()
            return None
        self._probe_failure = None
        return {
            (Tier(by_tier.tier), key)
            for match in response.matches
            if match.worker_id == self.worker_id
            for by_tier in match.hashes_by_tier
            if by_tier.tier in _TIERS
            for key in by_tier.hashes
        }

    async def close(self) -> None:
        await self._dialled.close()


@dataclass(frozen=True, slots=True)
class BridgeSettings:
    endpoint: str
    target: str
    worker_id: str
    worker_address: str = ""
    replay_endpoint: str | None = None
    topic: str = ""
    bind: bool = False
    # Positional events' fields from index 7 on: vLLM's ("vllm") or engine-specific ("ignore").
    array_tail: ArrayTail = "ignore"
    hash_mode: HashMode = HashMode.ENGINE
    media: MediumMap = BRIDGE_MEDIUM_MAP
    clear_tiers: tuple[Tier, ...] = ALL_TIERS
    block_size: int | None = None
    cache_spec: CacheSpec | None = None
    # TLS, and the bearer token every call carries (`with_token_file`: followed as its file
    # changes).
    channels: ClientChannels = INSECURE
    # How often the delivered blocks are probed; 0 = never.
    probe_interval_s: float = 2.0
    heartbeat: Heartbeat = DEFAULT_HEARTBEAT


def build_bridge(
    settings: BridgeSettings, *, context: zmq.asyncio.Context | None = None
) -> tuple[ZmqSource, KvIndexerSink]:
    sink = KvIndexerSink(settings.target, settings.worker_id, channels=settings.channels)
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
            array_tail=settings.array_tail,
            heartbeat=settings.heartbeat,
        ),
        translator,
        sink,
        context=context,
    )
    sink.on_worker_lost = source.request_resync
    return source, sink


async def follow(source: ZmqSource, sink: KvIndexerSink, *, probe_interval_s: float) -> None:
    """Follow the publisher into the sink and probe the target every `probe_interval_s` (0:
    never) until cancelled. A `KvplaneError` that stops the source (a target refusing the
    bridge, an endpoint ZMQ cannot parse) is raised as it is."""
    try:
        async with asyncio.TaskGroup() as group:
            group.create_task(source.run())
            if probe_interval_s > 0:
                group.create_task(sink.probe_every(probe_interval_s))
    except* KvplaneError as failed:
        raise failed.exceptions[0] from None


async def run_bridge(settings: BridgeSettings) -> None:
    """Bridge until cancelled (Ctrl-C)."""
    source, sink = build_bridge(settings)
    log.info(
        "bridging %s -> %s as worker %s", settings.endpoint, settings.target, settings.worker_id
    )
    try:
        await follow(source, sink, probe_interval_s=settings.probe_interval_s)
    finally:
        await sink.close()
