"""Fixtures shared by every component's tests: private redis-server processes (session-scoped;
tests flush what they use)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from redis_servers import RedisClusterNodes, RedisServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for the session (no persistence)."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    """A 3-node Redis Cluster (no replicas) for the session."""
    cluster = RedisClusterNodes(tmp_path_factory.mktemp("redis-cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
