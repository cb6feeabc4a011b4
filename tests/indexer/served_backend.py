"""An index backend behind a real kv_indexer.v1 server, for the conformance suite.

`ServedBackend` serves a backend the way `kvplane indexer serve` does (`index_services` +
`create_server` on 127.0.0.1 port 0) and sends the seed's four RPCs through a real gRPC
client, so every conformance check of their semantics also covers the wire: conversions,
`optional` and message presence, sfixed64 keys, status mapping. kvplane's extensions that the
seed's service does not have (copies, worker removal, snapshots, stats, the per-tier token
view) go to the backend directly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import grpc

from indexer.backend import (
    IndexBackend,
    IndexStats,
    PrefixMatch,
    PrefixResult,
    TierPlacements,
    TokenPrefixMatch,
    WorkerPlacements,
)
from indexer.batch import Batch, BlockKey, Tier
from indexer.kv_wire import batch_to_proto
from indexer.servicer import index_services
from kv_indexer.v1 import kv_indexer_pb2 as kv
from kv_indexer.v1 import kv_indexer_pb2_grpc as kv_grpc
from kvplane.config import ServerConfig
from kvplane.server import create_server


class ServedBackend:
    """`IndexBackend` whose apply / match / match_prefix / hit_counts are gRPC calls to a real
    server over `inner`; `stub` is that client, for tests that send raw requests."""

    def __init__(
        self, inner: IndexBackend, server: grpc.aio.Server, channel: grpc.aio.Channel
    ) -> None:
        self.inner = inner
        self.name = inner.name
        self.stub = kv_grpc.KVIndexerStub(channel)
        self._server = server
        self._channel = channel

    @classmethod
    async def serve(cls, inner: IndexBackend) -> ServedBackend:
        services, _, _ = index_services(
            inner, default_block_size=16, max_concurrent_prefix_queries=64
        )
        server, port = await create_server(ServerConfig(listen="127.0.0.1:0"), services)
        return cls(inner, server, grpc.aio.insecure_channel(f"127.0.0.1:{port}"))

    async def apply(self, batch: Batch) -> None:
        if any(action.copies for action in batch.actions):
            # Copy counting has no wire form (kvplane's ZMQ ingestion sets it in-process).
            await self.inner.apply(batch)
        else:
            await self.stub.ApplyExternalKvBatch(batch_to_proto(batch))

    async def match(self, hashes: Sequence[BlockKey], count_as_hit: bool) -> list[WorkerPlacements]:
        request = kv.MatchExternalKvRequest(hashes=hashes, count_as_hit=count_as_hit)
        response = await self.stub.MatchExternalKv(request)
        return [
            WorkerPlacements(
                node.worker_id,
                node.address,
                tuple(
                    TierPlacements(
                        Tier(t.tier),
                        tuple(t.hashes),
                        tuple(t.component_masks),
                        tuple(t.block_sizes),
                    )
                    for t in node.hashes_by_tier
                ),
            )
            for node in response.matches
        ]

    async def match_prefix(self, hashes: Sequence[BlockKey], max_blocks: int) -> PrefixResult:
        request = kv.MatchExternalKvPrefixRequest(hashes=hashes, max_blocks=max_blocks)
        response = await self.stub.MatchExternalKvPrefix(request)
        return PrefixResult(
            tuple(
                PrefixMatch(m.worker_id, m.worker_address, m.matched_prefix_blocks)
                for m in response.matches
            ),
            response.best_prefix_blocks,
            response.blocks_read,
        )

    async def hit_counts(self, hashes: Sequence[BlockKey]) -> list[tuple[BlockKey, int]]:
        request = kv.GetExternalKvHitCountsRequest(hashes=hashes)
        response = await self.stub.GetExternalKvHitCounts(request)
        return [(e.hash, e.hit_count_total) for e in response.entries]

    async def match_prefix_by_tier(
        self, hashes: Sequence[BlockKey], max_blocks: int
    ) -> list[TokenPrefixMatch]:
        return await self.inner.match_prefix_by_tier(hashes, max_blocks)

    async def remove_worker(self, worker_id: str) -> int:
        return await self.inner.remove_worker(worker_id)

    def snapshot(self, worker_id: str | None = None) -> AsyncIterator[Batch]:
        return self.inner.snapshot(worker_id)

    async def stats(self) -> IndexStats:
        return await self.inner.stats()

    async def close(self) -> None:
        await self._channel.close()
        await self._server.stop(None)
