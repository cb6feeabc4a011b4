"""gRPC servicers over an `IndexBackend`: the seed's `kv_indexer.v1.KVIndexer`
(byte-compatible) and kvplane's own `kvplane.v1.KvIndex` (token-level matching, stats, dump).

Thin: convert (`indexer.kv_wire`), validate with the core's rules (`indexer.validation`; a batch is
validated by the backend's `apply`, which refuses a bad one before changing anything), call the
backend, convert back, all inside each handler's error mapping (a conversion that fails is a
status, never an unhandled exception). Errors map to status codes through one table
(`_status_of`); prefix queries (MatchExternalKvPrefix, MatchTokens) beyond
`max_concurrent_prefix_queries` in flight are shed with RESOURCE_EXHAUSTED, and one whose
deadline already passed gets DEADLINE_EXCEEDED. Applies are never shed.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

from indexer import keys, vllm_hash
from indexer.backend import IndexBackend, TierPrefix, TokenPrefixMatch
from indexer.batch import BlockKey, to_sfixed64
from indexer.config import OpenEngineSourceConfig, ZmqSourceConfig
from indexer.kv_wire import (
    batch_from_proto,
    batch_to_proto,
    match_to_proto,
    prefix_to_proto,
    stats_to_proto,
    token_matches_to_proto,
)
from indexer.multimodal import MultimodalItem, block_item_ids, block_items
from indexer.redis_client import IndexFullError
from indexer.sources.resync import Resyncable, UnknownEngineError, resync_engine
from indexer.translate import HashMode, KeyedBlock
from indexer.validation import (
    IndexRequestError,
    ValidationKind,
    validate_match,
    validate_mm_items,
    validate_prefix_match,
)
from indexer.vllm_hash import VllmHashAlgo
from kv_indexer.v1 import kv_indexer_pb2 as kv
from kv_indexer.v1 import kv_indexer_pb2_grpc as kv_grpc
from kvplane.errors import KvplaneError
from kvplane.server import Service, abort_with
from kvplane_api.v1 import index_pb2 as api
from kvplane_api.v1 import index_pb2_grpc as api_grpc

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]
KV_INDEXER_SERVICE = "kv_indexer.v1.KVIndexer"
KV_INDEX_SERVICE = "kvplane.v1.KvIndex"
# Every KvIndex call refuses fields outside its schema: a newer controller's option that an
# older indexer ignored (`mm_items`, `hash_seed`) would change the answer silently.
KV_INDEX_STRICT = frozenset(api.DESCRIPTOR.services_by_name["KvIndex"].methods_by_name)


@dataclass(frozen=True, slots=True)
class IngestCounters:
    """What GetIndexStats reports beyond the backend's own numbers."""

    num_batches_applied: int = 0
    num_events_dropped: int = 0


def _status_of(exc: KvplaneError) -> grpc.StatusCode:
    """The one table from domain errors to gRPC status codes."""
    if isinstance(exc, IndexRequestError):
        if exc.kind is ValidationKind.RESOURCE_EXHAUSTED:
            return grpc.StatusCode.RESOURCE_EXHAUSTED
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, UnknownEngineError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, IndexFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED  # would fail again: not UNAVAILABLE
    return grpc.StatusCode.UNAVAILABLE  # a backend that cannot answer (e.g. Redis down)


async def _fail(context: Context, exc: Exception) -> NoReturn:
    """Abort with the table's status; anything that is not a domain error is a bug: logged
    with its traceback here, and only a generic INTERNAL reaches the client."""
    if isinstance(exc, KvplaneError):
        await abort_with(context, _status_of(exc), str(exc))
    log.error("index request failed", exc_info=exc)
    await abort_with(context, grpc.StatusCode.INTERNAL, "internal error (logged by the indexer)")


