"""`kvplane planner ...` commands."""

from __future__ import annotations

import typer

from kvplane.cli_common import ConfigOption, ListenOption, fail_not_implemented

planner_app = typer.Typer(no_args_is_help=True)


@planner_app.command()
def run(config: ConfigOption = None, listen: ListenOption = None) -> None:
    """Not implemented yet (exits 2): the live planner, which would observe the fleet and act
    through an actuator. Its decision core is built and measured offline (`kvplane bench
    planner`; docs/planner.md)."""
    fail_not_implemented("kvplane planner run")
