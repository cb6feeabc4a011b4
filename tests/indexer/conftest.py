"""Fixtures of the indexer tests: `backend` runs a test once per registered index backend."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from backend_factories import FACTORIES

from indexer.backend import IndexBackend


@pytest.fixture(params=sorted(FACTORIES))
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[IndexBackend]:
    async with FACTORIES[request.param](request) as opened:
        yield opened
