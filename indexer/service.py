"""Runs the indexer process: builds the backend and sources from config, serves gRPC."""

from __future__ import annotations

import logging

from indexer.config import IndexerConfig
from kvplane.server import create_server, serve_until_signal

log = logging.getLogger(__name__)


async def run_indexer(config: IndexerConfig) -> None:
    server, port = await create_server(config, [])
    log.info("indexer listening on port %d", port)
    await serve_until_signal(server, config.shutdown_grace_s)
