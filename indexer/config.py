"""The indexer server's configuration (`kvplane indexer serve --config FILE`)."""

from __future__ import annotations

from kvplane.config import ServerConfig


class IndexerConfig(ServerConfig):
    listen: str = "127.0.0.1:50051"
    backend: str = "memory"
