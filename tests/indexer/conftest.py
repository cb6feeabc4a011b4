"""Fixtures of the indexer tests: `backend` runs a test once per registered index backend,
`served_backend` once per backend behind a real kv_indexer.v1 gRPC server."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from indexer.backend import IndexBackend
from tests.indexer.backend_factories import FACTORIES, SERVED_FACTORIES
from tests.indexer.served_backend import ServedBackend


@pytest.fixture(params=sorted(FACTORIES))
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[IndexBackend]:
    async with FACTORIES[request.param](request) as opened:
        yield opened


@pytest.fixture(params=SERVED_FACTORIES)
async def served_backend(request: pytest.FixtureRequest) -> AsyncIterator[ServedBackend]:
    async with FACTORIES[request.param](request) as opened:
        assert isinstance(opened, ServedBackend)
        yield opened