class PrefixQueryLimiter:
    """Counts in-flight prefix queries; beyond the limit a query is shed, not queued."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self.num_shed = 0

    async def enter(self, context: Context) -> None:
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            await abort_with(context, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline already expired")
        if self.in_flight >= self.limit:
            self.num_shed += 1
            await abort_with(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"more than {self.limit} concurrent prefix queries; retry later",
            )
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1


class KvIndexerServicer(kv_grpc.KVIndexerServicer):
    def __init__(self, backend: IndexBackend, limiter: PrefixQueryLimiter) -> None:
        self.backend = backend
        self.limiter = limiter
        self.num_batches_applied = 0

    async def ApplyExternalKvBatch(
        self, request: kv.ApplyExternalKvBatchRequest, context: Context
    ) -> kv.ApplyExternalKvBatchResponse:
        try:
            batch = batch_from_proto(request)
            # Validated once, by the backend's apply (both backends check before any change).
            await self.backend.apply(batch)
        except Exception as exc:
            await _fail(context, exc)
        self.num_batches_applied += 1
        return kv.ApplyExternalKvBatchResponse()

    async def MatchExternalKv(
        self, request: kv.MatchExternalKvRequest, context: Context
    ) -> kv.MatchExternalKvResponse:
        hashes = list(request.hashes)
        try:
            validate_match(hashes)
            placements = await self.backend.match(hashes, request.count_as_hit)
            return match_to_proto(placements)
        except Exception as exc:
            await _fail(context, exc)

    async def MatchExternalKvPrefix(
        self, request: kv.MatchExternalKvPrefixRequest, context: Context
    ) -> kv.MatchExternalKvPrefixResponse:
        hashes = list(request.hashes)
        try:
            validate_prefix_match(hashes)
        except Exception as exc:
            await _fail(context, exc)
        await self.limiter.enter(context)
        try:
            result = await self.backend.match_prefix(hashes, request.max_blocks)
            return prefix_to_proto(result)
        except Exception as exc:
            await _fail(context, exc)
        finally:
            self.limiter.leave()

    async def GetExternalKvHitCounts(
        self, request: kv.GetExternalKvHitCountsRequest, context: Context
    ) -> kv.GetExternalKvHitCountsResponse:
        hashes = list(request.hashes)
        try:
            validate_match(hashes)
            counts = await self.backend.hit_counts(hashes)
            response = kv.GetExternalKvHitCountsResponse()
            for key, count in counts:
                response.entries.add(hash=key, hit_count_total=count)
            return response
        except Exception as exc:
            await _fail(context, exc)


class KvIndexServicer(api_grpc.KvIndexServicer):
    def __init__(
        self,
        backend: IndexBackend,
        limiter: PrefixQueryLimiter,
        *,
        default_block_size: int,
        ingest_counters: Callable[[], IngestCounters] = IngestCounters,
        source_of: Callable[[str], Resyncable | None] = lambda worker_id: None,
        keyings: Callable[[], Sequence[api.WorkerKeying]] = tuple,
    ) -> None:
        self.backend = backend
        self.limiter = limiter
        self.default_block_size = default_block_size
        self.ingest_counters = ingest_counters
        # How the configured sources key their workers (GetIndexStats `keyings`).
        self.keyings = keyings
        # The source of this process that feeds a worker (ResyncEngine); None: fed from outside.
        self.source_of = source_of

    async def MatchTokens(
        self, request: api.MatchTokensRequest, context: Context
    ) -> api.MatchTokensResponse:
        block_size = request.block_size or self.default_block_size
        try:
            block_keys = prompt_block_keys(request, block_size)
        except Exception as exc:
            await _fail(context, exc)
        if not block_keys:
            return token_matches_to_proto([], [])
        await self.limiter.enter(context)
        try:
            matches = await self.backend.match_prefix_by_tier(block_keys, 0)
            # Like MatchExternalKvPrefix, a worker without an address is no routing answer.
            served = [_in_request_tokens(m, block_size) for m in matches if m.worker_address]
            return token_matches_to_proto(served, block_keys)
        except Exception as exc:
            await _fail(context, exc)
        finally:
            self.limiter.leave()

    async def GetIndexStats(
        self, request: api.GetIndexStatsRequest, context: Context
    ) -> api.IndexStats:
        try:
            stats = await self.backend.stats()
            counters = self.ingest_counters()
            return stats_to_proto(
                stats,
                num_batches_applied=counters.num_batches_applied,
                num_events_dropped=counters.num_events_dropped,
                keyings=self.keyings(),
            )
        except Exception as exc:
            await _fail(context, exc)

    async def ResyncEngine(
        self, request: api.ResyncEngineRequest, context: Context
    ) -> api.ResyncEngineResponse:
        if not request.engine:
            await abort_with(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "engine is required: the engine's address or worker id",
            )
        try:
            done = await resync_engine(
                self.backend,
                request.engine,
                self.source_of,
                only_if_stream_lost=request.only_if_stream_lost,
            )
        except Exception as exc:
            await _fail(context, exc)
        log.info(
            "engine %s: resync asked; dropped workers %s, %d source(s) resubscribing%s",
            request.engine,
            done.dropped,
            done.resubscribed,
            f"; handed to the holder(s) of its writer lease {done.handed_to}"
            if done.handed_to
            else "",
        )
        return api.ResyncEngineResponse(
            dropped_worker_ids=done.dropped,
            sources_resubscribed=done.resubscribed,
            handed_to=done.handed_to,
        )

    async def DumpIndex(
        self, request: api.DumpIndexRequest, context: Context
    ) -> AsyncIterator[kv.ApplyExternalKvBatchRequest]:
        try:
            async for batch in self.backend.snapshot(request.worker_id or None):
                yield batch_to_proto(batch)
        except Exception as exc:
            await _fail(context, exc)


_VLLM_ALGOS = {
    api.KEY_SPACE_VLLM_SHA256: VllmHashAlgo.SHA256,
    api.KEY_SPACE_VLLM_SHA256_CBOR: VllmHashAlgo.SHA256_CBOR,
}


def source_keying(
    source: ZmqSourceConfig | OpenEngineSourceConfig, root_block: KeyedBlock | None = None
) -> api.WorkerKeying:
    """How `source` keys its worker's blocks, as GetIndexStats reports it (`keyings`): as
    declared, and as the latest root block its engine stored was indexed (`RootBlockSeen`)."""
    worker_id, address = source.worker()
    keying = api.WorkerKeying(worker_id=worker_id, worker_address=address)
    if root_block is not None:
        keying.root_block.token_ids.extend(root_block.token_ids)
        keying.root_block.key = root_block.key
    if source.hash is HashMode.CANONICAL:
        keying.key_space = api.KEY_SPACE_CANONICAL
    elif source.vllm_hash is not None:
        keying.key_space = next(k for k, a in _VLLM_ALGOS.items() if a is source.vllm_hash)
        if source.hash_seed is not None:
            keying.hash_seed = source.hash_seed
    return keying


def prompt_block_keys(request: api.MatchTokensRequest, block_size: int) -> list[BlockKey]:
    """The keys of the prompt's full blocks (at most `max_blocks`) in the requested key space:
    kvplane's canonical keys, or vLLM's own block hashes in sfixed64 (for workers indexed with
    `hash: engine` from vLLM). Raises IndexRequestError (INVALID_ARGUMENT) for a request that
    cannot be hashed."""
    num_blocks = len(request.token_ids) // block_size
    if request.max_blocks:
        num_blocks = min(num_blocks, request.max_blocks)
    tokens = request.token_ids[: num_blocks * block_size]  # one copy, as a list
    items = [MultimodalItem(i.id, i.offset, i.length) for i in request.mm_items]
    validate_mm_items(items, len(request.token_ids))
    try:
        per_block = block_items(items, num_blocks, block_size) if items else None
    except ValueError as exc:
        raise IndexRequestError(ValidationKind.INVALID_ARGUMENT, str(exc)) from None
    if request.key_space == api.KEY_SPACE_CANONICAL:
        return keys.block_keys(
            tokens,
            block_size,
            lora_name=request.lora_name,
            cache_salt=request.cache_salt,
            mm_hashes=None if per_block is None else block_item_ids(per_block),
        )
    algo = _VLLM_ALGOS.get(request.key_space)
    if algo is None:
        raise IndexRequestError(
            ValidationKind.INVALID_ARGUMENT, f"unknown key_space {request.key_space}"
        )
    hashes = vllm_hash.block_hashes(
        tokens,
        block_size,
        algo=algo,
        python_hash_seed=request.hash_seed if request.HasField("hash_seed") else None,
        cache_salt=request.cache_salt,
        lora_name=request.lora_name,
        mm_items=items,
    )
    return [to_sfixed64(h) for h in hashes]


def _in_request_tokens(match: TokenPrefixMatch, block_size: int) -> TokenPrefixMatch:
    """Token counts from the request's block size: every query block holds exactly
    `block_size` tokens (its key hashes them), whether or not the index knows the block's size
    (a REPORT may omit block_sizes)."""
    if (
        match.matched_tokens == match.matched_blocks * block_size
        and match.any_tier_tokens == match.any_tier_blocks * block_size
        and all(t.matched_tokens == t.matched_blocks * block_size for t in match.tiers)
    ):
        return match  # the usual case: the sources reported the sizes
    return TokenPrefixMatch(
        match.worker_id,
        match.worker_address,
        match.matched_blocks,
        match.matched_blocks * block_size,
        tuple(
            TierPrefix(t.tier, t.matched_blocks, t.matched_blocks * block_size) for t in match.tiers
        ),
        match.any_tier_blocks,
        match.any_tier_blocks * block_size,
    )


def index_services(
    backend: IndexBackend,
    *,
    default_block_size: int,
    max_concurrent_prefix_queries: int,
    ingest_counters: Callable[[], IngestCounters] = IngestCounters,
    source_of: Callable[[str], Resyncable | None] = lambda worker_id: None,
    keyings: Callable[[], Sequence[api.WorkerKeying]] = tuple,
) -> tuple[list[Service], KvIndexerServicer, KvIndexServicer]:
    """Both servicers over one backend, as `kvplane.server.Service`s for `create_server`;
    `source_of(worker_id)`: the source of this process that feeds a worker, if any;
    `keyings()`: how the configured sources key their workers now (`source_keying`)."""
    limiter = PrefixQueryLimiter(max_concurrent_prefix_queries)
    kv_indexer = KvIndexerServicer(backend, limiter)
    kv_index = KvIndexServicer(
        backend,
        limiter,
        default_block_size=default_block_size,
        ingest_counters=ingest_counters,
        source_of=source_of,
        keyings=keyings,
    )
    services = [
        Service(
            KV_INDEXER_SERVICE,
            lambda server: kv_grpc.add_KVIndexerServicer_to_server(kv_indexer, server),
            frozenset({"ApplyExternalKvBatch"}),
        ),
        Service(
            KV_INDEX_SERVICE,
            lambda server: api_grpc.add_KvIndexServicer_to_server(kv_index, server),
            frozenset({"ResyncEngine"}),
            KV_INDEX_STRICT,
        ),
    ]
    return services, kv_indexer, kv_index
