"""Opening index backends by URL."""

from __future__ import annotations

import pytest

from indexer.backends import open_backend
from indexer.batch import Action, ActionType, Batch, Tier
from kvplane.errors import ConfigError


async def test_memory_backend_by_name() -> None:
    backend = await open_backend("memory")
    assert backend.name == "memory"
    await backend.apply(Batch("w", (Action(ActionType.REPORT, Tier.HBM, (1, 2)),), "a:1"))
    assert (await backend.match_prefix([1, 2], 0)).best_prefix_blocks == 2
    await backend.close()


@pytest.mark.parametrize("url", ["", "memcached://x", "redis", "file:///tmp/index"])
async def test_unknown_backends_are_config_errors(url: str) -> None:
    with pytest.raises(ConfigError, match="unknown index backend"):
        await open_backend(url)


async def test_memory_backend_takes_no_options() -> None:
    with pytest.raises(ConfigError, match="no options"):
        await open_backend("memory", prefix="kv")
