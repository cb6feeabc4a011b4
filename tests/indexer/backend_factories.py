"""The index backends that the conformance suite (test_conformance.py) runs against.

To add a backend, register an async context manager factory in FACTORIES: it receives the
requesting pytest fixture (so it can use session fixtures such as a running server through
`request.getfixturevalue(...)`) and yields a fresh, EMPTY backend, closing it afterwards.

The `*-grpc` factories put a backend behind a real kv_indexer.v1 server (`ServedBackend`):
the suite's checks of the seed's RPCs then go through a real gRPC client on both backends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import pytest

from indexer.backend import IndexBackend
from indexer.memory_backend import MemoryBackend
from tests.indexer.served_backend import ServedBackend

BackendFactory = Callable[[pytest.FixtureRequest], AbstractAsyncContextManager[IndexBackend]]


@asynccontextmanager
async def memory_backend(_request: pytest.FixtureRequest) -> AsyncIterator[IndexBackend]:
    backend = MemoryBackend()
    try:
        yield backend
    finally:
        await backend.close()


@asynccontextmanager
async def redis_backend(request: pytest.FixtureRequest) -> AsyncIterator[IndexBackend]:
    """A private redis-server (tests/conftest.py), flushed; few buckets keep dumps cheap."""
    from indexer.redis_backend import open_redis_backend

    server = request.getfixturevalue("redis_server")
    server.flushall()
    backend = await open_redis_backend(server.url, buckets=16)
    try:
        yield backend
    finally:
        await backend.close()


@asynccontextmanager
async def redis_cluster_backend(request: pytest.FixtureRequest) -> AsyncIterator[IndexBackend]:
    """A 3-node Redis Cluster (tests/conftest.py), flushed."""
    from indexer.redis_backend import open_redis_backend

    cluster = request.getfixturevalue("redis_cluster")
    cluster.flushall()
    backend = await open_redis_backend(cluster.url, buckets=16)
    try:
        yield backend
    finally:
        await backend.close()


def served(factory: BackendFactory) -> BackendFactory:
    """`factory`'s backend behind a real kv_indexer.v1 server, reached over gRPC."""

    @asynccontextmanager
    async def served_backend(request: pytest.FixtureRequest) -> AsyncIterator[IndexBackend]:
        async with factory(request) as inner:
            backend = await ServedBackend.serve(inner)
            try:
                yield backend
            finally:
                await backend.close()

    return served_backend


FACTORIES: dict[str, BackendFactory] = {
    "memory": memory_backend,
    "redis": redis_backend,
    "redis_cluster": redis_cluster_backend,
    "memory-grpc": served(memory_backend),
    "redis-grpc": served(redis_backend),
}
# The factories whose backends are reached over gRPC (fixture `served_backend`).
SERVED_FACTORIES = ("memory-grpc", "redis-grpc")
