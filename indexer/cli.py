"""`kvplane indexer ...` commands."""

from __future__ import annotations

import asyncio

import typer

from indexer.config import IndexerConfig
from kvplane.cli_common import ConfigOption, ListenOption, PortFileOption
from kvplane.config import load_config

indexer_app = typer.Typer(no_args_is_help=True)


@indexer_app.command()
def serve(
    config: ConfigOption = None, listen: ListenOption = None, port_file: PortFileOption = None
) -> None:
    """Serve kv_indexer.v1.KVIndexer and kvplane's token-level match API."""
    from indexer.service import run_indexer

    cfg = load_config(IndexerConfig, config, {"listen": listen})
    asyncio.run(run_indexer(cfg, port_file=port_file))
