"""Runs the indexer process: builds the backend and sources from config, serves gRPC."""

from __future__ import annotations

import logging
from pathlib import Path

from indexer.config import IndexerConfig
from kvplane.server import create_server, serve_until_signal, write_port_file

log = logging.getLogger(__name__)


async def run_indexer(config: IndexerConfig, port_file: Path | None = None) -> None:
    server, port = await create_server(config, [])
    write_port_file(port_file, port)
    log.info("indexer listening on port %d", port)
    await serve_until_signal(server, config.shutdown_grace_s)
