"""gRPC servicers over an `IndexBackend`: the seed's `kv_indexer.v1.KVIndexer`
(byte-compatible) and kvplane's own `kvplane.v1.KvIndex` (token-level matching, stats, dump).

Thin: convert (`indexer.kv_wire`), validate with the core's rules (`indexer.index`; a batch is
validated by the backend's `apply`, which refuses a bad one before changing anything), call the
backend, convert back. Errors map to status codes through one table (`_status_of`); prefix
queries (MatchExternalKvPrefix, MatchTokens) beyond `max_concurrent_prefix_queries` are shed
with RESOURCE_EXHAUSTED, never queued, and one whose deadline already passed gets
DEADLINE_EXCEEDED. Applies are never shed.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

from indexer import keys
from indexer.backend import IndexBackend
from indexer.index import (
    IndexRequestError,
    ValidationKind,
    validate_match,
    validate_prefix_match,
)
from indexer.kv_wire import (
    batch_from_proto,
    batch_to_proto,
    match_to_proto,
    prefix_to_proto,
    stats_to_proto,
    token_matches_to_proto,
)
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
        batch = batch_from_proto(request)
        try:
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
        except Exception as exc:
            await _fail(context, exc)
        return match_to_proto(placements)

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
        except Exception as exc:
            await _fail(context, exc)
        finally:
            self.limiter.leave()
        return prefix_to_proto(result)

    async def GetExternalKvHitCounts(
        self, request: kv.GetExternalKvHitCountsRequest, context: Context
    ) -> kv.GetExternalKvHitCountsResponse:
        hashes = list(request.hashes)
        try:
            validate_match(hashes)
            counts = await self.backend.hit_counts(hashes)
        except Exception as exc:
            await _fail(context, exc)
        response = kv.GetExternalKvHitCountsResponse()
        for key, count in counts:
            response.entries.add(hash=key, hit_count_total=count)
        return response


class KvIndexServicer(api_grpc.KvIndexServicer):
    def __init__(
        self,
        backend: IndexBackend,
        limiter: PrefixQueryLimiter,
        *,
        default_block_size: int,
        ingest_counters: Callable[[], IngestCounters] = IngestCounters,
    ) -> None:
        self.backend = backend
        self.limiter = limiter
        self.default_block_size = default_block_size
        self.ingest_counters = ingest_counters

    async def MatchTokens(
        self, request: api.MatchTokensRequest, context: Context
    ) -> api.MatchTokensResponse:
        block_size = request.block_size or self.default_block_size
        tokens = list(request.token_ids)
        num_blocks = len(tokens) // block_size
        if request.max_blocks:
            num_blocks = min(num_blocks, request.max_blocks)
        block_keys = keys.block_keys(
            tokens[: num_blocks * block_size],
            block_size,
            lora_name=request.lora_name or None,
            cache_salt=request.cache_salt or None,
        )
        if not block_keys:
            return token_matches_to_proto([], [])
        await self.limiter.enter(context)
        try:
            matches = await self.backend.match_prefix_by_tier(block_keys, 0)
        except Exception as exc:
            await _fail(context, exc)
        finally:
            self.limiter.leave()
        return token_matches_to_proto(matches, block_keys)

    async def GetIndexStats(
        self, request: api.GetIndexStatsRequest, context: Context
    ) -> api.IndexStats:
        try:
            stats = await self.backend.stats()
        except Exception as exc:
            await _fail(context, exc)
        counters = self.ingest_counters()
        return stats_to_proto(
            stats,
            num_batches_applied=counters.num_batches_applied,
            num_events_dropped=counters.num_events_dropped,
        )

    async def DumpIndex(
        self, request: api.DumpIndexRequest, context: Context
    ) -> AsyncIterator[kv.ApplyExternalKvBatchRequest]:
        try:
            async for batch in self.backend.snapshot(request.worker_id or None):
                yield batch_to_proto(batch)
        except Exception as exc:
            await _fail(context, exc)


def index_services(
    backend: IndexBackend,
    *,
    default_block_size: int,
    max_concurrent_prefix_queries: int,
    ingest_counters: Callable[[], IngestCounters] = IngestCounters,
) -> tuple[list[Service], KvIndexerServicer, KvIndexServicer]:
    """Both servicers over one backend, as `kvplane.server.Service`s for `create_server`."""
    limiter = PrefixQueryLimiter(max_concurrent_prefix_queries)
    kv_indexer = KvIndexerServicer(backend, limiter)
    kv_index = KvIndexServicer(
        backend, limiter, default_block_size=default_block_size, ingest_counters=ingest_counters
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
        ),
    ]
    return services, kv_indexer, kv_index
