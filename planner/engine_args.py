"""The `kvplane engine serve` arguments a planner starts its local engines with: `live.engine_args`,
then the pool's own `engine_args`, then the actuator's `--listen` and `--port-file`
(`serve_args`). `check_engine_args` reads them when the planner config loads (`kvplane planner
run`, a `kvplane up` planner member) as `kvplane engine serve` itself reads them
(`engine.cli.engine_config_of_args`: its options, the engine's config model, the model
directory), so that a typo or a wrong value stops the planner at once, one line naming the
setting, rather than failing every engine it starts (each start retried after a backoff)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import typer

from kvplane.errors import ConfigError
from planner.config import PlannerConfig


def serve_args(engine_args: Sequence[str], pool_args: Sequence[str], port_file: Path) -> list[str]:
    """The `kvplane engine serve` arguments of a local engine writing its port to `port_file`."""
    return [*engine_args, *pool_args, "--listen", "127.0.0.1:0", "--port-file", str(port_file)]


def check_engine_args(config: PlannerConfig, where: str) -> None:
    """Raise a ConfigError (`invalid config in WHERE: live.engine_args ...: PROBLEM`) when the
    arguments of a pool's local engines are ones `kvplane engine serve` refuses. Nothing to
    check without `live:` (the offline replay) or with `live.kubernetes` (the Deployment's
    manifest holds the engines' arguments)."""
    from engine.cli import engine_config_of_args  # the engine's CLI: typer, pydantic only

    live = config.live
    if live is None or live.kubernetes is not None:
        return
    checked: set[tuple[str, ...]] = set()
    for number, pool in enumerate(config.pools):
        args = serve_args(live.engine_args, pool.engine_args, Path("engine.port"))
        if tuple(args) in checked:
            continue
        checked.add(tuple(args))
        try:
            engine_config_of_args(args)
        except typer.TyperException as exc:  # what `serve` refuses as a usage error
            problem = exc.format_message()
        except ConfigError as exc:  # its --config file's content
            problem = str(exc)
        else:
            continue
        setting = "live.engine_args"
        if pool.engine_args:
            setting += f" with pools.{number}.engine_args (pool {pool.name})"
        raise ConfigError(
            f"invalid config in {where}: {setting}, the arguments of `kvplane engine serve`: "
            f"{problem}"
        )
