"""`kvplane bench ...`: the benchmark command group. Each component adds its benchmarks here."""

from __future__ import annotations

import typer

from kvplane.cli_common import fail_not_implemented

bench_app = typer.Typer(no_args_is_help=True)


@bench_app.command("index")
def bench_index() -> None:
    """The prefix index against Dynamo's RadixTree, and the KVIndexer service."""
    fail_not_implemented("kvplane bench index")
