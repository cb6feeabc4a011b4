"""Opens an index backend from its URL: `memory`, `redis://...` or `redis+cluster://...`."""

from __future__ import annotations

import importlib
from typing import Any

from indexer.backend import IndexBackend
from indexer.memory_backend import MemoryBackend
from kvplane.errors import ConfigError

REDIS_SCHEMES = ("redis://", "rediss://", "redis+cluster://", "unix://")


async def open_backend(url: str, **options: Any) -> IndexBackend:
    """The backend named by `url`; options go to the Redis backend (memory takes none).

    Raises ConfigError for an unknown URL, for options the memory backend cannot take, and
    when the Redis backend is not available in this build.
    """
    if url == "memory":
        if options:
            raise ConfigError(f"the memory backend takes no options, got {sorted(options)}")
        return MemoryBackend()
    if url.startswith(REDIS_SCHEMES):
        try:
            module = importlib.import_module("indexer.redis_backend")
        except ModuleNotFoundError as exc:
            if exc.name != "indexer.redis_backend":
                raise
            raise ConfigError(f"backend {url!r}: the Redis backend is not available") from None
        backend: IndexBackend = await module.open_redis_backend(url, **options)
        return backend
    raise ConfigError(
        f"unknown index backend {url!r}: use 'memory', 'redis://HOST:PORT[/DB]' or "
        "'redis+cluster://HOST:PORT'"
    )
