"""`kvplane planner ...` commands."""

from __future__ import annotations

import asyncio
import os

import typer

from kvplane.cli_common import ConfigOption
from kvplane.config import load_config

planner_app = typer.Typer(no_args_is_help=True)


@planner_app.command()
def run(config: ConfigOption = None) -> None:
    """Scale pools and drain engines behind a controller (docs/planner.md).

    Engines run as local `kvplane engine serve` processes, or as the pods of a Kubernetes
    Deployment per pool (`live.kubernetes`), registered with the controller the config's
    `live:` section names. Ctrl-C stops the planner and the local engines it started (pods
    keep serving)."""
    from planner.config import PlannerConfig
    from planner.live import run_live

    asyncio.run(run_live(load_config(PlannerConfig, config), os.environ))
