"""Opening index backends by URL."""

from __future__ import annotations

import sys

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


async def test_a_redis_url_without_its_backend_is_named_without_its_password(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An install without the Redis backend (its module left out): the error names the URL
    with its password as `***`, as every error about a backend URL does (docs/redis.md)."""
    monkeypatch.setitem(sys.modules, "indexer.redis_backend", None)
    with pytest.raises(ConfigError) as err:
        await open_backend("redis://app:hunter2@h:6379/0")
    assert str(err.value) == (
        "backend 'redis://app:***@h:6379/0': the Redis backend is not available"
    )
