"""`kvplane planner ...` commands."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Annotated

import typer

from kvplane.cli_common import load_command_config

planner_app = typer.Typer(no_args_is_help=True)

# Not the servers' --config: the embedded defaults have no `live:` section (no controller to
# scale engines behind), so the planner cannot run on them alone.
PlannerConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        help="YAML config file with a `live:` section naming the controller "
        "(example: configs/planner.yaml).",
    ),
]


@planner_app.command()
def run(ctx: typer.Context, config: PlannerConfigOption = None) -> None:
    """Scale pools and drain engines behind a controller (docs/planner.md).

    Engines run as local `kvplane engine serve` processes, or as the pods of a Kubernetes
    Deployment per pool (`live.kubernetes`), registered with the controller the config's
    `live:` section names. Ctrl-C stops the planner and the local engines it started (pods
    keep serving)."""
    from planner.config import PlannerConfig
    from planner.engine_args import check_pool_engines
    from planner.live import run_live

    if config is None:
        # A usage error in the words click uses for a required option, and then what the
        # file must hold (a required typer option would not say; the vendored click's own
        # MissingParameter is not public).
        (option,) = (param for param in ctx.command.params if param.name == "config")
        names = " / ".join(f"'{name}'" for name in option.opts)
        ctx.fail(
            f"Missing option {names}. Give a YAML file whose `live:` section names the "
            "controller (example: configs/planner.yaml)."
        )
    planner = load_command_config(PlannerConfig, config)
    check_pool_engines(planner, str(config))  # before any engine starts with them
    asyncio.run(run_live(planner, os.environ))
